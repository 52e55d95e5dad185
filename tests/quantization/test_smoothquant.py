"""SmoothQuant W8A8 (W8A8_SQ_PER_CHANNEL): the int8 linear against its exact float64
reference, torch._int_mm against the integer emulation, smoothing against activation
outliers, the per-group alpha search against fixed alphas, and a calibrated tiny Llama end
to end against float32 Hugging Face."""
from __future__ import annotations

import json

import pytest
import torch

from kiln import kernels
from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.layers.quantized_matmul import int8_matmul, int8_matmul_reference, quantize_activations, w8a8_linear
from kiln.quantization.smoothquant import quantize_w8a8_weight, search_alpha, smoothing_factors
from tests.conftest import convert_and_build
from tests.utils.compare import hf_greedy, kiln_greedy, kiln_prompt_logits
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import save_tiny_tokenizer

ALGO = "W8A8_SQ_PER_CHANNEL"


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m,k,n", [(1, 64, 192), (3, 63, 5), (17, 128, 64), (40, 96, 80)])
def test_int_mm_equals_the_integer_emulation(m, k, n):
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=torch.Generator().manual_seed(m))
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    got = int8_matmul(a, b)
    assert got.dtype == torch.int32 and torch.equal(got, int8_matmul_reference(a, b))
    assert torch.equal(got, a.long() @ b.long().t())  # int64: a third, independent product


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linear_equals_its_float64_reference(dtype):
    w, x, bias = _randn(48, 96, seed=1), _randn(7, 96, seed=2).to(dtype), _randn(48, seed=3)
    s = smoothing_factors(x.float().abs().amax(0), [w], 0.5)
    t = quantize_w8a8_weight(w, s)
    got = w8a8_linear(x, t["weight"], t["weights_scaling_factor"], t["prequant_scaling_factor"], bias.to(dtype))
    # Reference: dequantized per-token activations times dequantized weights, in float64.
    q, a = quantize_activations(x.float() * t["prequant_scaling_factor"])
    w_deq = t["weight"].double() * t["weights_scaling_factor"].double()[:, None]
    expected = (q.double() * a.double()) @ w_deq.t() + bias.to(dtype).double()
    assert got.dtype == dtype and got.shape == (7, 48)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # float rounding of the result only
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    # and the quantized product is close to the float one it stands for
    exact = x.double() @ w.double().t() + bias.to(dtype).double()
    assert (got.double() - exact).abs().max() <= 0.05 * exact.abs().max()


def test_smoothing_moves_activation_outliers_into_the_weights():
    w = _randn(64, 128, seed=4) * 0.05
    x = _randn(256, 128, seed=5)
    x[:, [3, 40, 77, 100]] *= 60.0  # a few outlier channels, as in LLM activations
    exact = x.double() @ w.double().t()

    def error(s: torch.Tensor) -> float:
        t = quantize_w8a8_weight(w, s)
        y = w8a8_linear(x, t["weight"], t["weights_scaling_factor"], t["prequant_scaling_factor"], None)
        return ((y.double() - exact).norm() / exact.norm()).item()

    absmax = x.abs().amax(0)
    plain = error(torch.ones(128))  # no smoothing: plain per-token x per-channel int8
    smoothed = error(smoothing_factors(absmax, [w], 0.5))
    all_to_activations = error(smoothing_factors(absmax, [w], 0.0))  # alpha 0: s = 1 / max|W|
    assert smoothed < 0.5 * plain and smoothed < 0.5 * all_to_activations, (smoothed, plain, all_to_activations)
    print(f"relative output error: no smoothing {plain:.4f}, alpha 0 {all_to_activations:.4f}, "
          f"alpha 0.5 {smoothed:.4f}")


def _w8a8_error(weights: list[torch.Tensor], x: torch.Tensor, s: torch.Tensor) -> float:
    """Summed squared error of the W8A8 outputs of ``weights`` smoothed by ``s`` on rows ``x``."""
    error = 0.0
    for w in weights:
        t = quantize_w8a8_weight(w, s)
        y = w8a8_linear(x, t["weight"], t["weights_scaling_factor"], t["prequant_scaling_factor"], None)
        error += (y.double() - x.double() @ w.double().t()).pow(2).sum().item()
    return error


