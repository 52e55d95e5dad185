"""Weight-only quantization (W8A16, W4A16): the round-to-nearest codes, the tile-order kernel
against a float64 matmul of the dequantized weight, and a quantized engine end to end against
Hugging Face running the same dequantized weights."""
from __future__ import annotations

import json

import pytest
import torch

from kiln import kernels
from kiln.config import QuantConfig
from kiln.errors import BuildError, ConfigError
from kiln.quantization import dequantize, quantize_weight
from tests.conftest import convert_and_build
from tests.utils.compare import kiln_prompt_logits
from tests.utils.tiny_models import make_llama


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits,zero_point", [(8, False), (4, False), (4, True)])
def test_round_to_nearest_error_is_at_most_half_a_step(bits, zero_point):
    w = _randn(48, 128) * torch.linspace(0.1, 3, 48)[:, None]  # rows of very different ranges
    w[3, 5] = 40.0  # an outlier widens only its own channel / group
    tensors = quantize_weight(w, bits, group_size=32, has_zero_point=zero_point)
    scale = tensors["weights_scaling_factor"]
    step = scale[:, None] if bits == 8 else scale.repeat_interleave(32, dim=1)
    assert torch.all((dequantize(tensors, bits, 32) - w).abs() <= step / 2 + 1e-6)
    if bits == 4:
        assert tensors["weight"].dtype == torch.uint8 and tensors["weight"].shape == (48, 64)
        assert ("zero" in tensors) == zero_point
    else:
        assert tensors["weight"].dtype == torch.int8 and tensors["weight"].abs().max() == 127


def test_four_bit_codes_pack_low_nibble_first():
    w = torch.tensor([[-7.0, 7.0, 0.0, 1.0] * 8])  # one group of 32, scale 1
    tensors = quantize_weight(w, 4, group_size=32)
    assert tensors["weights_scaling_factor"].item() == 1.0
    assert tensors["weight"][0, 0].item() == (-7 + 8) | ((7 + 8) << 4)
    assert tensors["weight"][0, 1].item() == 8 | (9 << 4)


@pytest.mark.parametrize("bits,zero_point", [(8, False), (4, False), (4, True)])
@pytest.mark.parametrize("m", [1, 3, 5, 11, 17, 40])  # integer GEMV up to 12 rows (tiles of 4), AMX int8 tiles to 32, dequantized beyond
@pytest.mark.parametrize("n,k", [(16, 64), (80, 96), (64, 576)])  # 1-5 output blocks: full and tail panels
def test_quant_linear_matches_the_dequantized_matmul(bits, zero_point, m, n, k):
    w = _randn(n, k, seed=n + k)
    tensors = quantize_weight(w, bits, group_size=32, has_zero_point=zero_point)
    reference_w = dequantize(tensors, bits, 32).double()
    x = _randn(m, k, seed=m).to(torch.bfloat16)
    bias = _randn(n, seed=1).to(torch.bfloat16)
    codes = kernels.quant_pack(tensors["weight"], bits)
    scales, offsets = kernels.quant_pack_scales(tensors["weights_scaling_factor"], tensors.get("zero"))
    got = kernels.quant_linear(x, codes, scales, offsets, bits, 32, bias, n)
    expected = x.double() @ reference_w.t() + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # bf16 output rounding, plus (tile path) bf16 rounding of each dequantized weight
    torch.testing.assert_close(got.double(), expected, atol=3e-2 * k ** 0.5 * reference_w.abs().max().item(),
                               rtol=1e-2)


