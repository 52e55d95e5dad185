"""Quantized KV caches, INT8 and FP8 (float8 e4m3): scales calibrated at convert time (max|K| and
max|V| per layer over the type's largest code, 127 or 448, equal to Hugging Face's cached K/V),
codes within half a step of the value, one-byte cache tensors at half the bf16 bytes, and engines
close to the float ones through both attention backends (chunked prompts and decode read the
quantized cache), the one-call native decode step included."""
from __future__ import annotations

import json
import math

import pytest
import torch

import kiln.runtime.model_runner as model_runner
from kiln.build import build_engine
from kiln.checkpoint.format import read_config, read_rank_weights
from kiln.cli.main import main as kiln_main
from kiln.config import QuantConfig
from kiln.convert import convert_checkpoint
from kiln.errors import ConfigError
from kiln.kernels import KV_KINDS
from kiln.models.native_decode import NativeDecodeStep, supports_native_decode
from kiln.quantization.calibration import calibration_texts, calibration_token_ids
from kiln.step.attention import dequantize_kv, quantize_kv, select_backend
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime import kv_blocks
from kiln.runtime.kv_blocks import default_num_blocks
from kiln.step.kv_cache import kv_bytes_per_token, kv_cache_dtype
from kiln.step.metadata import AttentionMetadata
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import load_tokenizer
from tests.utils.compare import kiln_greedy
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import VOCAB_SIZE, save_tiny_tokenizer

CALIB_TEXTS = ["The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
               "A language model predicts the next token; the engine runs it fast on a CPU.",
               "Summarize the following article about checkpoints, engines and paged caches."]
