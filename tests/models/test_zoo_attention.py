"""Attention variants against Hugging Face: sliding windows (Mistral, Gemma 2), attention and
final logit soft-capping and query_pre_attn_scalar (Gemma 2), ALiBi (BLOOM, 6 and 4 heads).

Prompts and generations run well past the windows (window 8 / 6 against prompts of up to 24
tokens and 32 generated ones), through both attention backends, also chunked over 4-token
blocks (so windows start mid-block); the native kernel is also checked on its own against a
PyTorch reference, and the tensor-parallel split of ALiBi slopes and BLOOM's fused qkv.
"""
from __future__ import annotations

import pytest
import torch

import kiln.runtime.model_runner as model_runner
from kiln import SamplingParams
from kiln.build import build_engine, resolve_build_config
from kiln.checkpoint.format import read_config
from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.kernels import paged_decode_attention
from kiln.layers.attention import Attention, alibi_slopes
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.decoder import layer_window
from kiln.models.gemma2 import Gemma2ForCausalLM
from kiln.models.llama import LlamaForCausalLM
from kiln.models.native_decode import NativeDecodeStep, supports_native_decode
import kiln.step.attention as step_attention
from kiln.step.attention import AttentionOptions, select_backend
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from tests.models.zoo import (NEW_TOKENS, built_fixture, check_batched_greedy, check_prompt_logits,
                              hf_reference_fixture)
from tests.utils.compare import kiln_greedy
from tests.utils.tiny_attention_models import make_bloom, make_gemma2, make_mistral_windowed

CASES = {
    "mistral-window8": (make_mistral_windowed, dict(window=8), {}),
    "gemma2": (make_gemma2, {}, {}),
    "bloom-6heads": (make_bloom, dict(heads=6, hidden=96), {}),
    "bloom-4heads": (make_bloom, dict(heads=4, hidden=64), {}),
}
WINDOWS = {"mistral-window8": [8, 8], "gemma2": [6, None, 6], "bloom-6heads": [None, None],
           "bloom-4heads": [None, None]}
NATIVE_DECODE_STEP = {"mistral-window8": True, "gemma2": False, "bloom-6heads": False, "bloom-4heads": False}
BACKENDS = ["torch", "native"]  # the native kernels build here (tests/runtime/test_native_attention.py)

built = built_fixture(CASES)
hf_reference = hf_reference_fixture()  # prompts of 3/7/12/20 tokens, 32 new tokens each


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    """Every ModelRunner of the test uses this attention backend."""
    monkeypatch.setattr(model_runner, "select_backend", lambda name, dtype: select_backend(request.param, dtype))
    return request.param


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logits_match_hf(built, name: str) -> None:
    """float32 logits of prompts of 24/9/15 tokens (longer than the windows) packed in one step equal HF's."""
    case = built(name)
    windows = [layer.attention.window for layer in Engine(case.engine_dir).model.transformer.layers.values()]
    assert windows == WINDOWS[name]
    check_prompt_logits(case)


@pytest.mark.parametrize("name", list(CASES))
def test_batched_greedy_matches_hf(built, hf_reference, backend: str, name: str) -> None:
    """4 prompts sharing every step give HF's 32 greedy tokens, generating far past the window."""
    check_batched_greedy(built(name), *hf_reference(name))


@pytest.mark.parametrize("name", ["mistral-window8", "gemma2", "bloom-6heads"])
def test_chunked_small_block_greedy_matches_hf(built, hf_reference, backend: str, name: str) -> None:
    """4-token KV blocks and an 8-token step budget: prompts are chunked (cached context read
    back under the window) and windows begin mid-block; tokens still equal HF's."""
    prompts, expected = hf_reference(name)
    case = built(name)
    checkpoint = case.work_dir / "checkpoint"
    engine = case.work_dir / "engine-tpb4"
    if not engine.exists():
        build_engine(checkpoint, engine, resolve_build_config(read_config(checkpoint), tokens_per_block=4),
                     progress=False)
    steps: list = []
    ours = kiln_greedy(engine, prompts, NEW_TOKENS, max_num_tokens=8, steps=steps)
    assert any(not completes for step in steps for _, _, completes in step), "no prompt was chunked"
    assert ours == expected


