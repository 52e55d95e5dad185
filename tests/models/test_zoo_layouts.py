"""Decoder-layer layout variants against Hugging Face transformers on tiny random float32
models: OPT (pre-norm; post-norm with project_in/out), GPT-J (adjacent-pair rotary on part of
each head), Phi-2 (one shared norm, partial rotary, q/k LayerNorm) and Falcon (7B-style
multi-query parallel, 40B-style KV groups, sequential with biases).

Each case's prompt logits (prompts of different lengths packed in one step) equal HF's and
its batched greedy tokens through the paged runtime equal HF ``generate``'s; the conversion
tests check the fused-qkv reorderings per tensor-parallel rank against HF's own tensors.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln.checkpoint.format import read_config
from kiln.config import PretrainedConfig
from kiln.convert import convert_checkpoint
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.models.falcon import FalconForCausalLM
from kiln.models.llama import LlamaForCausalLM
from kiln.models.native_decode import supports_native_decode
from kiln.models.opt import OPTForCausalLM
from kiln.models.phi import PhiForCausalLM
from kiln.runtime.engine import Engine
from tests.models.zoo import built_fixture, hf_reference_fixture, parity_tests
from tests.utils.tiny_layout_models import make_falcon, make_gptj, make_opt, make_phi

# name -> (maker, maker kwargs, build options)
CASES = {
    "opt-pre-ln": (make_opt, {}, {}),
    "opt-post-ln-project": (make_opt, dict(pre_norm=False, embed_dim=32), {}),
    "gptj": (make_gptj, dict(rotary_dim=8), {}),
    "phi2": (make_phi, dict(partial_rotary=0.4), {}),
    "phi2-qk-layernorm-gqa": (make_phi, dict(partial_rotary=0.5, qk_layernorm=True, kv_heads=2), {}),
    "falcon-7b-mqa": (make_falcon, {}, {}),
    "falcon-40b-gqa": (make_falcon, dict(new_arch=True, heads=4, kv_heads=2), {}),
    "falcon-sequential-bias": (make_falcon, dict(parallel_attn=False, bias=True, multi_query=False), {}),
    # Falcon-RW: ALiBi, sequential, per-head qkv with bias (4 heads: slopes exact in bfloat16, as its reference rounds them)
    "falcon-rw-alibi": (make_falcon, dict(alibi=True, parallel_attn=False, bias=True, multi_query=False), {}),
}

built = built_fixture(CASES)
hf_reference = hf_reference_fixture()


test_prompt_logits_match_hf, test_batched_greedy_matches_hf = parity_tests(CASES)


# What each case's converted config must say, so a case cannot silently test a plainer layout.
LAYOUTS = {
    "opt-pre-ln": dict(norm_after_residual=False, final_norm=True, embedding_dim=64, lm_head_bias=None),
    "opt-post-ln-project": dict(norm_after_residual=True, final_norm=False, embedding_dim=32),
    "gptj": dict(parallel_residual=True, shared_layernorm=True, rotary_dim=8, head_size=16, lm_head_bias=True),
    "phi2": dict(parallel_residual=True, shared_layernorm=True, rotary_pct=0.4, qk_layernorm=False, lm_head_bias=True),
    "phi2-qk-layernorm-gqa": dict(qk_norm=True, qk_layernorm=True, num_key_value_heads=2, rotary_pct=0.5),
    "falcon-7b-mqa": dict(parallel_residual=True, shared_layernorm=True, num_key_value_heads=1,
                          qkv_per_head=False, attn_bias=False),
    "falcon-40b-gqa": dict(parallel_residual=True, shared_layernorm=False, num_key_value_heads=2,
                           qkv_per_head=True),
    "falcon-sequential-bias": dict(parallel_residual=False, num_key_value_heads=4, qkv_per_head=True,
                                   attn_bias=True, mlp_bias=True),
    "falcon-rw-alibi": dict(position_embedding_type="alibi", parallel_residual=False, qkv_per_head=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_case_has_its_layout(built, name: str) -> None:
    """Each case converts into the layout it is meant to cover (and the engine's modules show it)."""
    case = built(name)
    config = read_config(case.work_dir / "checkpoint")
    assert {field: config.get(field) for field in LAYOUTS[name]} == LAYOUTS[name]
    model = Engine(case.engine_dir).model
    layer = model.transformer.layers["0"]
    assert (layer.post_layernorm is None) == bool(config.get("shared_layernorm"))
    assert hasattr(model.transformer, "ln_f") == config.get("final_norm", True)
    assert hasattr(model.transformer, "project_in") == (name == "opt-post-ln-project")
    assert (model.lm_head.bias is not None) == bool(config.get("lm_head_bias"))


@pytest.mark.parametrize("name", list(CASES))
def test_layout_variants_take_the_layer_by_layer_path(built, name: str) -> None:
    """None of these layouts is the LLaMA shape the native decode step computes (LayerNorm,
    post-norm, shared-norm parallel layers): every step runs layer by layer."""
    assert not supports_native_decode(Engine(built(name).engine_dir).model)


def _llama_shaped(**extra) -> LlamaForCausalLM:
    config = PretrainedConfig(architecture="LlamaForCausalLM", dtype="float32", vocab_size=64, hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=2, hidden_act="silu", intermediate_size=48,
                              norm_epsilon=1e-6, max_position_embeddings=64, position_embedding_type="rope_gpt_neox",
                              extra=extra)
    model = LlamaForCausalLM(config, engine_layout=True)
    for p in model.parameters():
        p.data.normal_()
    return model


@pytest.mark.parametrize("extra, native", [
    ({}, True),
    ({"norm_after_residual": True}, False),
    ({"parallel_residual": True}, False),
    ({"parallel_residual": True, "shared_layernorm": True}, False),
    ({"qk_norm": True, "qk_layernorm": True}, False),
    ({"final_norm": False, "lm_head_bias": True, "embedding_dim": 16}, True),  # outside the layers: still exact
], ids=["llama", "post-norm", "parallel", "parallel-shared-norm", "qk-layernorm", "outside-the-layers"])
def test_native_decode_refuses_layer_shapes_it_cannot_compute(extra: dict, native: bool) -> None:
    """With RMSNorm everywhere, each layout field alone decides whether the native step applies."""
    assert supports_native_decode(_llama_shaped(**extra)) is native


# -- conversion: positions and fused-qkv reorderings, per tensor-parallel rank ----------------------

def _rank_tensors(checkpoint: Path, rank: int, *names: str) -> list[torch.Tensor]:
    with safe_open(str(checkpoint / f"rank{rank}.safetensors"), "pt") as f:
        return [f.get_tensor(name) for name in names]


def test_opt_positions_drop_the_two_offset_rows(built) -> None:
    """HF's OPT reads position p from row p + 2: kiln's table starts at HF's row 2."""
    case = built("opt-pre-ln")
    (table,) = _rank_tensors(case.work_dir / "checkpoint", 0, "transformer.position_embedding.weight")
    hf_table = case.hf.model.decoder.embed_positions.weight
    assert hf_table.shape[0] == table.shape[0] + 2
    assert torch.equal(table, hf_table[2:])


def _check_qkv_split(checkpoint: Path, tensor: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Rank r of 2 holds [q; k; v] of its half of the query heads and of the KV heads (a single
    KV head on both ranks); ``q``/``k``/``v`` are ``[heads, head_size, ...]`` in HF's head order."""
    for rank in (0, 1):
        (ours,) = _rank_tensors(checkpoint, rank, tensor)
        half_q = q.shape[0] // 2
        kv = slice(rank * k.shape[0] // 2, (rank + 1) * k.shape[0] // 2) if k.shape[0] > 1 else slice(0, 1)
        parts = [q[rank * half_q:(rank + 1) * half_q], k[kv], v[kv]]
        expected = torch.cat([p.reshape(-1, *q.shape[2:]) for p in parts])
        assert torch.equal(ours, expected), f"rank {rank}"


def test_gptj_rotary_pairs_reordered_per_head_then_split(built, tmp_path) -> None:
    """Each q and k head's first rotary_dim rows go even dims then odd ones (v untouched), before
    the heads are split over the ranks."""
    case = built("gptj")
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "tp2", tp_size=2, progress=False)
    attn, rot = case.hf.transformer.h[0].attn, case.hf.config.rotary_dim
    order = list(range(0, rot, 2)) + list(range(1, rot, 2)) + list(range(rot, 16))
    heads = {name: getattr(attn, f"{name}_proj").weight.view(4, 16, -1) for name in "qkv"}
    _check_qkv_split(checkpoint, "transformer.layers.0.attention.qkv.weight",
                     heads["q"][:, order], heads["k"][:, order], heads["v"])


def _falcon_qkv(case, groups: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF's query_key_value of layer 0 (weight and bias, if any) as q, k, v heads, per group of
    ``groups`` KV heads: [the group's q heads; its k; its v]."""
    attn = case.hf.transformer.h[0].self_attention.query_key_value
    out = {}
    for name in ("weight", "bias"):
        t = getattr(attn, name)
        if t is not None:
            g = t.view(groups, -1, 16, *t.shape[1:])
            out[name] = (g[:, :-2].reshape(-1, 16, *t.shape[1:]), g[:, -2], g[:, -1])
    return out


@pytest.mark.parametrize("name, groups", [("falcon-40b-gqa", 2), ("falcon-sequential-bias", 4)])
def test_falcon_per_group_qkv_is_reordered_and_split_by_groups(built, tmp_path, name: str, groups: int) -> None:
    """40B-style rows per KV group (2 q heads, k, v) and per-head rows (q, k, v of each head):
    each rank gets [q; k; v] of its own groups, weight and bias alike."""
    case = built(name)
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "tp2", tp_size=2, progress=False)
    tensors = _falcon_qkv(case, groups)
    assert set(tensors) == ({"weight", "bias"} if name == "falcon-sequential-bias" else {"weight"})
    for param, (q, k, v) in tensors.items():
        _check_qkv_split(checkpoint, f"transformer.layers.0.attention.qkv.{param}", q, k, v)


def test_falcon_multi_query_qkv_replicates_the_kv_head(built, tmp_path) -> None:
    """7B-style [all q; k; v]: each rank takes half the query heads and the one KV head."""
    case = built("falcon-7b-mqa")
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "tp2", tp_size=2, progress=False)
    fused = case.hf.transformer.h[0].self_attention.query_key_value.weight.view(6, 16, -1)
    _check_qkv_split(checkpoint, "transformer.layers.0.attention.qkv.weight", fused[:4], fused[4:5], fused[5:])


# -- what is refused -------------------------------------------------------------------------

FALCON = dict(architectures=["FalconForCausalLM"], vocab_size=256, hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4)


@pytest.mark.parametrize("model_cls, hf, field", [
    (FalconForCausalLM, dict(FALCON, new_decoder_architecture=True, parallel_attn=False), "parallel_attn"),
    (OPTForCausalLM, dict(architectures=["OPTForCausalLM"], vocab_size=256, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=128, layer_norm_elementwise_affine=False),
     "layer_norm_elementwise_affine"),
    (FalconForCausalLM, dict(FALCON, apply_residual_connection_post_layernorm=True),
     "apply_residual_connection_post_layernorm"),
    (PhiForCausalLM, dict(architectures=["PhiForCausalLM"], model_type="phi-msft"), "phi-msft"),
], ids=["falcon-new-arch-sequential", "opt-norm-without-weights", "falcon-residual-post-norm",
        "phi-msft"])
def test_unsupported_options_name_their_field(model_cls, hf: dict, field: str) -> None:
    """Options these families do not implement are refused on conversion, naming the field."""
    with pytest.raises(ConfigError, match=field):
        model_cls.config_from_hf(hf, "float32", Mapping())