def test_searched_alpha_is_never_worse_than_a_fixed_one_on_the_calibration_rows():
    cases = []
    for seed, loudness in ((6, 60.0), (8, 3.0)):  # strong outliers, and nearly none
        x = _randn(256, 128, seed=seed)
        x[:, [3, 40, 77, 100]] *= loudness
        weights = [_randn(64, 128, seed=seed + 1) * 0.05, _randn(96, 128, seed=seed + 2) * 0.05]  # fc and gate
        s, alpha, error = search_alpha(weights, x, x.abs().amax(0))
        assert error == pytest.approx(_w8a8_error(weights, x, s), rel=1e-4)
        for fixed in (0.0, 0.25, 0.5, 0.75, 1.0):
            assert error <= _w8a8_error(weights, x, smoothing_factors(x.abs().amax(0), weights, fixed)) * (1 + 1e-6)
        cases.append(alpha)
    assert cases[0] != cases[1], cases  # the best migration depends on the activations


@pytest.fixture(scope="module")
def sq_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("sq")
    vocab = 300
    hf = make_llama(root / "hf", vocab=vocab, hidden=64, intermediate=128, layers=2, num_heads=4, num_kv_heads=2)
    save_tiny_tokenizer(root / "hf")
    calib = root / "calib.jsonl"
    texts = ["The quick brown fox jumps over the lazy dog while the engine builds a checkpoint.",
             "A language model predicts the next token; perplexity measures how well it does it.",
             "Summarize the following article about converting checkpoints and running them fast.",
             "Quantization stores weights in eight bits and scales the activations of every token."]
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    quant = QuantConfig(quant_algo=ALGO)
    engine = convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4}, quantization=quant,
                               calib_dataset=str(calib), calib_size=4)
    return hf, root / "kiln", engine


def test_checkpoint_holds_the_reference_tensors(sq_model):
    from safetensors import safe_open

    _, work, engine = sq_model
    config = json.loads((work / "checkpoint" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == ALGO and config["quantization"]["exclude_modules"] == ["lm_head"]
    assert json.loads((engine / "config.json").read_text())["dtype"] == "float32"  # any dtype: the checkpoint's
    with safe_open(str(work / "checkpoint" / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        for linear, (out_f, in_f) in {"attention.qkv": (128, 64), "attention.dense": (64, 64),
                                      "mlp.fc": (128, 64), "mlp.gate": (128, 64), "mlp.proj": (64, 128)}.items():
            prefix = f"transformer.layers.1.{linear}."
            assert f.get_tensor(prefix + "weight").dtype == torch.int8
            assert f.get_tensor(prefix + "weight").shape == (out_f, in_f)
            assert f.get_tensor(prefix + "weights_scaling_factor").shape == (out_f,)
            assert f.get_tensor(prefix + "prequant_scaling_factor").shape == (in_f,)
        assert torch.equal(f.get_tensor("transformer.layers.0.mlp.fc.prequant_scaling_factor"),
                           f.get_tensor("transformer.layers.0.mlp.gate.prequant_scaling_factor"))
    assert "lm_head.weights_scaling_factor" not in names
    with safe_open(str(engine / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.0.mlp.fused_fc.prequant_scaling_factor").shape == (64,)
        assert f.get_tensor("transformer.layers.0.mlp.fused_fc.weight").shape == (256, 64)


def test_engine_stays_close_to_float_hf(sq_model):
    hf, _, engine = sq_model
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 13)]
    ours = kiln_prompt_logits(engine, prompts[0])
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]])).logits[0].float()
    rel = (ours - ref).abs().max().item() / ref.abs().max().item()
    print(f"W8A8 SQ engine vs float32 HF: max |logit diff| / max |logit| = {rel:.4f}")
    assert rel <= 0.05
    ours_tokens, hf_tokens = kiln_greedy(engine, prompts, 16), hf_greedy(hf, prompts, 16)
    agree = sum(a == b for o, h in zip(ours_tokens, hf_tokens) for a, b in zip(o, h)) / 32
    print(f"greedy token agreement: {agree:.2f}")
    assert agree >= 0.75


NATIVE_W8A8 = kernels.w8a8_supported(torch.bfloat16, torch.zeros(16, 32, dtype=torch.int8))


