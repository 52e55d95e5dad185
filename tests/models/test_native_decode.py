"""The one-call native decode step against the layer-by-layer path it replaces, and where it applies.

Both run the same kernels in the same order, so their logits must be identical, not just close
(HF agreement of batch-1 decode is covered by the model tests, which now take this path); with a
quantized KV cache (INT8, FP8) both also write the same codes.
"""
from __future__ import annotations

import json

import pytest
import torch

import kiln.models.base as base
from kiln import SamplingParams
from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.models.native_decode import NativeDecodeStep, native_decode_for, supports_native_decode
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from tests.conftest import convert_and_build
from tests.quantization.test_smoothquant import NATIVE_W8A8
from tests.utils.tiny_models import make_gpt2, make_llama
from tests.utils.tiny_moe_models import make_deepseek_v2, make_gpt_oss, make_qwen3_moe
from tests.utils.tiny_tokenizer import CORPUS, VOCAB_SIZE, save_tiny_tokenizer


# name: (make_llama options, or another maker's under "maker"; engine dtype or weight-only quant_algo,
# kv_cache_quant_algo)
CASES = {
    "llama-fp32": (dict(num_heads=4, num_kv_heads=2), "float32", None),
    # Every bf16 matmul on AMX tiles (shapes divisible by 16 x 32): steps of any number of tokens.
    "llama-bf16-tied": (dict(num_heads=4, num_kv_heads=1, tie=True, intermediate=128), "bfloat16", None),
    # intermediate 136: the MLP's down projection cannot be tiled, so one-token steps only.
    "qwen2-bias-bf16": (dict(num_heads=4, num_kv_heads=2, model_type="qwen2"), "bfloat16", None),
    # Weight-only 4-bit linears (with zero points): any number of tokens.
    "llama-w4a16": (dict(num_heads=4, num_kv_heads=2, intermediate=128), "W4A16", None),
    # Calibrated modes: AWQ's input multiply; FP8 weights and activations; W4A8's FP8-rounded input.
    "llama-awq": (dict(num_heads=4, num_kv_heads=2, intermediate=128, vocab=VOCAB_SIZE), "W4A16_AWQ", None),
    "llama-fp8": (dict(num_heads=4, num_kv_heads=2, intermediate=128, vocab=VOCAB_SIZE), "FP8", None),
    "llama-w4a8-awq": (dict(num_heads=4, num_kv_heads=2, intermediate=128, vocab=VOCAB_SIZE), "W4A8_AWQ", "INT8"),
    # SmoothQuant W8A8 (int8 activations per token) in a bf16 engine (a bf16 checkpoint's).
    "llama-sq": (dict(num_heads=4, num_kv_heads=2, intermediate=128, vocab=VOCAB_SIZE), "W8A8_SQ_PER_CHANNEL", None),
    "llama3-rope-fp32": (dict(num_heads=8, num_kv_heads=8, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), "float32", None),
    # Quantized KV caches: the step writes int8 / float8 e4m3 codes and reads them back.
    "llama-bf16-int8kv": (dict(num_heads=4, num_kv_heads=2, intermediate=128, vocab=VOCAB_SIZE), "bfloat16", "INT8"),
    "llama-bf16-fp8kv": (dict(num_heads=4, num_kv_heads=2, intermediate=128, vocab=VOCAB_SIZE), "bfloat16", "FP8"),
    "llama-fp32-fp8kv": (dict(num_heads=4, num_kv_heads=1, vocab=VOCAB_SIZE), "float32", "FP8"),
    # Qwen3-MoE (per-head q/k norms; routed experts, 4-bit with zero points, beside a dense layer):
    # the router, routing and experts call inside the step.
    "qwen3-moe-w4a16": (dict(maker=make_qwen3_moe, moe_intermediate=64, intermediate=128), "W4A16", None),
    # DeepSeek-V2-Lite's shape: latent attention (absorbed), a dense first layer, then routed experts
    # with a shared one in the same call and scaled routing weights.
    "deepseek-v2-w4a16": (dict(maker=make_deepseek_v2, kv_lora_rank=40), "W4A16", None),
    # gpt-oss: attention sinks, biased qkv and experts, alternating 8-token windows, YaRN, the
    # clamped SwiGLU.
    "gpt-oss-w4a16": (dict(maker=make_gpt_oss, intermediate=64), "W4A16", None),
}
if not NATIVE_W8A8:  # SmoothQuant's native int8 kernel needs AVX512-VNNI: no native step to compare here
    del CASES["llama-sq"]  # (test_smoothquant checks that such a CPU takes the layer path instead)