BACKENDS = ["torch", "native"]  # the native kernels build here (tests/runtime/test_native_attention.py)
ALGOS = ["INT8", "FP8"]
CACHE_DTYPES = {"INT8": torch.int8, "FP8": torch.float8_e4m3fn}
CODE_MAX = {"INT8": 127, "FP8": 448}
# Chunked prefill and decode logits over the quantized cache: at most this share of max|logit| away
# from the float-cache engine's (measured: INT8 0.4-0.7%, FP8 1.1%). INT8 keeps every value within
# half a step of max|x| / 127; FP8 within 1/16 of the value itself (3 mantissa bits), so its
# large values move more.
LOGIT_TOLERANCE = {"INT8": 0.02, "FP8": 0.03}
PROMPTS = [torch.randint(3, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 18)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF model, calibration token ids and engines: float / INT8 / FP8 KV, in float32 and bfloat16."""
    root = tmp_path_factory.mktemp("kv_quant")
    hf = make_llama(root / "hf", vocab=VOCAB_SIZE, layers=2)
    save_tiny_tokenizer(root / "hf")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in CALIB_TEXTS))
    convert_checkpoint(root / "hf", root / "ckpt-float", dtype="float32", progress=False)
    for algo in ALGOS:
        convert_checkpoint(root / "hf", root / f"ckpt-{algo}", dtype="float32", progress=False,
                           calib_dataset=str(calib), calib_size=len(CALIB_TEXTS),
                           quantization=QuantConfig(kv_cache_quant_algo=algo))
    engines = {}
    for kv in ("float", *ALGOS):
        for dtype in ("float32", "bfloat16"):
            engines[kv, dtype] = build_engine(root / f"ckpt-{kv}", root / f"engine-{kv}-{dtype}", progress=False,
                                              dtype=dtype)
    token_lists = calibration_token_ids(load_tokenizer(root / "hf"), calibration_texts(str(calib), 8))
    return dict(hf=hf, root=root, calib=calib, token_lists=token_lists, engines=engines)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    """Every ModelRunner of the test uses this attention backend."""
    monkeypatch.setattr(model_runner, "select_backend", lambda name, dtype: select_backend(request.param, dtype))
    return request.param


@pytest.mark.parametrize("algo", ALGOS)
def test_scales_are_max_of_hf_cached_kv_over_code_max(models, algo: str) -> None:
    """The checkpoint's kv_cache_scaling_factor rows equal max|K| and max|V| of what HF caches
    (K after rotary) over the calibration prompts, over 127 (INT8) or 448 (FP8)."""
    assert read_config(models["root"] / f"ckpt-{algo}").quantization.kv_cache_quant_algo == algo
    weights = read_rank_weights(models["root"] / f"ckpt-{algo}", 0)
    absmax = torch.zeros(2, 2)
    with torch.no_grad():
        for ids in models["token_lists"]:
            cache = models["hf"](torch.tensor([ids]), use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                absmax[i, 0] = max(absmax[i, 0], layer.keys.abs().max())
                absmax[i, 1] = max(absmax[i, 1], layer.values.abs().max())
    for i in range(2):
        scales = weights[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
        assert scales.dtype == torch.float32 and scales.shape == (2,)
        torch.testing.assert_close(scales, absmax[i] / CODE_MAX[algo], rtol=1e-5, atol=0)


def _values_over_the_range(scale: float) -> torch.Tensor:
    """K/V-like values of every magnitude from 1e-7 to the calibrated max (448 or 127 codes of
    ``scale``), both signs, plus zeros."""
    g = torch.Generator().manual_seed(0)
    magnitude = torch.logspace(-7, 0, 20000) * torch.rand(20000, generator=g)
    sign = torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0)
    return torch.cat([sign * magnitude, torch.tensor([0.0, -0.0, 1.0, -1.0])]) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_codes_are_within_half_a_step(dtype: torch.dtype) -> None:
    """FP8 write then read: |error| <= 2^-4 |x| (half a step of 3 mantissa bits) for codes of at
    least 2^-6, and <= 2^-10 scale (half the subnormal step 2^-9) below; the bound is reached."""
    scale = torch.tensor(0.037)
    x = (_values_over_the_range(448 * 0.037)).to(dtype)
    codes = quantize_kv(x, scale, torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn and codes.element_size() == 1
    back = dequantize_kv(codes, scale, torch.float32)
    err, ax = (back - x.float()).abs(), x.float().abs()
    bound = torch.maximum(ax * 2.0 ** -4, scale * 2.0 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()
    normal = ax >= scale * 2.0 ** -6
    assert (err[normal] / ax[normal]).max() > 0.9 * 2.0 ** -4  # tight: a truncating cast would double it
    assert err[~normal].max() > 0.9 * scale * 2.0 ** -10


def test_int8_codes_are_within_half_a_step() -> None:
    scale = torch.tensor(0.037)
    x = _values_over_the_range(127 * 0.037)
    codes = quantize_kv(x, scale, torch.int8)
    err = (dequantize_kv(codes, scale, torch.float32) - x).abs()
    assert codes.dtype == torch.int8 and err.max() <= scale / 2 * (1 + 1e-6) and err.max() > 0.45 * scale


@pytest.mark.parametrize("algo", ALGOS)
def test_codes_round_ties_to_even_and_saturate(algo: str) -> None:
    """Values half way between two codes take the even one; values past the range take the
    largest code (never NaN: the clamp comes before PyTorch's cast)."""
    dtype, top = CACHE_DTYPES[algo], CODE_MAX[algo]
    if algo == "INT8":
        codes = torch.arange(-top, top + 1, dtype=torch.float32)
    else:  # every finite non-negative e4m3 value, then the negatives
        codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = torch.cat([codes, -codes[1:]]).sort().values
    ties = (codes[:-1].double() + codes[1:].double()) / 2  # exact in float32
    got = quantize_kv(ties.float(), torch.tensor(1.0), dtype).float()
    below, above = codes[:-1], codes[1:]
    if algo == "INT8":
        even = torch.where(below % 2 == 0, below, above)
    else:  # the code whose mantissa's last bit is 0
        bits = lambda v: v.to(dtype).view(torch.uint8).int()  # noqa: E731
        even = torch.where(bits(below) % 2 == 0, below, above)
    assert torch.equal(got, even)
    far = torch.tensor([top + 0.6, 10.0 * top, 1e30, -(top + 0.6), -1e30])
    assert quantize_kv(far, torch.tensor(1.0), dtype).float().tolist() == [top, top, top, -top, -top]


@torch.inference_mode()
def _stepwise_logits(engine_dir, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` run as a fresh 5-token prompt, a 4-token chunk over the
    cached context, then one token per step (decode): all but the first step read the cache."""
    engine = Engine(engine_dir)
    runner = ModelRunner(engine, num_blocks=math.ceil(len(ids) / engine.build_config.tokens_per_block))
    table = list(range(runner.num_blocks))
    bounds = [0, 5, 9, *range(10, len(ids) + 1)]
    logits = []
    for start, end in zip(bounds, bounds[1:]):
        md = AttentionMetadata.build(runner.backend, [end - start], [end], [table], runner.block_size)
        hidden = engine.model(torch.tensor(ids[start:end]), torch.arange(start, end), md, runner.kv_caches)
        logits.append(engine.model.compute_logits(hidden))
    return torch.cat(logits)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_engine_stays_close_to_float_engine(models, backend: str, dtype: str, algo: str) -> None:
    """Logits of chunked prefill and decode steps over the quantized cache stay within the mode's
    share of max|logit| of the float-cache engine's. Greedy tokens through the runtime (three
    sequences, chunked prompts): each is one the float engine also rates best, within twice that
    share, given the same tokens before it (a random tiny model has near ties, after which free
    runs part: INT8's runs still agree on 80% of tokens)."""
    float_engine, quant_engine = models["engines"]["float", dtype], models["engines"][algo, dtype]
    ids = PROMPTS[2] + PROMPTS[1]
    ours, ref = _stepwise_logits(quant_engine, ids), _stepwise_logits(float_engine, ids)
    diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert 0 < diff <= LOGIT_TOLERANCE[algo] * scale, f"max abs diff {diff:.3e} vs max|ref| {scale:.3e}"
    ours_tokens = kiln_greedy(quant_engine, PROMPTS, 12, max_num_tokens=4)
    for prompt, generated in zip(PROMPTS, ours_tokens):
        assert len(generated) == 12
        rated = _stepwise_logits(float_engine, prompt + generated)[len(prompt) - 1:-1]  # [12, vocab]
        chosen = rated.gather(1, torch.tensor(generated)[:, None])[:, 0]
        assert (rated.max(dim=1).values - chosen <= 2 * LOGIT_TOLERANCE[algo] * scale).all()
    if algo == "INT8":
        ref_tokens = kiln_greedy(float_engine, PROMPTS, 12, max_num_tokens=4)
        pairs = [(a, b) for o, r in zip(ours_tokens, ref_tokens) for a, b in zip(o, r)]
        assert len(pairs) == 36 and sum(a == b for a, b in pairs) >= 0.8 * len(pairs)


@pytest.mark.parametrize("algo", ALGOS)
def test_cache_is_one_byte_and_holds_twice_the_tokens(models, monkeypatch, algo: str) -> None:
    """int8 / float8 e4m3 cache tensors, one byte per element: half of bf16's bytes per token, so
    twice as many blocks fit in the same memory (four times float32's)."""
    dtype = CACHE_DTYPES[algo]
    engine = Engine(models["engines"][algo, "bfloat16"])
    assert kv_cache_dtype(engine.config) == dtype
    runner = ModelRunner(engine, num_blocks=3)
    assert all(k.dtype == v.dtype == dtype and k.element_size() == 1 for k, v in runner.kv_caches)
    quant_bytes, bf16_bytes = (kv_bytes_per_token(2, 2, 16, t) for t in (dtype, torch.bfloat16))
    assert quant_bytes == 2 * 2 * 2 * 16 and bf16_bytes == 2 * quant_bytes
    monkeypatch.setattr(kv_blocks, "available_memory_bytes", lambda: 64 << 20)  # memory binds, not max_seq_len
    blocks = {key: default_num_blocks(Engine(path), 10 ** 6) for key, path in models["engines"].items()}
    assert blocks[algo, "bfloat16"] >= 1.9 * blocks["float", "bfloat16"]
    assert blocks[algo, "float32"] >= 3.9 * blocks["float", "float32"]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_take_the_native_step(models, algo: str, dtype: str) -> None:
    """With the native backend, a quantized-cache engine's decode steps run through the one-call
    native step, which writes the codes itself (its bit-identity with the layer-by-layer path is
    tests/models/test_native_decode.py's)."""
    engine = Engine(models["engines"][algo, dtype])
    assert supports_native_decode(engine.model)
    core = EngineCore(engine, max_num_seqs=2, num_blocks=16, attention_backend="native")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        core.add_request(prompt, params, end_id=None)
    while core.has_unfinished:
        core.step()
    step = engine.model._native_decode
    assert isinstance(step, NativeDecodeStep) and step.dims.kv_kind == KV_KINDS[CACHE_DTYPES[algo]]
    assert all(k.dtype == CACHE_DTYPES[algo] for k, _ in core.runner.kv_caches)


def test_bad_kv_cache_quant_algo_names_the_flag(models, tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match="kv_cache_quant_algo"):
        QuantConfig(kv_cache_quant_algo="INT4")
    with pytest.raises(ConfigError, match="--kv_cache_quant_algo INT8: converts a single-rank"):
        convert_checkpoint(models["root"] / "hf", tmp_path / "tp2", tp_size=2, progress=False,
                           quantization=QuantConfig(kv_cache_quant_algo="INT8"))
    for bad in ("int8", "FP16"):
        assert kiln_main(["convert", "--model_dir", str(models["root"] / "hf"), "--output_dir",
                          str(tmp_path / "cli"), "--kv_cache_quant_algo", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--kv_cache_quant_algo {bad!r} is not one of FP8, INT8" in err
    assert not (tmp_path / "cli").exists()


@pytest.mark.parametrize("algo", ALGOS)
def test_cli_convert_records_the_kv_cache(models, tmp_path, algo: str) -> None:
    out = tmp_path / f"cli-{algo}"
    assert kiln_main(["convert", "--model_dir", str(models["root"] / "hf"), "--output_dir", str(out),
                      "--kv_cache_quant_algo", algo, "--calib_dataset", str(models["calib"]),
                      "--calib_size", "3"]) == 0
    assert read_config(out).quantization.kv_cache_quant_algo == algo
    ref = read_rank_weights(models["root"] / f"ckpt-{algo}", 0)
    got = read_rank_weights(out, 0)
    torch.testing.assert_close(got["transformer.layers.1.attention.kv_cache_scaling_factor"],
                               ref["transformer.layers.1.attention.kv_cache_scaling_factor"])