def _group_tensors(n: int, k: int, bits: int, offset: bool, group: int = 32) -> dict[str, torch.Tensor]:
    """Random codes with float16-exact group scales (and offsets): the layouts GGUF files import
    into (Q8_0: int8 groups; Q4_1 / K-quants: 4-bit with offsets; Q5_1: int8 with offsets)."""
    g = torch.Generator().manual_seed(n + k + bits)
    scale = (torch.rand(n, k // group, generator=g) / 16 + 1e-3).half().float()
    if bits == 8:
        tensors = {"weight": torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)}
    else:
        tensors = {"weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)}
    tensors["weights_scaling_factor"] = scale
    if offset:
        tensors["weights_offset"] = (torch.randn(n, k // group, generator=g) / 4).half().float()
    return tensors


@pytest.mark.parametrize("bits,offset", [(8, False), (8, True), (4, True)])
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (80, 576, 32), (48, 256, 128)])
def test_quant_linear_group_scales_and_offsets(bits, offset, m, n, k, group):
    tensors = _group_tensors(n, k, bits, offset, group)
    reference_w = dequantize(tensors, bits, group).double()
    x = _randn(m, k, seed=m).to(torch.bfloat16)
    codes = kernels.quant_pack(tensors["weight"], bits)
    scales, offsets = kernels.quant_pack_scales(tensors["weights_scaling_factor"], None, tensors.get("weights_offset"))
    assert scales.dtype == torch.float16 and (offsets is None) == (not offset)
    got = kernels.quant_linear(x, codes, scales, offsets, bits, group, None, n)
    expected = x.double() @ reference_w.t()
    torch.testing.assert_close(got.double(), expected, atol=3e-2 * k ** 0.5 * reference_w.abs().max().item(),
                               rtol=1e-2)


@pytest.mark.parametrize("bits,offset", [(4, True), (8, True), (4, False), (6, False)])
@pytest.mark.parametrize("m", [1, 5, 17])
def test_quant_linear_super_block_scales(bits, offset, m):
    """GGUF K-quants' layout: group scales and offsets as int8 codes under a float16 multiplier
    per 256 inputs (each 16 columns' in one record), and Q6_K's 6-bit codes in groups of 16: the
    GEMV (few rows) and the dequantized tiles (17 rows) compute what the float32 weight does."""
    n, k, group = 48, 512, 16 if bits == 6 else 32
    g = torch.Generator().manual_seed(bits + m)
    tensors = _group_tensors(n, k, bits, False) if bits != 6 else {
        "weight": torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)}
    tensors["weights_scaling_factor"] = torch.randint(-64, 64, (n, k // group), dtype=torch.int8, generator=g)
    tensors["weights_super_scale"] = (torch.rand(n, k // 256, generator=g) / 256 + 1e-4).half().float()
    if offset:
        tensors["weights_offset"] = torch.randint(-64, 64, (n, k // group), dtype=torch.int8, generator=g)
        tensors["weights_super_offset"] = -(torch.rand(n, k // 256, generator=g) / 64).half().float()
    reference_w = dequantize(tensors, bits, group).double()
    x = _randn(m, k, seed=m).to(torch.bfloat16)
    scales, offsets = kernels.quant_pack_scales(tensors["weights_scaling_factor"], None, tensors.get("weights_offset"),
                                                tensors["weights_super_scale"], tensors.get("weights_super_offset"))
    assert scales.shape == (n // 16, k // 256, kernels.super_bytes(group)) and (offsets is None) == (not offset)
    got = kernels.quant_linear(x, kernels.quant_pack(tensors["weight"], bits), scales, offsets, bits, group, None, n,
                               super_scales=True)
    expected = x.double() @ reference_w.t()
    torch.testing.assert_close(got.double(), expected, atol=3e-2 * k ** 0.5 * reference_w.abs().max().item(),
                               rtol=1e-2)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "e2m1", "q4_k", "q6_k"])
def test_quant_linear_rows_do_not_depend_on_the_batch(fmt):
    """Up to ``quant_batch_invariant_rows`` (AVX512-VNNI's GEMV: 12; AMX int8 tiles with the
    GEMV's arithmetic, or the AVX2 GEMV: 32) each row equals that row computed in calls of 12 or
    fewer, bit for bit; past it, dequantized tiles: the same weights, other roundings."""
    n, k, m = 48, 512, 32
    g = torch.Generator().manual_seed(7)
    bits, group, codebook, super_scales = (6, 16, None, True) if fmt == "q6_k" else (4, 32, None, fmt == "q4_k")
    if fmt == "e2m1":
        codebook = "e2m1"
    if bits == 6:
        codes = kernels.quant_pack(torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g), 6)
    else:
        codes = kernels.quant_pack(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), 4)
    if super_scales:
        scales, offsets = kernels.quant_pack_scales(
            torch.randint(0, 64, (n, k // group), dtype=torch.int8, generator=g), None,
            torch.randint(0, 64, (n, k // group), dtype=torch.int8, generator=g) if fmt == "q4_k" else None,
            (torch.rand(n, k // 256, generator=g) / 256).half().float(),
            -(torch.rand(n, k // 256, generator=g) / 64).half().float() if fmt == "q4_k" else None)
    else:
        scales, offsets = kernels.quant_pack_scales(
            (torch.rand(n, k // group, generator=g) / 16).half().float(), None,
            (torch.randn(n, k // group, generator=g) / 4).half().float() if fmt == "q4_1" else None)
    x = (_randn(m, k, seed=3) * 4).to(torch.bfloat16)
    bias = _randn(n, seed=1).to(torch.bfloat16)

    def linear(rows):
        return kernels.quant_linear(rows, codes, scales, offsets, bits, group, bias, n, codebook=codebook,
                                    super_scales=super_scales)

    for rows in (13, 17, 32):
        together = linear(x[:rows])
        apart = torch.cat([linear(x[i:min(i + 12, rows)]) for i in range(0, rows, 12)])
        if rows <= kernels.quant_batch_invariant_rows():
            assert torch.equal(together, apart), rows
        else:
            torch.testing.assert_close(together.float(), apart.float(), atol=0.02 * apart.float().abs().max().item(),
                                       rtol=0.02)


@pytest.fixture(scope="module", params=["W8A16", "W4A16"])
def quantized(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_llama(root / "hf", num_heads=4, num_kv_heads=2, hidden=64, layers=2, intermediate=128)
    quant = QuantConfig(quant_algo=request.param, group_size=32, has_zero_point=request.param == "W4A16")
    engine = convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4}, quantization=quant)
    return request.param, hf, root / "kiln", engine


def test_checkpoint_and_engine_hold_the_reference_tensors(quantized):
    from safetensors import safe_open

    algo, _, work, engine = quantized
    config = json.loads((work / "checkpoint" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == algo and config["quantization"]["exclude_modules"] == ["lm_head"]
    assert json.loads((engine / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(work / "checkpoint" / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        qkv = f.get_tensor("transformer.layers.0.attention.qkv.weight")
        scale = f.get_tensor("transformer.layers.0.attention.qkv.weights_scaling_factor")
    assert qkv.dtype == (torch.int8 if algo == "W8A16" else torch.uint8) and scale.dtype == torch.float32
    assert ("transformer.layers.0.mlp.fc.zero" in names) == (algo == "W4A16")
    assert "lm_head.weights_scaling_factor" not in names  # excluded by default


def test_quantized_engine_computes_the_dequantized_model(quantized):
    algo, hf, _, engine = quantized
    bits = 8 if algo == "W8A16" else 4
    with torch.no_grad():  # HF with every decoder linear replaced by its dequantized weight
        for name, module in hf.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear):
                tensors = quantize_weight(module.weight, bits, 32, has_zero_point=bits == 4)
                module.weight.copy_(dequantize(tensors, bits, 32))
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = kiln_prompt_logits(engine, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 0.03 * ref.abs().max().item()  # bf16 compute, as test_bf16


def test_bad_quantization_requests_are_clear_errors(tmp_path):
    make_llama(tmp_path / "hf", hidden=64, layers=1, intermediate=128)
    with pytest.raises(ConfigError, match="group_size"):
        convert_and_build(tmp_path / "hf", tmp_path / "a", quantization=QuantConfig(quant_algo="W4A16", group_size=48))
    with pytest.raises(ConfigError, match="quant_algo 'W3A16' is not one of"):
        convert_and_build(tmp_path / "hf", tmp_path / "b", quantization=QuantConfig(quant_algo="W3A16"))
    from kiln.build import build_engine
    from kiln.convert import convert_checkpoint

    checkpoint = convert_checkpoint(tmp_path / "hf", tmp_path / "c", progress=False,
                                    quantization=QuantConfig(quant_algo="W8A16"))
    with pytest.raises(BuildError, match="bfloat16"):
        build_engine(checkpoint, tmp_path / "e", progress=False, dtype="float32")