@pytest.fixture(scope="module", params=sorted(CASES))
def engine_dir(request, tmp_path_factory):
    options, dtype, kv_algo = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    options = dict(options)
    options.pop("maker", make_llama)(root / "hf", hidden=64, layers=3, **options)
    if dtype == "W4A16":
        quant = QuantConfig(quant_algo="W4A16", group_size=32, has_zero_point=True)
        return convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4}, quantization=quant)
    calibrated = dtype in ("W4A16_AWQ", "FP8", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL")
    if calibrated or kv_algo is not None:  # scales calibrated on a few texts through the tiny tokenizer
        save_tiny_tokenizer(root / "hf")
        calib = root / "calib.jsonl"
        calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
        quant = QuantConfig(quant_algo=dtype if calibrated else None, group_size=64, has_zero_point=calibrated,
                            kv_cache_quant_algo=kv_algo)
        return convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4},
                                 dtype="bfloat16" if dtype == "W8A8_SQ_PER_CHANNEL" else None if calibrated else dtype,
                                 quantization=quant, calib_dataset=str(calib),
                                 calib_size=len(CORPUS))
    return convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4}, dtype=dtype)


def _generate(engine: Engine, prompts: list[list[int]], new_tokens: int, use_native: bool, monkeypatch,
              python_logits: list | None = None, loras: list | None = None):
    """Greedy tokens and every step's logits of each request, all running together (each call of
    the Python path's ``compute_logits`` appended to ``python_logits``, if given; request i
    under LoRA adapter ``loras[i]``, if given)."""
    with monkeypatch.context() as m:
        if not use_native:
            m.setattr(base, "native_decode_for", lambda *args: None)
        if python_logits is not None:
            compute_logits = engine.model.compute_logits
            m.setattr(engine.model, "compute_logits", lambda h: python_logits.append(h) or compute_logits(h))
        core = EngineCore(engine, max_num_seqs=len(prompts), num_blocks=16 * len(prompts))
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        requests = [core.add_request(p, params, end_id=None, return_generation_logits=True, lora=lora)
                    for p, lora in zip(prompts, loras or [None] * len(prompts))]
        while core.has_unfinished:
            core.step()
        native = getattr(engine.model, "_native_decode", None)
        engine.model._native_decode = None  # the next run gathers its own cache's pointers
        return ([r.seqs[0].output_token_ids for r in requests],
                [torch.stack([s[0] for s in r.generation_logits]) for r in requests], native)


@pytest.mark.parametrize("batch", [1, 5, 20])
def test_native_step_equals_layer_by_layer(engine_dir, batch, monkeypatch):
    engine = Engine(engine_dir)
    assert supports_native_decode(engine.model)
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 256, (9 + 4 * i,), generator=gen).tolist() for i in range(batch)]
    python_logits = []
    tokens, logits, native = _generate(engine, prompts, 24, True, monkeypatch, python_logits)
    ref_tokens, ref_logits, unused = _generate(engine, prompts, 24, False, monkeypatch)
    assert isinstance(native, NativeDecodeStep) and unused is None
    # The step's final norm and LM head are native too: at batch 1 only the prompt's step
    # leaves the logits to Python.
    assert native.head is not None
    if batch == 1:
        assert len(python_logits) == 1
    kv_algo = engine.config.quantization.kv_cache_quant_algo
    assert native.dims.kv_kind == {None: 0, "INT8": 1, "FP8": 2}[kv_algo]
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert torch.equal(ours, ref)


def test_lora_and_dora_inside_the_native_step(engine_dir, monkeypatch):
    """A LoRA adapter, a DoRA one and none, one or all at once: the step's adapters go into the
    native call, as the layers' Python path adds them (float32 deltas in another summation
    order, so close rather than identical)."""
    from kiln.bench.common import random_lora_modules
    from kiln.layers.lora import LoraAdapter

    engine = Engine(engine_dir)
    if engine.config.architecture == "DeepseekV2ForCausalLM":  # latent attention: no LoRA adapters
        with pytest.raises(ConfigError, match="LoRA adapters are not supported"):
            engine.model.assign_lora_targets()
        return
    modules = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h")
    plain = LoraAdapter(random_lora_modules(engine.config, 4, modules, seed=0, scale=0.2))
    dora_rows = random_lora_modules(engine.config, 2, modules, seed=1, scale=0.2)
    for row in dora_rows:
        row.magnitude = 1 + 0.2 * torch.randn(row.b.shape[0])
    dora = LoraAdapter(dora_rows)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (9 + 4 * i,), generator=gen).tolist() for i in range(3)]
    fp32 = engine.config.dtype == "float32"
    for batch, loras in (([prompts[0]], [plain]), ([prompts[1]], [dora]), (prompts, [plain, dora, None])):
        calls = []
        with monkeypatch.context() as m:
            lora_weights = NativeDecodeStep._lora_weights
            m.setattr(NativeDecodeStep, "_lora_weights", lambda self, *a: calls.append(1) or lora_weights(self, *a))
            tokens, logits, native = _generate(engine, batch, 6, True, monkeypatch, loras=loras)
        ref_tokens, ref_logits, _ = _generate(engine, batch, 6, False, monkeypatch, loras=loras)
        if len(batch) <= native.max_tokens:
            assert len(calls) == 5  # every decode step ran natively with the adapters
        if fp32:  # bf16 roundings of the deltas may differ by an ulp, and greedy may then part
            assert tokens == ref_tokens
        for ours, ref, seq, ref_seq in zip(logits, ref_logits, tokens, ref_tokens):
            same = next((i for i, (a, b) in enumerate(zip(seq, ref_seq)) if a != b), len(seq))
            torch.testing.assert_close(ours[:same + 1], ref[:same + 1], atol=1e-4 if fp32 else 0.05,
                                       rtol=1e-4 if fp32 else 0.02)


