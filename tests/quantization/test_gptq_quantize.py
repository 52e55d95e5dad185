"""GPTQ at convert time (W4A16_GPTQ): the blocked Cholesky algorithm against a plain
column-by-column reference written from the optimal-brain-surgeon update, round-to-nearest
when nothing can be compensated, lower output error than round-to-nearest where inputs are
correlated, act-order with kiln's contiguous groups, a tiny Llama end to end (GPTQ, and AWQ's
scales with GPTQ's rounding), clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.quantization import dequantize, quantize_weight
from kiln.quantization.awq import search_clip
from kiln.quantization.calibrated import CalibrationOptions, calibrate_model
from kiln.quantization.gptq_quantize import gptq_quantize_weight
from kiln.quantization.weight_only import codes_4bit, group_params
from tests.conftest import convert_and_build
from tests.utils.compare import kiln_prompt_logits
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import save_tiny_tokenizer


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _correlated_rows(n: int, features: int, seed: int) -> torch.Tensor:
    """Rows with strongly correlated features and a few loud channels, as LLM activations (one
    correlation structure for every ``seed``, which only draws other rows)."""
    mix = torch.eye(features) + 0.6 * _randn(features, features, seed=100) / features ** 0.5
    x = _randn(n, features, seed=seed) @ mix
    x[:, [2, 9, 33]] *= 8.0
    return x


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.double().t() @ x.double() / x.shape[0]


def _output_error(x: torch.Tensor, weight: torch.Tensor, tensors: dict, group_size: int) -> float:
    return (x.double() @ (weight - dequantize(tensors, 4, group_size)).double().t()).pow(2).sum().item()


def _reference_gptq(weight, hessian, group_size, has_zero_point, order, static_groups, damp=0.01):
    """GPTQ one column at a time in float64, from the optimal-brain-surgeon update with the
    explicit inverse Hessian (no Cholesky, no blocks): quantize column q, move the other
    columns by ``-err / Hinv[q, q] * Hinv[q, :]``, then eliminate q from ``Hinv``. Returns the
    dequantized weight."""
    w = weight.double().clone()
    h = hessian.double().clone()
    h += damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    out_features, in_features = w.shape
    params = {}
    if static_groups:
        scale, zero = group_params(weight.float().view(out_features, -1, group_size), has_zero_point)
        params = {g: (scale[:, g].double(), zero[:, g].double()) for g in range(in_features // group_size)}
    result = torch.empty_like(w)
    for q in order.tolist():
        g = q // group_size
        if g not in params:  # in-order: parameters when the group's first column comes up
            s, z = group_params(w[:, q:q + group_size].float(), has_zero_point)
            params[g] = (s.double(), z.double())
        s, z = params[g]
        deq = (codes_4bit(w[:, q], s, z) - z) * s
        result[:, q] = deq
        err = (w[:, q] - deq) / hinv[q, q]
        w -= torch.outer(err, hinv[q, :])
        hinv -= torch.outer(hinv[:, q], hinv[q, :]) / hinv[q, q]
    return result.float()


@pytest.mark.parametrize("group_size,has_zero_point,act_order", [(32, False, False), (64, True, False),
                                                                 (128, True, True), (32, False, True)])
def test_blocked_gptq_equals_the_column_by_column_reference(group_size, has_zero_point, act_order):
    w, x = _randn(40, 256, seed=1), _correlated_rows(600, 256, seed=2)
    h = _hessian(x)
    got = dequantize(gptq_quantize_weight(w, h, group_size, has_zero_point, act_order), 4, group_size)
    order = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else torch.arange(256)
    expected = _reference_gptq(w, h, group_size, has_zero_point, order, static_groups=act_order)
    # float32 blocks against the float64 reference: the same codes here (a code could flip on an
    # exact rounding tie with other data), so the weights agree to float32 rounding (measured 2e-6).
    assert (expected - got).abs().max() <= 1e-4


@pytest.mark.parametrize("has_zero_point", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_diagonal_hessian_gives_round_to_nearest_exactly(has_zero_point, act_order):
    """Uncorrelated inputs: no error can be moved to another column, so every code, scale and
    zero point is round-to-nearest's."""
    w = _randn(48, 256, seed=3) * torch.linspace(0.2, 2, 256)
    h = torch.diag(torch.rand(256, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.1)
    for group_size in (32, 64, 128):
        got = gptq_quantize_weight(w, h, group_size, has_zero_point, act_order)
        rtn = quantize_weight(w, 4, group_size, has_zero_point)
        assert got.keys() == rtn.keys()
        for key in rtn:
            assert torch.equal(got[key], rtn[key]), (group_size, key)


@pytest.mark.parametrize("has_zero_point", [False, True])
def test_gptq_output_error_is_lower_than_round_to_nearest(has_zero_point):
    w = _randn(96, 256, seed=5)
    calib, held_out = _correlated_rows(1024, 256, seed=6), _correlated_rows(1024, 256, seed=7)
    rtn = quantize_weight(w, 4, 64, has_zero_point)
    for act_order in (False, True):
        gptq = gptq_quantize_weight(w, _hessian(calib), 64, has_zero_point, act_order)
        for x, bound in ((calib, 0.7), (held_out, 0.9)):  # measured 0.55-0.58 and 0.76-0.79
            ratio = _output_error(x, w, gptq, 64) / _output_error(x, w, rtn, 64)
            assert ratio < bound, (act_order, ratio)


def test_act_order_keeps_contiguous_groups_with_the_original_weights_scales():
    """Act-order only changes the order columns are quantized in: each contiguous group keeps
    the scale and zero point round-to-nearest gives it (clipped or not), and its codes absorb
    the errors."""
    w, x = _randn(64, 256, seed=8), _correlated_rows(800, 256, seed=9)
    x[:, 200:] *= 5.0  # the loudest inputs last, so act-order reorders
    h = _hessian(x)
    got = gptq_quantize_weight(w, h, 64, True, act_order=True)
    rtn = quantize_weight(w, 4, 64, True)
    assert got["weights_scaling_factor"].shape == (64, 4)  # [out, in / group_size]: kiln's layout
    assert torch.equal(got["weights_scaling_factor"], rtn["weights_scaling_factor"])
    assert torch.equal(got["zero"], rtn["zero"])
    assert not torch.equal(got["weight"], rtn["weight"])
    in_order = gptq_quantize_weight(w, h, 64, True, act_order=False)
    assert not torch.equal(in_order["weights_scaling_factor"], rtn["weights_scaling_factor"])
    assert _output_error(x, w, got, 64) < 0.6 * _output_error(x, w, rtn, 64)  # measured 0.45
    # Clipped ranges (AWQ's search against H) are static groups too: round-to-nearest's clipped scales.
    clip = search_clip(w, h, 64, True)
    assert clip.min() < 1.0
    clipped = gptq_quantize_weight(w, h, 64, True, act_order=True, clip=clip)
    rtn_clipped = quantize_weight(w, 4, 64, True, clip)
    assert torch.equal(clipped["weights_scaling_factor"], rtn_clipped["weights_scaling_factor"])
    assert torch.equal(clipped["zero"], rtn_clipped["zero"])


def test_sequential_and_float_calibration_agree_on_the_first_layer(tmp_path):
    """Layer 0 sees the same (float) inputs either way; layer 1 differs once layer 0 is quantized."""
    from kiln.models.llama import LlamaForCausalLM

    make_llama(tmp_path / "hf", hidden=64, layers=2, intermediate=128, vocab=300)
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 33, 9)]
    quant = QuantConfig(quant_algo="W4A16_GPTQ", group_size=32)
    models = {}
    for sequential in (True, False):
        model = LlamaForCausalLM.from_hugging_face(tmp_path / "hf", dtype="float32")
        recorded = calibrate_model(model, quant, prompts, CalibrationOptions(gptq_sequential=sequential))
        assert recorded.quant_algo == "W4A16_GPTQ" and recorded.exclude_modules == ["lm_head"]
        models[sequential] = model.transformer.layers
    for name in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        first = [models[s]["0"].get_submodule(name) for s in (True, False)]
        torch.testing.assert_close(first[0].dequantized_weight(), first[1].dequantized_weight(), rtol=0, atol=1e-6)
    second = [models[s]["1"].mlp.proj.weight for s in (True, False)]
    assert not torch.equal(*second)


