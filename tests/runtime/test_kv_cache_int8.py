"""INT8 KV cache: scales calibrated at convert time (max|K|/127, max|V|/127 per layer, equal to
Hugging Face's cached K/V), int8 cache tensors at half the bf16 bytes, and engines close to the
float ones through both attention backends (chunked prompts and decode read the int8 cache)."""
from __future__ import annotations

import json
import math

import pytest
import torch

import kiln.runtime.engine_core as engine_core
import kiln.runtime.model_runner as model_runner
from kiln.build import build_engine
from kiln.checkpoint.format import read_config, read_rank_weights
from kiln.cli.main import main as kiln_main
from kiln.config import QuantConfig
from kiln.convert import convert_checkpoint
from kiln.errors import ConfigError
from kiln.models.native_decode import supports_native_decode
from kiln.quantization.calibration import calibration_texts, calibration_token_ids
from kiln.runtime.attention import select_backend
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import default_num_blocks
from kiln.runtime.kv_cache import kv_bytes_per_token, kv_cache_dtype
from kiln.runtime.metadata import AttentionMetadata
from kiln.runtime.model_runner import ModelRunner
from kiln.tokenizer import load_tokenizer
from tests.utils.compare import kiln_greedy
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import VOCAB_SIZE, save_tiny_tokenizer

CALIB_TEXTS = ["The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
               "A language model predicts the next token; the engine runs it fast on a CPU.",
               "Summarize the following article about checkpoints, engines and paged caches."]
