"""kiln against Hugging Face transformers on tiny random float32 models.

Each case saves a tiny HF model, converts and builds it with kiln, and compares kiln's
prompt logits (one packed step) with HF's forward pass; greedy generation of a batch of
different-length prompts must give HF's tokens exactly, also with small KV blocks and a
token budget that forces prompts to be chunked over several steps.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from kiln.build import build_engine, resolve_build_config
from kiln.checkpoint.format import read_config
from tests.models.zoo import (NEW_TOKENS, built_fixture, check_batched_greedy, check_prompt_logits,
                              hf_reference_fixture)
from tests.utils.compare import kiln_greedy, resave_as_torch_bin
from tests.utils.tiny_models import make_gemma, make_gpt2, make_gpt_neox, make_llama, make_phi3


def make_gpt2_sharded(path: Path, **kwargs):
    """A tiny GPT-2 saved as sharded safetensors (``model.safetensors.index.json`` + shards)."""
    hf = make_gpt2(path.parent / f"{path.name}-single", **kwargs)
    hf.save_pretrained(path, max_shard_size="20KB")
    return hf


def make_bin(make: Callable) -> Callable:
    """``make`` followed by turning its safetensors file into ``pytorch_model.bin``."""
    def make_then_resave(path: Path, **kwargs):
        hf = make(path, **kwargs)
        resave_as_torch_bin(path)
        return hf
    return make_then_resave


# name -> (maker, maker kwargs, build options)
CASES: dict[str, tuple[Callable, dict, dict]] = {
    "llama-mha": (make_llama, dict(num_heads=4, num_kv_heads=4), {}),
    "llama-gqa": (make_llama, dict(num_heads=4, num_kv_heads=2), {}),
    "llama-mqa": (make_llama, dict(num_heads=4, num_kv_heads=1), {}),
    "llama-tied": (make_llama, dict(tie=True), {}),
    "llama-rope-linear": (make_llama, dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
    # max_positions 16 < the 24-token prompt, so the dynamic NTK base really grows.
    "llama-rope-dynamic": (make_llama, dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_positions=16),
                           {"max_seq_len": 64}),
    "llama-rope-llama3": (make_llama, dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16}), {}),
    "mistral": (make_llama, dict(model_type="mistral", num_heads=4, num_kv_heads=2), {}),
    "qwen2": (make_llama, dict(model_type="qwen2"), {}),
    "qwen3": (make_llama, dict(model_type="qwen3", num_heads=4, num_kv_heads=2), {}),
    "gemma": (make_gemma, {}, {}),
    "phi3": (make_phi3, {}, {}),
    "gpt-neox": (make_gpt_neox, {}, {}),
    "gpt-neox-sequential": (make_gpt_neox, dict(parallel_residual=False), {}),
    "llama-sharded": (make_llama, dict(max_shard_size="20KB"), {}),
    "llama-bin": (make_bin(make_llama), {}, {}),
    "gpt2": (make_gpt2, {}, {}),
    "gpt2-sharded": (make_gpt2_sharded, {}, {}),
    "gpt2-bin": (make_bin(make_gpt2), {}, {}),
}


built = built_fixture(CASES)
hf_reference = hf_reference_fixture()


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logits_match_hf(built, name: str) -> None:
    """kiln's float32 logits for prompts of 24/9/15 tokens packed in one step equal HF's."""
    check_prompt_logits(built(name))


@pytest.mark.parametrize("name, expected, absent", [
    ("llama-sharded", "model.safetensors.index.json", "model.bin"),
    ("gpt2-sharded", "model.safetensors.index.json", "model.bin"),
    ("llama-bin", "pytorch_model.bin", "model.safetensors"),
    ("gpt2-bin", "pytorch_model.bin", "model.safetensors"),
])
def test_format_cases_use_that_format(built, name: str, expected: str, absent: str) -> None:
    """The format cases above really exercise sharded safetensors and ``.bin`` files."""
    hf_dir = built(name).hf_dir
    assert (hf_dir / expected).is_file(), sorted(p.name for p in hf_dir.iterdir())
    assert not list(hf_dir.glob(f"*{Path(absent).suffix}")), sorted(p.name for p in hf_dir.iterdir())
    if expected.endswith("index.json"):
        assert len(list(hf_dir.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2", "qwen3", "gemma", "phi3", "gpt-neox"])
def test_batched_greedy_matches_hf(built, hf_reference, name: str) -> None:
    """4 prompts (3/7/12/20 tokens) sharing every step give HF's 32 greedy tokens each."""
    check_batched_greedy(built(name), *hf_reference(name))


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_chunked_small_block_greedy_matches_hf(built, hf_reference, name: str) -> None:
    """With 4-token KV blocks and an 8-token step budget (prompts chunked), tokens still equal HF's."""
    prompts, expected = hf_reference(name)
    case = built(name)
    checkpoint = case.work_dir / "checkpoint"
    engine = build_engine(checkpoint, case.work_dir / "engine-tpb4",
                          resolve_build_config(read_config(checkpoint), tokens_per_block=4), progress=False)
    steps: list = []
    ours = kiln_greedy(engine, prompts, NEW_TOKENS, max_num_tokens=8, steps=steps)
    assert max(sum(n for _, n, _ in step) for step in steps) <= 8
    assert any(not completes for step in steps for _, _, completes in step), "no prompt was chunked"
    assert ours == expected


def test_phi3_fused_gate_up_splits_into_fc_and_gate_per_rank(built, tmp_path) -> None:
    """Phi-3's gate_up_proj holds both gated-MLP inputs: each tp rank takes its slice of each half."""
    from safetensors import safe_open

    from kiln.convert import convert_checkpoint

    case = built("phi3")
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "tp2", tp_size=2, progress=False)
    fused = case.hf.model.layers[0].mlp.gate_up_proj.weight
    half = fused.shape[0] // 2
    parts = {"fc": [], "gate": []}
    for rank in (0, 1):
        with safe_open(str(checkpoint / f"rank{rank}.safetensors"), "pt") as f:
            for name in parts:
                parts[name].append(f.get_tensor(f"transformer.layers.0.mlp.{name}.weight"))
    assert torch.equal(torch.cat(parts["fc"]), fused[:half]) and torch.equal(torch.cat(parts["gate"]), fused[half:])
    assert parts["fc"][0].shape[0] == half // 2


def test_gpt_neox_per_head_qkv_is_reordered_and_split_by_heads(built, tmp_path) -> None:
    """query_key_value rows come per head (q, k, v of head 0, then head 1...): each tp rank
    gets [q; k; v] of its own heads."""
    from safetensors import safe_open

    from kiln.convert import convert_checkpoint

    case = built("gpt-neox")
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "tp2", tp_size=2, progress=False)
    config = case.hf.config
    head = config.hidden_size // config.num_attention_heads
    per_head = case.hf.gpt_neox.layers[0].attention.query_key_value.weight.view(config.num_attention_heads, 3, head, -1)
    for rank in (0, 1):
        with safe_open(str(checkpoint / f"rank{rank}.safetensors"), "pt") as f:
            qkv = f.get_tensor("transformer.layers.0.attention.qkv.weight")
        heads = per_head[rank * 2:(rank + 1) * 2]  # 4 heads over 2 ranks
        assert torch.equal(qkv, heads.transpose(0, 1).reshape(-1, config.hidden_size))
