"""MXFP4 (gpt-oss's expert format): kiln's decoding of Hugging Face's blocks and scales and of a
GGUF's MXFP4 blocks, bit for bit against transformers' and the gguf package's own dequantization;
a gpt-oss checkpoint whose experts are MXFP4 computes what HF computes with those weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kiln.layers.quantized_matmul import dequantize_mxfp4, mxfp4_from_gguf


def _random_blocks(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)  # every E8M0 byte, subnormals too
    return blocks, scales


def test_hf_blocks_decode_as_transformers_decodes_them() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_blocks((3, 8, 4), seed=0)  # [experts, rows, groups]
    ours = dequantize_mxfp4(blocks, scales)  # [E, rows, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, theirs)


def test_gguf_blocks_decode_as_the_gguf_package_decodes_them() -> None:
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(6, 3 * 17), dtype=np.uint8)
    with np.errstate(over="ignore"):  # the largest E8M0 bytes overflow float32 to inf, in both decoders
        theirs = torch.from_numpy(dequantize(raw, GGMLQuantizationType.MXFP4).reshape(6, 96))
    ours = dequantize_mxfp4(*mxfp4_from_gguf(torch.from_numpy(raw)))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # bit for bit (signed zeros too)
    # and weights the gguf package quantizes come back as it dequantizes them
    w = rng.standard_normal((4, 64)).astype(np.float32)
    packed = quantize(w, GGMLQuantizationType.MXFP4)
    assert torch.equal(dequantize_mxfp4(*mxfp4_from_gguf(torch.from_numpy(packed))),
                       torch.from_numpy(dequantize(packed, GGMLQuantizationType.MXFP4)))


def _to_hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face MXFP4 blocks and scales of float ``w`` ``[E, rows, in]`` (through the gguf
    package's quantizer, then its block layout turned into HF's)."""
    e, rows, cols = w.shape
    raw = quantize(w.reshape(e * rows, cols).numpy(), GGMLQuantizationType.MXFP4)
    blocks, scales = mxfp4_from_gguf(torch.from_numpy(raw))
    return blocks.reshape(e, rows, cols // 32, 16), scales.reshape(e, rows, cols // 32)


def test_gpt_oss_mxfp4_checkpoint_matches_hf(tmp_path, build_from_hf) -> None:
    """A gpt-oss directory whose experts are MXFP4 blocks (as released) converts, and kiln's
    float32 logits equal HF's model holding the same weights decoded."""
    from safetensors.torch import load_file, save_file

    from tests.models.zoo import check_prompt_logits
    from tests.utils.tiny_moe_models import make_gpt_oss

    hf = make_gpt_oss(tmp_path / "hf", hidden=64, intermediate=64, seed=6)
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_hf_mxfp4(state.pop(key).transpose(1, 2).contiguous())  # HF params are [E, in, out]
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        param = hf.get_parameter(key)
        with torch.no_grad():  # the reference holds exactly the decoded weights
            param.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    engine = build_from_hf(tmp_path / "hf", tmp_path / "kiln", {})
    case = type("Case", (), {"hf": hf, "engine_dir": engine})
    check_prompt_logits(case)


@pytest.mark.parametrize("rows", [1, 5, 40])  # decode's GEMV from the codes; dequantized tiles
def test_e2m1_codes_through_the_kernel(rows: int) -> None:
    """MXFP4 blocks kept as 4-bit E2M1 codes (GGUF import): the checkpoint's tensors dequantize
    to the gguf package's values bit for bit, and the kernel on the engine's layout computes
    ``x W^T`` with them: from the codes with x in int8 blocks of 32 (llama.cpp's Q8 activations)
    for a few rows, through bf16 tiles (as a bf16 matmul of the same weights) for more."""
    from kiln import kernels
    from kiln.layers.quantized_matmul import dequantize as dequantize_kiln
    from kiln.quantization.gguf_blocks import decode, to_format

    rng = np.random.default_rng(rows)
    w = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.MXFP4)
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.MXFP4))
    tensors = to_format([decode(torch.from_numpy(raw), GGMLQuantizationType.MXFP4)], 4, False, "e2m1")
    assert torch.equal(dequantize_kiln(tensors, 4, 32, "e2m1"), expected)
    assert kernels.quant_shape_tiles(48, 256, 4, 32)  # the native kernels build on every machine kiln runs on
    codes = kernels.quant_pack(tensors["weight"], 4)
    scales, _ = kernels.quant_pack_scales(tensors["weights_scaling_factor"])
    x = torch.randn(rows, 256).to(torch.bfloat16)
    got = kernels.quant_linear(x, codes, scales, None, 4, 32, None, 48, codebook="e2m1").float()
    if rows <= 12:
        blocks = x.float().view(rows, -1, 32)
        step = blocks.abs().amax(dim=-1, keepdim=True) / 127
        ref = ((blocks / step).round() * step).view(rows, -1) @ expected.t()
        assert (got - ref).abs().max() <= 0.01 * ref.abs().max()  # bf16 output rounding
    else:
        ref, plain = x.float() @ expected.t(), (x @ expected.to(torch.bfloat16).t()).float()
        assert (got - ref).abs().max() <= 2 * (plain - ref).abs().max()