def test_bf16_engine_takes_the_native_decode_path(sq_model, tmp_path):
    from kiln.build import build_engine
    from kiln.models.base import DecoderModelForCausalLM
    from kiln.models.native_decode import supports_native_decode

    float_model = DecoderModelForCausalLM.from_checkpoint(sq_model[2], engine_layout=True)
    assert float_model.config.dtype == "float32" and not supports_native_decode(float_model)  # int8 kernel: bf16 only
    engine = build_engine(sq_model[1] / "checkpoint", tmp_path / "bf16", progress=False, dtype="bfloat16")
    model = DecoderModelForCausalLM.from_checkpoint(engine, engine_layout=True)
    assert model.transformer.layers["0"].mlp.fused_fc.act_quant
    assert model.transformer.layers["0"].mlp.fused_fc.weight.dtype == torch.int8
    # the native step needs the int8 kernel (AVX512-VNNI); elsewhere the layer-by-layer path runs
    assert model.config.dtype == "bfloat16" and supports_native_decode(model) == NATIVE_W8A8


def _torch_w8a8(x, codes, weights_scale, prequant, bias):
    """SmoothQuant's arithmetic in torch ops (what the native kernel must equal bit for bit)."""
    q, a = quantize_activations(x.float() * prequant)
    y = int8_matmul(q, codes).float() * a * weights_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@pytest.mark.parametrize("m,n,k,with_bias", [(1, 96, 64, False), (3, 64, 1536, True), (5, 48, 96, True),
                                             (37, 160, 576, False)])
def test_native_w8a8_kernel_equals_torch_bit_for_bit(m, n, k, with_bias):
    from kiln import kernels

    g = torch.Generator().manual_seed(m * n + k)
    x = (torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 8).bfloat16()
    x[0, 3] = 0  # zeros and ties stay exact
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    weights_scale = torch.rand(n, generator=g) * 1e-2
    prequant = torch.rand(k, generator=g) + 0.25
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    expected = _torch_w8a8(x, codes, weights_scale, prequant, bias)
    if NATIVE_W8A8:  # AVX512-VNNI: the native kernel, bit for bit
        assert kernels.w8a8_supported(x.dtype, codes)
        assert torch.equal(kernels.w8a8_linear(x, codes, weights_scale, prequant, bias), expected)
    assert not kernels.w8a8_supported(torch.float32, codes) and not kernels.w8a8_supported(x.dtype, codes[:, :48])
    # the layer's path, native or torch's int8 matmul, computes the same numbers on any CPU
    assert torch.equal(w8a8_linear(x, codes, weights_scale, prequant, bias), expected)


def test_bad_smoothquant_requests_are_clear_errors(tmp_path):
    from kiln.convert import convert_checkpoint
    from kiln.quantization import quantize_model

    make_llama(tmp_path / "hf", vocab=300, hidden=64, layers=1, intermediate=128)
    save_tiny_tokenizer(tmp_path / "hf")
    quant = QuantConfig(quant_algo=ALGO)
    with pytest.raises(ConfigError, match="tp_size 1"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "a", tp_size=2, quantization=quant, progress=False)
    with pytest.raises(ConfigError, match="neither 'sharegpt' nor a file"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "b", quantization=quant, calib_dataset=str(tmp_path / "no"),
                           progress=False)
    text = tmp_path / "calib.txt"
    text.write_text("Calibration text for the tiny model, long enough to give a few tokens.")
    with pytest.raises(ConfigError, match="alpha"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "c", quantization=quant, calib_dataset=str(text),
                           smoothquant_alpha=1.5, progress=False)
    with pytest.raises(ConfigError, match="exclude both or neither"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "d", calib_dataset=str(text), progress=False,
                           quantization=QuantConfig(quant_algo=ALGO, exclude_modules=["lm_head", "gate"]))
    with pytest.raises(ConfigError, match="needs calibration"):
        quantize_model(torch.nn.Module(), quant)


def test_bfloat16_engine_from_the_same_checkpoint(sq_model, tmp_path):
    from kiln.build import build_engine

    hf, work, _ = sq_model
    engine = build_engine(work / "checkpoint", tmp_path / "bf16", progress=False, dtype="bfloat16")
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(20)).tolist()
    ours = kiln_prompt_logits(engine, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    rel = (ours - ref).abs().max().item() / ref.abs().max().item()
    print(f"W8A8 SQ bf16 engine vs float32 HF: max |logit diff| / max |logit| = {rel:.4f}")
    assert rel <= 0.06  # int8 rounding plus bf16 compute (weight-only bf16 engines are held to 3%)