CALIB_TEXTS = [
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    "A language model predicts the next token; perplexity measures how well it does on text.",
    "Summarize the following article about engines that convert checkpoints and run them fast.",
    "The engine builds, the runtime pages its cache, and the scheduler batches the requests.",
    "Quantization stores weights in four bits and corrects the rounding of each column in turn.",
    "Calibration text runs through the float model so each layer sees the inputs it will meet.",
] * 4
HELD_OUT_TEXTS = [  # text like the calibration's (this tokenizer's words), never calibrated on
    "The lazy engine predicts the next article; the quick model measures the fox.",
    "Run the checkpoint through the scheduler, then summarize how the cache pages its tokens.",
    "Each column of the weights is rounded in turn while the runtime batches the text.",
]


@pytest.fixture(scope="module")
def gptq_and_rtn(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq_quantize")
    hf = make_llama(root / "hf", num_heads=4, num_kv_heads=2, hidden=64, layers=2, intermediate=128, vocab=300)
    with torch.no_grad():  # a few loud hidden channels (through the norms), as real LLMs have
        for layer in hf.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40]] *= 10.0
    hf.save_pretrained(root / "hf")
    save_tiny_tokenizer(root / "hf")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in CALIB_TEXTS))
    engines = {}
    for name, quant, group_size, extra in (("gptq", "W4A16_GPTQ", 32, {}), ("rtn", "W4A16", 32, {}),
                                           ("awq_gptq", "W4A16_AWQ", 64, {"awq_gptq": True}),
                                           ("rtn64", "W4A16", 64, {})):
        engines[name] = convert_and_build(root / "hf", root / name, {"tokens_per_block": 4}, calib_dataset=str(calib),
                                          calib_size=len(CALIB_TEXTS),
                                          quantization=QuantConfig(quant_algo=quant, group_size=group_size), **extra)
    return hf, root, engines


