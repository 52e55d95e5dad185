"""LoRA on hybrid models (recurrent mixers beside attention) against Hugging Face PEFT: adapters
on every linear PEFT can target in each family (the mixers' projections, attention, the MLP)."""
from __future__ import annotations

import pytest
import torch

from kiln.checkpoint.lora import LORA_MODULE_IDS, LoraModule, pack_lora_tensors
from kiln.checkpoint.peft import peft_to_lora_modules
from kiln.errors import CheckpointError, RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.lora_cache import parse_adapter
from tests.conftest import convert_and_build
from tests.runtime.test_lora_runtime import PROMPT, _hf_greedy, _kiln_greedy
from tests.utils import tiny_hybrid_models as tiny

# name -> (maker, maker kwargs, PEFT target modules)
CASES = {
    "lfm2": (tiny.make_lfm2, {}, ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"]),
    "qwen3.5": (tiny.make_qwen3_5, {}, ["q_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                                        "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen3-next": (tiny.make_qwen3_next, {}, ["k_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]),
    "granite-hybrid": (tiny.make_granite_hybrid, {}, ["q_proj", "o_proj", "in_proj", "out_proj", "input_linear",
                                                      "output_linear"]),
    # (PEFT refuses a Mamba out_proj for nemotron_h: its CUDA kernels read the weight directly)
    "nemotron-h": (tiny.make_nemotron_h, {}, ["in_proj", "q_proj", "o_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """name -> (HF directory, float32 engine), built on first use."""
    root, made = tmp_path_factory.mktemp("lora-hybrid"), {}

    def get(name: str):
        if name not in made:
            maker, kwargs, _ = CASES[name]
            maker(root / name / "hf", **kwargs)
            made[name] = (root / name / "hf", Engine(convert_and_build(root / name / "hf", root / name / "kiln",
                                                                      {"tokens_per_block": 4}, dtype="float32")))
        return made[name]
    return get


def _peft_model(hf_dir, targets: list[str], seed: int = 0):
    """The HF model under a PEFT adapter of random, non-zero A and B on ``targets``, and its rows
    as a request carries them (converted and packed)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    adapter_dir = hf_dir.parent / f"adapter-{seed}"
    model.save_pretrained(adapter_dir)
    return model.eval(), pack_lora_tensors(peft_to_lora_modules(adapter_dir))


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_lora_matches_peft(engines, name: str) -> None:
    hf_dir, engine = engines(name)
    model, (weights, config) = _peft_model(hf_dir, CASES[name][2])
    expected_tokens, expected_logits = _hf_greedy(model, PROMPT)
    with model.disable_adapter():
        base_tokens, base_logits = _hf_greedy(model, PROMPT)
    assert not torch.allclose(expected_logits, base_logits, atol=1e-3)  # the adapter changes the output
    adapter = parse_adapter(weights, config, engine.config, engine.lora_config, "lora")
    ((tokens, logits), (plain, _)) = _kiln_greedy(engine, [PROMPT, PROMPT], [adapter, None])
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert plain == base_tokens  # the other sequence of the batch kept the base model


def test_a_module_a_layer_lacks_is_refused(engines) -> None:
    """LFM2's layer 0 is a convolution (no attn_q), layer 2 attention (no mixer_in); Qwen3-Next's
    sparse layers have no dense MLP for a shared expert's adapter to land on."""
    _, engine = engines("lfm2")
    for module, layer, missing in (("attn_q", 0, "layer 0 has no attn_q"), ("mixer_in", 2, "layer 2 has no mixer_in")):
        out = 64 if module == "attn_q" else 192
        row = LoraModule(LORA_MODULE_IDS[module], layer, torch.ones(2, 64), torch.ones(out, 2))
        with pytest.raises(RequestError, match=missing):
            parse_adapter(*pack_lora_tensors([row]), engine.config, engine.lora_config, "lora")
    _, engine = engines("qwen3-next")
    row = LoraModule(LORA_MODULE_IDS["mlp_h_to_4h"], 0, torch.ones(2, 64), torch.ones(48, 2))
    with pytest.raises(RequestError, match="layer 0 has no mlp_h_to_4h"):
        parse_adapter(*pack_lora_tensors([row]), engine.config, engine.lora_config, "lora")


def test_peft_expert_adapters_are_refused(engines) -> None:
    hf_dir, _ = engines("qwen3-next")
    adapter_dir = hf_dir.parent / "adapter-experts"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')
    from safetensors.torch import save_file
    key = "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_{}.weight"
    save_file({key.format("A"): torch.ones(2, 32), key.format("B"): torch.ones(64, 2)},
              str(adapter_dir / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="adapts an expert"):
        peft_to_lora_modules(adapter_dir)