def test_not_used_for_other_models_backends_or_steps(tmp_path, engine_dir):
    make_gpt2(tmp_path / "gpt2")
    gpt2 = Engine(convert_and_build(tmp_path / "gpt2", tmp_path / "kiln", {"tokens_per_block": 4}))
    assert not supports_native_decode(gpt2.model)  # LayerNorm, learned positions, plain MLP

    from kiln.step.attention import NativePagedAttention, TorchPagedAttention
    from kiln.step.kv_cache import allocate_kv_cache
    from kiln.step.metadata import AttentionMetadata

    model = Engine(engine_dir).model
    attn = next(iter(model.transformer.layers.values())).attention
    caches = allocate_kv_cache(3, 4, 4, attn.num_kv_heads, attn.head_size, model.lm_head.weight.dtype)
    one = AttentionMetadata.build(NativePagedAttention(), [1], [3], [[0]], 4)
    assert isinstance(native_decode_for(model, caches, one), NativeDecodeStep)
    reference = AttentionMetadata.build(TorchPagedAttention(), [1], [3], [[0]], 4)
    assert native_decode_for(model, caches, reference) is None  # the reference backend stays pure PyTorch
    mixed = AttentionMetadata.build(NativePagedAttention(), [1, 2], [3, 2], [[0], [1]], 4)
    assert native_decode_for(model, caches, mixed) is None  # a prompt chunk in the step
    many = native_decode_for(model, caches, one).max_tokens + 1
    if many < 64:  # fp32 (and bf16 without AMX): past the skinny GEMM's rows, the library matmuls win
        crowd = AttentionMetadata.build(NativePagedAttention(), [1] * many, [1] * many, [[0]] * many, 4)
        assert native_decode_for(model, caches, crowd) is None


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_stale_nan_in_the_cache_never_reaches_attention(engine_dir, backend):
    # The reference backend reads whole blocks under a mask (so its blocks are zeroed when
    # handed out); the native one reads only written slots (so they are not): either way,
    # garbage left in the cache must not change a result.
    engine = Engine(engine_dir)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (5 + 6 * i,), generator=gen).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(poison: bool):
        core = EngineCore(engine, max_num_seqs=3, num_blocks=40, attention_backend=backend)
        if poison:
            for k, v in core.runner.kv_caches:
                if k.element_size() == 1:  # codes: float8 NaN bytes (int8: stale 127 and -1)
                    k.view(torch.uint8).fill_(0x7F)
                    v.view(torch.uint8).fill_(0xFF)
                else:
                    k.fill_(float("nan"))
                    v.fill_(float("inf"))
        requests = [core.add_request(p, params, end_id=None, return_generation_logits=True) for p in prompts]
        while core.has_unfinished:
            core.step()
        engine.model._native_decode = None
        return [torch.stack([s[0] for s in r.generation_logits]) for r in requests]

    for clean, poisoned in zip(run(False), run(True)):
        assert torch.isfinite(poisoned).all() and torch.equal(clean, poisoned)


def test_profile_accumulates_the_parts_of_a_step_without_changing_it(engine_dir, monkeypatch):
    engine = Engine(engine_dir)
    prompt = [5, 9, 13, 17, 21]
    plain, plain_logits, _ = _generate(engine, [prompt], 6, True, monkeypatch)
    core = EngineCore(engine, max_num_seqs=1, num_blocks=16)
    request = core.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), end_id=None,
                               return_generation_logits=True)
    core.step()  # the prompt: layer by layer
    core.step()  # the first decode step builds the native step
    native = engine.model._native_decode
    native.profile = torch.zeros(3, dtype=torch.float64)
    while core.has_unfinished:
        core.step()
    linear, attention, rest = native.profile.tolist()
    assert linear > 0 and attention > 0 and rest > 0
    assert request.seqs[0].output_token_ids == plain[0]
    assert torch.equal(torch.stack([s[0] for s in request.generation_logits]), plain_logits[0])
    engine.model._native_decode = None


def test_forward_timer_times_the_steps_the_native_step_runs_whole(engine_dir):
    """Benchmarks time the model through ForwardTimer: a decode step that goes to
    ``decode_logits`` instead of ``forward`` must still be one timed call."""
    from kiln.bench.common import ForwardTimer

    engine = Engine(engine_dir)
    timer = ForwardTimer(engine.model)
    core = EngineCore(engine, max_num_seqs=1, num_blocks=16)
    core.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), end_id=None)
    while core.has_unfinished:
        core.step()
    assert len(timer.durations) == 6  # the prompt's forward, then five native decode steps
    timer.remove()
    assert "decode_logits" not in vars(engine.model)