@pytest.mark.parametrize("name", list(CASES))
def test_native_decode_step_only_where_exact(built, name: str) -> None:
    """The one-call native decode step takes the windowed Mistral; it refuses soft-capped
    Gemma 2 and ALiBi BLOOM layers."""
    assert supports_native_decode(Engine(built(name).engine_dir).model) is NATIVE_DECODE_STEP[name]


def test_native_decode_step_passes_the_window(built, hf_reference) -> None:
    """Mistral through the native decode step (the window given to each layer) still gives HF's tokens."""
    name = "mistral-window8"
    engine = Engine(built(name).engine_dir)
    prompts, expected = hf_reference(name)
    core = EngineCore(engine, max_num_seqs=len(prompts), num_blocks=64, attention_backend="native")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    requests = [core.add_request(p, params, end_id=None) for p in prompts]
    while core.has_unfinished:
        core.step()
    step = engine.model._native_decode
    assert isinstance(step, NativeDecodeStep) and [w.window for w in step.weights] == [8, 8]
    assert [r.seqs[0].output_token_ids for r in requests] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, alibi, softcap, sinks", [
    (None, False, None, False), (1, False, None, False), (3, False, None, False), (5, True, None, False),
    (6, False, 0.7, False), (None, True, 0.7, False), (100, False, None, False), (None, False, None, True),
    (128, False, None, True)])
def test_native_kernel_window_alibi_softcap_sinks(dtype, window, alibi, softcap, sinks) -> None:
    """The C decode kernel against explicit scores: sequences of 1..300 tokens in shuffled 4-token
    blocks, GQA, the longest split into context ranges and merged, windows starting mid-block,
    ALiBi slopes of 6 heads, soft-cap, attention sinks (one more logit per head, no value)."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head, block = 6, 2, 32, 4
    lens = [23, 6, 1, 13, 300]
    num_blocks = sum(-(-n // block) for n in lens) + 2
    k_cache = torch.randn(num_blocks, kv_heads, block, head, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block, head, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(order[used:used + -(-n // block)])
        used += -(-n // block)
    width = max(len(t) for t in tables)
    q = torch.randn(len(lens), heads, head, generator=gen).to(dtype)
    slopes = alibi_slopes(heads) if alibi else None
    sink_logits = torch.randn(heads, generator=gen) * 2 if sinks else None
    out = torch.empty_like(q)
    paged_decode_attention(q, k_cache, v_cache, torch.arange(len(lens)),
                           torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lens), out,
                           0.3, window=window, alibi_slopes=slopes, softcap=softcap, sinks=sink_logits)
    for i, (n, table) in enumerate(zip(lens, tables)):
        k = k_cache[table].transpose(1, 2).reshape(-1, kv_heads, head)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[table].transpose(1, 2).reshape(-1, kv_heads, head)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * 0.3
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        relative = torch.arange(n) - (n - 1)
        if alibi:
            scores = scores + slopes[:, None] * relative
        if window is not None:
            scores = scores.masked_fill(relative <= -window, float("-inf"))
        if sinks:
            probs = torch.cat([scores, sink_logits[:, None]], dim=-1).softmax(-1)[:, :-1]
        else:
            probs = scores.softmax(-1)
        ref = torch.einsum("ht,thd->hd", probs, v)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("alibi", [False, True])
def test_explicit_scores_in_query_slices_equal_all_at_once(monkeypatch, alibi) -> None:
    """A long prompt's float32 scores (soft-cap, sinks, ALiBi, window) go a few query rows at a
    time; the slices give what one whole score matrix gives."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 37, 16, generator=gen) for h in (4, 2, 2))
    relative = torch.arange(37)[None, :] - torch.arange(37)[:, None]
    options = AttentionOptions(9, alibi_slopes(4) if alibi else None, 0.9, torch.randn(4, generator=gen))
    whole = step_attention._attend(q, k, v, relative, 0.25, options)
    monkeypatch.setattr(step_attention, "_SCORE_FLOATS", 4 * 37 * 5)  # 5 query rows at a time
    torch.testing.assert_close(step_attention._attend(q, k, v, relative, 0.25, options), whole, atol=1e-6, rtol=1e-6)


