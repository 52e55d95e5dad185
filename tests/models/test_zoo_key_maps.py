"""Models read through customised key maps (reference 000): Qwen-1's own names, the language
model inside a LLaVA checkpoint (both layouts transformers has saved), and a user's
``kiln convert --key_map`` for a checkpoint nested under another prefix."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.build import build_engine, resolve_build_config
from kiln.checkpoint.format import read_config
from kiln.cli.main import main as kiln_main
from kiln.errors import BuildError
from tests.models.zoo import built_fixture, hf_reference_fixture, parity_tests
from tests.utils.compare import assert_logits_close, kiln_prompt_logits
from tests.utils.tiny_models import make_llama, make_llava, make_qwen1

CASES = {
    "qwen1": (make_qwen1, {}, {}),
    "llava-llama": (make_llava, {}, {}),
    "llava-mistral-later-layout": (make_llava, dict(text_type="mistral", later_layout=True), {}),
}

built = built_fixture(CASES)
hf_reference = hf_reference_fixture()


test_prompt_logits_match_hf, test_batched_greedy_matches_hf = parity_tests(CASES)


def test_llava_checkpoint_is_its_language_model(built) -> None:
    """kiln records the language model's architecture (what the runtime runs) and where it came from;
    the vision tower and projector are not read."""
    for name, architecture in (("llava-llama", "LlamaForCausalLM"), ("llava-mistral-later-layout", "MistralForCausalLM")):
        config = read_config(built(name).work_dir / "checkpoint")
        assert config.architecture == architecture
        assert config.get("source_architecture") == "LlavaForConditionalGeneration"
        names = load_file(str(built(name).work_dir / "checkpoint" / "rank0.safetensors"))
        assert not [k for k in names if "vision" in k or "projector" in k]


def test_qwen1_engine_stops_at_seq_length(built) -> None:
    """Past seq_length Qwen-1 switches to dynamic NTK rotary and log-n scaling, which kiln does not
    compute: the default build stops there and a longer one is refused, naming the limit."""
    case = built("qwen1")
    checkpoint = case.work_dir / "checkpoint"
    assert resolve_build_config(read_config(checkpoint)).max_seq_len == 64
    with pytest.raises(BuildError, match="64"):
        build_engine(checkpoint, case.work_dir / "too-long", resolve_build_config(read_config(checkpoint),
                                                                                 max_seq_len=128), progress=False)


def run_kiln(capsys, *args) -> tuple[int, str]:
    """``kiln ARGS`` in this process (the CLI's own entry point): exit code and stderr."""
    code = kiln_main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_convert_key_map_reads_a_nested_checkpoint(tmp_path, capsys) -> None:
    """A Llama saved under other prefixes converts with ``--key_map`` (JSON inline or a file) and
    equals HF; without it convert fails naming the tensor it could not find."""
    hf = make_llama(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    nested = {("backbone." + k[len("model."):] if k.startswith("model.") else "head." + k.partition(".")[2]): v
              for k, v in tensors.items()}
    save_file(nested, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    code, err = run_kiln(capsys, "convert", "--model_dir", tmp_path / "hf", "--output_dir", tmp_path / "plain")
    assert code != 0 and "model.embed_tokens.weight" in err
    key_map = {"transformer": "backbone", "lm_head": "head"}
    (tmp_path / "map.json").write_text(json.dumps(key_map))
    for how, value in (("inline", json.dumps(key_map)), ("file", str(tmp_path / "map.json"))):
        code, err = run_kiln(capsys, "convert", "--model_dir", tmp_path / "hf", "--output_dir", tmp_path / how,
                             "--key_map", value)
        assert code == 0, err
    code, err = run_kiln(capsys, "build", "--checkpoint_dir", tmp_path / "file", "--output_dir", tmp_path / "engine",
                         "--dtype", "float32")
    assert code == 0, err
    ids = list(range(3, 20))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_logits_close(kiln_prompt_logits(tmp_path / "engine", ids), ref)


@pytest.mark.parametrize("value, message", [("{\"transformer\": 3}", "name"), ("{not json", "JSON"),
                                            ("missing.json", "neither")])
def test_convert_key_map_errors(tmp_path, capsys, value: str, message: str) -> None:
    """A bad --key_map is a one-line error naming the flag; nothing is written."""
    make_llama(tmp_path / "hf")
    code, err = run_kiln(capsys, "convert", "--model_dir", tmp_path / "hf", "--output_dir", tmp_path / "out",
                         "--key_map", value)
    assert code != 0 and "--key_map" in err and message in err, err
    assert not (tmp_path / "out").exists()