BACKENDS = ["torch", "native"]  # the native kernels build here (tests/runtime/test_native_attention.py)
PROMPTS = [torch.randint(3, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 18)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF model, calibration token ids and engines: float / INT8 KV, in float32 and bfloat16."""
    root = tmp_path_factory.mktemp("kv_int8")
    hf = make_llama(root / "hf", vocab=VOCAB_SIZE, layers=2)
    save_tiny_tokenizer(root / "hf")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in CALIB_TEXTS))
    convert_checkpoint(root / "hf", root / "ckpt", dtype="float32", progress=False)
    convert_checkpoint(root / "hf", root / "ckpt-int8", dtype="float32", progress=False, calib_dataset=str(calib),
                       calib_size=len(CALIB_TEXTS), quantization=QuantConfig(kv_cache_quant_algo="INT8"))
    engines = {}
    for ckpt, kv in (("ckpt", "float"), ("ckpt-int8", "int8")):
        for dtype in ("float32", "bfloat16"):
            engines[kv, dtype] = build_engine(root / ckpt, root / f"engine-{kv}-{dtype}", progress=False, dtype=dtype)
    token_lists = calibration_token_ids(load_tokenizer(root / "hf"), calibration_texts(str(calib), 8))
    return dict(hf=hf, root=root, calib=calib, token_lists=token_lists, engines=engines)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    """Every ModelRunner of the test uses this attention backend."""
    monkeypatch.setattr(model_runner, "select_backend", lambda name, dtype: select_backend(request.param, dtype))
    return request.param


def test_scales_are_max_of_hf_cached_kv_over_127(models) -> None:
    """The checkpoint's kv_cache_scaling_factor rows equal max|K| / 127 and max|V| / 127 of what
    HF caches (K after rotary) over the calibration prompts."""
    assert read_config(models["root"] / "ckpt-int8").quantization.kv_cache_quant_algo == "INT8"
    weights = read_rank_weights(models["root"] / "ckpt-int8", 0)
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
        torch.testing.assert_close(scales, absmax[i] / 127, rtol=1e-5, atol=0)


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_stays_close_to_float_engine(models, backend: str, dtype: str) -> None:
    """Logits of chunked prefill and decode steps over the int8 cache stay within 5% of max|logit|
    of the float-cache engine's; most greedy tokens are equal."""
    float_engine, int8_engine = models["engines"]["float", dtype], models["engines"]["int8", dtype]
    ids = PROMPTS[2] + PROMPTS[1]
    ours, ref = _stepwise_logits(int8_engine, ids), _stepwise_logits(float_engine, ids)
    diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert 0 < diff <= 0.05 * scale, f"max abs diff {diff:.3e} vs max|ref| {scale:.3e}"
    ours_tokens = kiln_greedy(int8_engine, PROMPTS, 12, max_num_tokens=4)
    ref_tokens = kiln_greedy(float_engine, PROMPTS, 12, max_num_tokens=4)
    pairs = [(a, b) for o, r in zip(ours_tokens, ref_tokens) for a, b in zip(o, r)]
    assert len(pairs) == 36 and sum(a == b for a, b in pairs) >= 0.8 * len(pairs)


def test_cache_is_int8_and_holds_twice_the_tokens(models, monkeypatch) -> None:
    """int8 cache tensors, one byte per element: half of bf16's bytes per token, so twice as
    many blocks fit in the same memory (four times float32's)."""
    engine = Engine(models["engines"]["int8", "bfloat16"])
    assert kv_cache_dtype(engine.config) == torch.int8
    runner = ModelRunner(engine, num_blocks=3)
    assert all(k.dtype == v.dtype == torch.int8 for k, v in runner.kv_caches)
    int8_bytes, bf16_bytes = (kv_bytes_per_token(2, 2, 16, dtype) for dtype in (torch.int8, torch.bfloat16))
    assert int8_bytes == 2 * 2 * 2 * 16 and bf16_bytes == 2 * int8_bytes
    monkeypatch.setattr(engine_core, "available_memory_bytes", lambda: 64 << 20)  # memory binds, not max_seq_len
    blocks = {key: default_num_blocks(Engine(path), 10 ** 6) for key, path in models["engines"].items()}
    assert blocks["int8", "bfloat16"] >= 1.9 * blocks["float", "bfloat16"]
    assert blocks["int8", "float32"] >= 3.9 * blocks["float", "float32"]
    # The whole-step native decode writes float caches only: an INT8 KV engine decodes layer by layer.
    assert not supports_native_decode(engine.model)
    assert supports_native_decode(Engine(models["engines"]["float", "bfloat16"]).model)


def test_bad_kv_cache_quant_algo_names_the_flag(models, tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match="kv_cache_quant_algo"):
        QuantConfig(kv_cache_quant_algo="INT4")
    with pytest.raises(ConfigError, match="--kv_cache_quant_algo FP8"):
        convert_checkpoint(models["root"] / "hf", tmp_path / "fp8", progress=False,
                           quantization=QuantConfig(kv_cache_quant_algo="FP8"))
    with pytest.raises(ConfigError, match="--kv_cache_quant_algo INT8: converts a single-rank"):
        convert_checkpoint(models["root"] / "hf", tmp_path / "tp2", tp_size=2, progress=False,
                           quantization=QuantConfig(kv_cache_quant_algo="INT8"))
    assert kiln_main(["convert", "--model_dir", str(models["root"] / "hf"), "--output_dir", str(tmp_path / "cli"),
                      "--kv_cache_quant_algo", "int8"]) == 2
    assert "kv_cache_quant_algo" in capsys.readouterr().err
    fp8 = read_config(models["root"] / "ckpt-int8")
    fp8.quantization = QuantConfig(kv_cache_quant_algo="FP8")
    assert kv_cache_dtype(fp8) == torch.float8_e4m3fn  # the runtime has it; convert does not yet


def test_cli_convert_records_int8_kv_cache(models, tmp_path) -> None:
    out = tmp_path / "cli-int8"
    assert kiln_main(["convert", "--model_dir", str(models["root"] / "hf"), "--output_dir", str(out),
                      "--kv_cache_quant_algo", "INT8", "--calib_dataset", str(models["calib"]),
                      "--calib_size", "3"]) == 0
    assert read_config(out).quantization.kv_cache_quant_algo == "INT8"
    ref = read_rank_weights(models["root"] / "ckpt-int8", 0)
    got = read_rank_weights(out, 0)
    torch.testing.assert_close(got["transformer.layers.1.attention.kv_cache_scaling_factor"],
                               ref["transformer.layers.1.attention.kv_cache_scaling_factor"])