def test_gptq_checkpoint_is_the_w4a16_layout_recorded_as_gptq(gptq_and_rtn):
    from safetensors import safe_open

    _, root, engines = gptq_and_rtn
    config = json.loads((root / "gptq" / "checkpoint" / "config.json").read_text())["quantization"]
    assert config["quant_algo"] == "W4A16_GPTQ" and config["group_size"] == 32 and not config["pre_quant_scale"]
    with safe_open(str(root / "gptq" / "checkpoint" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.0.mlp.proj.weight").shape == (64, 64)  # [out, in / 2] uint8
        assert f.get_tensor("transformer.layers.0.mlp.proj.weights_scaling_factor").shape == (64, 4)
        assert "transformer.layers.0.mlp.proj.prequant_scaling_factor" not in set(f.keys())
    assert json.loads((engines["gptq"] / "config.json").read_text())["quantization"]["quant_algo"] == "W4A16_GPTQ"


def test_gptq_engines_are_closer_to_float_than_round_to_nearest(gptq_and_rtn):
    from kiln.tokenizer import load_tokenizer

    hf, root, engines = gptq_and_rtn
    tokenizer = load_tokenizer(root / "hf")
    errors = dict.fromkeys(engines, 0.0)
    for text in HELD_OUT_TEXTS:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        for name, engine in engines.items():
            errors[name] += (kiln_prompt_logits(engine, ids) - ref).pow(2).mean().item()
    # mean squared logit error against RTN's at the same group size: measured 0.19x and 0.25x
    assert errors["gptq"] < 0.5 * errors["rtn"], errors
    assert errors["awq_gptq"] < 0.5 * errors["rtn64"], errors


def test_awq_gptq_checkpoint_is_an_awq_one(gptq_and_rtn):
    """AWQ's scales with GPTQ's rounding: the W4A16_AWQ layout, one prequant factor per shared input."""
    from safetensors import safe_open

    _, root, engines = gptq_and_rtn
    config = json.loads((root / "awq_gptq" / "checkpoint" / "config.json").read_text())["quantization"]
    assert config["quant_algo"] == "W4A16_AWQ" and config["pre_quant_scale"] and config["group_size"] == 64
    with safe_open(str(root / "awq_gptq" / "checkpoint" / "rank0.safetensors"), "pt") as f:
        fc = f.get_tensor("transformer.layers.1.mlp.fc.prequant_scaling_factor")
        assert torch.equal(fc, f.get_tensor("transformer.layers.1.mlp.gate.prequant_scaling_factor"))
        assert f.get_tensor("transformer.layers.1.mlp.proj.prequant_scaling_factor").shape == (128,)
    assert fc[[3, 17, 40]].max() < fc.median()  # the loud channels scaled up before rounding
    assert json.loads((engines["awq_gptq"] / "config.json").read_text())["quantization"]["quant_algo"] == "W4A16_AWQ"


def test_bad_gptq_requests_are_clear_errors(tmp_path):
    from kiln.convert import convert_checkpoint
    from kiln.models.llama import LlamaForCausalLM

    make_llama(tmp_path / "hf", hidden=64, layers=1, intermediate=128, vocab=300)
    save_tiny_tokenizer(tmp_path / "hf")
    for group_size, message in ((48, "must be a multiple of 32"), (256, "in_features 64 is not a multiple of group_size 256")):
        with pytest.raises(ConfigError, match=message):
            convert_checkpoint(tmp_path / "hf", tmp_path / "a", progress=False,
                               quantization=QuantConfig(quant_algo="W4A16_GPTQ", group_size=group_size))
    with pytest.raises(ConfigError, match="--tp_size 1"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "b", progress=False, tp_size=2,
                           quantization=QuantConfig(quant_algo="W4A16_GPTQ"))
    with pytest.raises(ConfigError, match="--awq_gptq goes with --quant_algo W4A16_AWQ"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "c", progress=False, awq_gptq=True,
                           quantization=QuantConfig(quant_algo="W4A16"))
    model = LlamaForCausalLM.from_hugging_face(tmp_path / "hf", dtype="float32")
    with pytest.raises(ConfigError, match="no calibration text"):
        calibrate_model(model, QuantConfig(quant_algo="W4A16_GPTQ"), [])
    assert not any((tmp_path / d).exists() for d in "abc")
