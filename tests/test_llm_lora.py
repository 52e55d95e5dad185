"""LLM(...).generate / chat / stream with LoRA adapters, against PEFT on the same tiny Llama."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kiln import LLM, LoraConfig, SamplingParams
from kiln.checkpoint.peft import convert_peft_adapter, load_lora_dir
from kiln.errors import CheckpointError, RequestError
from tests.utils.fakes import make_tiny_llama_with_tokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(llm, PEFT model, adapter dir, prompt ids): a float32 engine of a tiny Llama and a PEFT
    adapter of random, non-zero A and B on its q, v and down projections."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("llm-lora")
    make_tiny_llama_with_tokenizer(root / "hf")
    llm = LLM(root / "hf", cache_dir=root / "cache", dtype="float32", progress=False)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32),
                           PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    model.save_pretrained(root / "adapter")
    return llm, model.eval(), root / "adapter", llm.tokenizer.encode("the quick brown fox", add_special_tokens=False)


def _peft_greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_an_adapter_directory_gives_peft_output(setup, tmp_path):
    llm, model, adapter_dir, prompt = setup
    expected = _peft_greedy(model, prompt)
    with model.disable_adapter():
        base = _peft_greedy(model, prompt)
    assert expected != base  # the adapter changes the output
    assert llm.generate(prompt, GREEDY, lora=adapter_dir)[0].outputs[0].token_ids == expected
    converted = convert_peft_adapter(adapter_dir, tmp_path / "converted", "float32")
    assert llm.generate(prompt, GREEDY, lora=converted)[0].outputs[0].token_ids == expected
    deltas = [d.token_ids for d in llm.stream(prompt, GREEDY, lora=adapter_dir)]
    assert [t for d in deltas for t in d] == expected
    # one adapter per prompt, or none
    with_lora, without = llm.generate([prompt, prompt], GREEDY, lora=[adapter_dir, None])
    assert with_lora.outputs[0].token_ids == expected and without.outputs[0].token_ids == base


def test_lora_config_by_task_id(setup):
    llm, model, adapter_dir, prompt = setup
    weights, config = load_lora_dir(convert_peft_adapter(adapter_dir, adapter_dir.parent / "npy", "float32"))
    expected = _peft_greedy(model, prompt)
    first = llm.generate(prompt, GREEDY, lora=LoraConfig(5, weights, config))
    assert first[0].outputs[0].token_ids == expected
    assert llm.generate(prompt, GREEDY, lora=LoraConfig(5))[0].outputs[0].token_ids == expected
    with pytest.raises(RequestError, match="task_id 6 has not been given"):
        llm.generate(prompt, GREEDY, lora=LoraConfig(6))
    bad = np.array(config)
    bad[0, 0] = 42
    with pytest.raises(RequestError, match="unknown module_id 42"):
        llm.generate(prompt, GREEDY, lora=LoraConfig(7, weights, bad))
    with pytest.raises(RequestError, match="2 LoRA adapters and 1 prompt tables for 1 prompts"):
        llm.generate([prompt], GREEDY, lora=[None, None])


# -- adapters built into the engine (kiln build --lora_dir) ---------------------------------------


def test_built_in_adapters_by_name(setup, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    llm, model, adapter_dir, prompt = setup
    checkpoint = llm.engine_dir.parent / "checkpoint"  # not kept by the engine cache: convert again
    from kiln.convert import convert_checkpoint

    hf_dir = adapter_dir.parent / "hf"
    convert_checkpoint(hf_dir, checkpoint, progress=False)
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "kiln.cli.main", "build", "--checkpoint_dir", checkpoint,
                          "--output_dir", tmp_path / "engine", "--dtype", "float32", "--lora_dir", adapter_dir,
                          "--lora_target_modules", "attn_q", "attn_v", "mlp_4h_to_h", "attn_k"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "LoRA: max rank 4, modules attn_q attn_k attn_v mlp_4h_to_h, adapters adapter" in run.stdout
    section = json.loads((tmp_path / "engine" / "config.json").read_text())["lora_config"]
    assert section == {"max_lora_rank": 4, "lora_target_modules": ["attn_q", "attn_k", "attn_v", "mlp_4h_to_h"],
                       "dora": False, "adapters": ["adapter"]}
    built = LLM(tmp_path / "engine", progress=False)
    assert built.generate(prompt, GREEDY, lora="adapter")[0].outputs[0].token_ids == _peft_greedy(model, prompt)
    # the engine's bounds hold for adapters given at run time too
    from kiln.checkpoint.lora import LoraModule, pack_lora_tensors

    too_wide = pack_lora_tensors([LoraModule(1, 0, torch.zeros(8, 64), torch.zeros(64, 8))])
    with pytest.raises(RequestError, match="max_lora_rank is 4"):
        built.generate(prompt, GREEDY, lora=LoraConfig(1, *too_wide))
    elsewhere = pack_lora_tensors([LoraModule(4, 0, torch.zeros(2, 64), torch.zeros(64, 2))])
    with pytest.raises(RequestError, match="attn_dense .* is not one this engine applies LoRA to"):
        built.generate(prompt, GREEDY, lora=LoraConfig(2, *elsewhere))


@pytest.mark.parametrize("options, fragment", [
    (dict(max_lora_rank=2), "max_lora_rank is 2"),
    (dict(lora_target_modules=["attn_q"]), "attn_v (id 3) is not one this engine applies LoRA to"),
    (dict(lora_target_modules=["cross_attn_q"]), "--lora_target_modules 'cross_attn_q'"),
])
def test_build_refuses_adapters_outside_its_bounds(setup, tmp_path, options, fragment):
    from kiln.build import build_engine
    from kiln.convert import convert_checkpoint
    from kiln.errors import BuildError

    llm, model, adapter_dir, prompt = setup
    checkpoint = convert_checkpoint(adapter_dir.parent / "hf", tmp_path / "checkpoint", progress=False)
    with pytest.raises(BuildError, match=re.escape(fragment)):
        build_engine(checkpoint, tmp_path / "engine", progress=False, lora_dirs=[adapter_dir], **options)
    assert not (tmp_path / "engine").exists()


# -- DoRA (reference 004: normalized magnitudes, --dora_plugin) -----------------------------------


def test_dora_normalized_by_the_cli_built_and_served(setup, tmp_path):
    """kiln lora normalize-dora, then kiln build --dora_plugin enable; generation equals PEFT's DoRA."""
    import subprocess
    import sys
    from pathlib import Path

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from kiln.convert import convert_checkpoint

    llm, _, adapter_dir, prompt = setup
    hf_dir = adapter_dir.parent / "hf"
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                           PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "up_proj"],
                                          init_lora_weights=False, use_dora=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
            if "lora_magnitude_vector" in name:  # off the base's norms, so DoRA differs from LoRA
                p.mul_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "peft-dora")
    model.eval()
    expected = _peft_greedy(model, prompt)

    def kiln(*args):
        return subprocess.run([sys.executable, "-m", "kiln.cli.main", *map(str, args)], capture_output=True,
                              text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])

    refused = kiln("lora", "convert", "-i", tmp_path / "peft-dora", "-o", tmp_path / "x")
    assert refused.returncode == 2 and "kiln lora normalize-dora" in refused.stderr
    with pytest.raises(CheckpointError, match="normalize-dora"):  # PEFT divides by norms of W the engine may not have
        llm.generate(prompt, GREEDY, lora=tmp_path / "peft-dora")
    run = kiln("lora", "normalize-dora", "-i", tmp_path / "peft-dora", "-o", tmp_path / "dora", "--base_model", hf_dir,
               "--storage_type", "float32")
    assert run.returncode == 0 and "6 DoRA rows normalized" in run.stdout, run.stderr
    assert llm.generate(prompt, GREEDY, lora=tmp_path / "dora")[0].outputs[0].token_ids == expected

    checkpoint = convert_checkpoint(hf_dir, tmp_path / "checkpoint", progress=False)
    plain = kiln("build", "--checkpoint_dir", checkpoint, "--output_dir", tmp_path / "no-dora", "--dtype", "float32",
                 "--lora_dir", tmp_path / "dora")
    assert plain.returncode == 2 and "build with --dora_plugin enable" in plain.stderr
    assert not (tmp_path / "no-dora").exists()
    built = kiln("build", "--checkpoint_dir", checkpoint, "--output_dir", tmp_path / "engine", "--dtype", "float32",
                 "--lora_dir", tmp_path / "dora", "--dora_plugin", "enable")
    assert built.returncode == 0 and "LoRA and DoRA: max rank 4" in built.stdout, built.stderr
    assert LLM(tmp_path / "engine", progress=False).generate(prompt, GREEDY, lora="dora")[0].outputs[0].token_ids \
        == expected
    lora_only = kiln("build", "--checkpoint_dir", checkpoint, "--output_dir", tmp_path / "lora-only", "--dtype",
                     "float32", "--max_lora_rank", 8)
    assert lora_only.returncode == 0, lora_only.stderr
    with pytest.raises(RequestError, match="built without --dora_plugin enable"):
        LLM(tmp_path / "lora-only", progress=False).generate(prompt, GREEDY, lora=tmp_path / "dora")


def test_llm_builds_prompt_tuning_in_when_asked(setup):
    llm, _, adapter_dir, prompt = setup
    vocab = llm.engine.config.vocab_size
    with pytest.raises(RequestError, match="built without it"):  # LLM's default build: no prompt tuning
        llm.generate([vocab] + prompt, GREEDY, prompt_table=torch.randn(1, llm.engine.config.hidden_size))
    tuned = LLM(adapter_dir.parent / "hf", cache_dir=adapter_dir.parent / "cache", dtype="float32", progress=False,
                max_prompt_embedding_table_size=2)
    assert tuned.engine.build_config.max_prompt_embedding_table_size == 2
    table = torch.randn(2, tuned.engine.config.hidden_size, generator=torch.Generator().manual_seed(0))
    virtual = tuned.generate([vocab, vocab + 1] + prompt, GREEDY, prompt_table=table)[0].outputs[0].token_ids
    assert len(virtual) == 8 and virtual != tuned.generate(prompt, GREEDY)[0].outputs[0].token_ids
    with pytest.raises(RequestError, match="3 rows, more than the engine's max_prompt_embedding_table_size 2"):
        tuned.generate(prompt, GREEDY, prompt_table=torch.randn(3, tuned.engine.config.hidden_size))