def test_alibi_slopes_match_bloom_and_split_by_rank() -> None:
    """ALiBi slopes equal HF BLOOM's (powers of two and not), and each tp rank's attention holds
    its own heads' slopes."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for n in (1, 4, 6, 12, 16, 24, 112):
        assert torch.equal(alibi_slopes(n), _get_alibi_slopes(n, "cpu")), n
    every = alibi_slopes(6)
    for tp in (1, 2, 3):
        parts = [Attention(0, 96, 6, 6, 16, qkv_bias=True, dense_bias=True, rotary=None, tp_size=tp, tp_rank=r,
                           alibi=True).alibi_slopes for r in range(tp)]
        assert all(p.shape == (6 // tp,) for p in parts) and torch.equal(torch.cat(parts), every)


def test_bloom_tp2_checkpoint_splits_heads_and_slopes(built, tmp_path) -> None:
    """``convert --tp_size 2`` of the 6-head BLOOM: each rank's qkv holds [q; k; v] of its 3 heads
    (reassembled, HF's per-head query_key_value), and the rank's model carries those heads' slopes."""
    from safetensors import safe_open

    from kiln.convert import convert_checkpoint

    case = built("bloom-6heads")
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "tp2", tp_size=2, progress=False)
    attn = case.hf.transformer.h[1].self_attention
    per_head = attn.query_key_value.weight.view(6, 3, 16, 96)
    per_head_bias = attn.query_key_value.bias.view(6, 3, 16)
    for rank in (0, 1):
        with safe_open(str(checkpoint / f"rank{rank}.safetensors"), "pt") as f:
            qkv = f.get_tensor("transformer.layers.1.attention.qkv.weight")
            bias = f.get_tensor("transformer.layers.1.attention.qkv.bias")
        mine = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(qkv, per_head[mine].transpose(0, 1).reshape(-1, 96))
        assert torch.equal(bias, per_head_bias[mine].transpose(0, 1).reshape(-1))
        model = DecoderModelForCausalLM.from_checkpoint(checkpoint, rank)
        assert torch.equal(model.transformer.layers["1"].attention.alibi_slopes, alibi_slopes(6)[mine])
        assert hasattr(model.transformer, "ln_embed")


def _gemma2_hf(**fields) -> dict:
    return {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "query_pre_attn_scalar": 24, "sliding_window": 6, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0, **fields}


def _windows(model_cls, hf: dict) -> list:
    config = model_cls.config_from_hf(hf, "float32", Mapping())
    return [layer_window(config, i) for i in range(config.num_hidden_layers)]


def test_window_per_layer_from_each_config_style() -> None:
    """Gemma 2 without layer_types (older configs) slides on even layers; with them, as listed;
    Qwen2 slides from max_window_layers on, only with use_sliding_window; Mistral on every layer."""
    assert _windows(Gemma2ForCausalLM, _gemma2_hf()) == [6, None, 6, None]
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert _windows(Gemma2ForCausalLM, _gemma2_hf(layer_types=types)) == [None, 6, 6, None]
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "sliding_window": 16, "max_window_layers": 1}
    assert _windows(LlamaForCausalLM, {**qwen2, "use_sliding_window": True}) == [None, 16, 16]
    assert _windows(LlamaForCausalLM, {**qwen2, "use_sliding_window": False}) == [None, None, None]
    mistral = {**qwen2, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert _windows(LlamaForCausalLM, mistral) == [16, 16, 16]
    config = Gemma2ForCausalLM.config_from_hf(_gemma2_hf(), "float32", Mapping())
    attn = Gemma2ForCausalLM(config).transformer.layers["0"].attention
    assert attn.scale == 24 ** -0.5 and attn.softcap == 50.0


@pytest.mark.parametrize("field, value", [
    ("layer_types", ["sliding_attention"]), ("layer_types", ["sliding", "full", "sliding", "full"]),
    ("sliding_window", -4), ("sliding_window", 2.5), ("attn_logit_softcapping", 0),
    ("final_logit_softcapping", "30"), ("query_pre_attn_scalar", -1)])
def test_bad_attention_config_names_the_field(field: str, value) -> None:
    config = Gemma2ForCausalLM.config_from_hf(_gemma2_hf(), "float32", Mapping())
    bad = PretrainedConfig.from_dict({**config.to_dict(), field: value})
    with pytest.raises(ConfigError, match=field):
        Gemma2ForCausalLM(bad)


def test_windowed_engine_builds_past_the_window(built) -> None:
    """A sliding window no longer caps the engine's max_seq_len."""
    engine = Engine(built("mistral-window8").engine_dir)
    assert engine.build_config.max_seq_len > 8 * 4
