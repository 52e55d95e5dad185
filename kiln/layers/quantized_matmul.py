"""The matmuls of quantized linears, as the layers run them: weight-only codes dequantized
(the reference path), FP8 e4m3 inputs and weights, SmoothQuant int8 x int8. The quantization
algorithms (``kiln.quantization``) write the codes these read."""
from __future__ import annotations

import torch
from torch import nn

from kiln import kernels

E4M3_MAX = 448.0  # the largest finite e4m3 value


# MXFP4's E2M1 values, doubled so they are integers (-12..12): nibble -> 2 * value.
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


SUPER_MULTIPLIERS = {"weights_scaling_factor": "weights_super_scale", "weights_offset": "weights_super_offset"}


def weight_only_shapes(out_features: int, in_features: int, bits: int, group_size: int | None, has_zero_point: bool,
                       has_offset: bool, tile_order: bool,
                       super_scales: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of a weight-only quantized linear's parameters (see
    ``Linear.use_weight_only``), in a checkpoint's layout or (``tile_order``) the kernels'."""
    grouped = (out_features, in_features // group_size) if group_size is not None else None
    code_width = {8: in_features, 6: in_features * 3 // 4 if tile_order else in_features, 4: in_features // 2}[bits]
    shapes = {"weight": ((out_features, code_width), torch.int8 if bits == 8 or bits == 6 and not tile_order
                         else torch.uint8),
              "weights_scaling_factor": (grouped or (out_features,), torch.float32)}
    if has_zero_point and not tile_order:
        shapes["zero"] = (grouped, torch.float32)
    if has_offset or (has_zero_point and tile_order):
        shapes["weights_offset"] = (grouped, torch.float32)
    if super_scales:  # int8 codes of the scales and offsets, a float32 multiplier per super-block each
        supers = (out_features, in_features // kernels.SUPER_K)
        for name, multiplier in SUPER_MULTIPLIERS.items():
            if name in shapes:
                shapes[name], shapes[multiplier] = (grouped, torch.int8), (supers, torch.float32)
    if tile_order and grouped is not None:  # the kernels' layout (kernels.quant_pack_scales)
        for name in ("weights_scaling_factor", "weights_offset"):
            if name in shapes:
                shapes[name] = (((out_features // 16, supers[1], kernels.super_bytes(group_size)), torch.uint8)
                                if super_scales else ((out_features // 16, grouped[1], 16), torch.float16))
        for name in SUPER_MULTIPLIERS.values():
            shapes.pop(name, None)  # packed into the records
    return shapes


def dequantize(tensors: dict[str, torch.Tensor], bits: int, group_size: int | None = 64,
               codebook: str | None = None) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that row-major ``tensors`` (``quantize_weight``'s, or an
    imported GGUF linear's) stand for: ``code * scale`` per channel; per group ``code * scale +
    weights_offset``, or ``(code - zero) * scale`` (zero 8 for 4-bit codes, 0 for int8 ones).
    ``codebook`` "e2m1": each 4-bit code is an E2M1 nibble standing for twice its value (MXFP4's
    blocks under scales 2^(e - 128)). With ``weights_super_scale`` (GGUF K-quants), the group scales
    and offsets are int8 codes times their super-block's ``weights_super_scale`` and
    ``weights_super_offset`` (exact in float32: a code of at most 8 bits times a float16)."""
    codes, scale = tensors["weight"], tensors["weights_scaling_factor"]
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(codes.shape[0], -1)
    if "weights_super_scale" in tensors:
        per_group = lambda t: t.repeat_interleave(kernels.SUPER_K // group_size, dim=1)  # noqa: E731
        scale = scale.float() * per_group(tensors["weights_super_scale"])
        if "weights_offset" in tensors:
            offset = tensors["weights_offset"].float() * per_group(tensors["weights_super_offset"])
            tensors = {**tensors, "weights_offset": offset}
    if codebook == "e2m1":
        values = torch.tensor(E2M1_DOUBLED, dtype=torch.float32)[codes.long()]
        return values * scale.repeat_interleave(group_size, dim=1)
    codes = codes.float()
    if scale.dim() == 1:
        return codes * scale[:, None]
    per_input = lambda t: t.repeat_interleave(group_size, dim=1)  # noqa: E731
    if "weights_offset" in tensors:
        return codes * per_input(scale) + per_input(tensors["weights_offset"])
    zero = tensors.get("zero")
    if zero is not None:
        codes = codes - per_input(zero)
    elif bits == 4:
        codes = codes - 8.0
    return codes * per_input(scale)



def e8m0_half(exponents: torch.Tensor) -> torch.Tensor:
    """float32 ``2 ** (e - 128)`` of E8M0 scale bytes (half the block scale, matching
    ``E2M1_DOUBLED``): built from its bits, so exact for every byte (e < 2: float32 subnormals)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., rows, groups * 32]`` of MXFP4 weights as Hugging Face stores them (gpt-oss):
    ``blocks`` uint8 ``[..., rows, groups, 16]`` (element ``2j`` in the low nibble of byte ``j``,
    ``2j + 1`` in the high one) and ``scales`` uint8 E8M0 exponents ``[..., rows, groups]``:
    ``E2M1(code) * 2 ** (scale - 127)``, exact in float32."""
    table = torch.tensor(E2M1_DOUBLED, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., groups, 32]
    values = table[codes] * e8m0_half(scales)[..., None]
    return values.flatten(-2)


def mxfp4_from_gguf(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's MXFP4 ``(blocks, scales)`` (see ``dequantize_mxfp4``) from a GGUF MXFP4
    tensor's raw bytes ``[rows, groups * 17]``: each 17-byte block is the E8M0 scale, then 16
    bytes holding element ``j`` in the low nibble and ``j + 16`` in the high one."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 17)
    low, high = blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4  # elements 0..15, 16..31
    codes = torch.cat([low, high], dim=-1)  # [rows, groups, 32] in element order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), blocks[..., 0].contiguous()


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to the nearest e4m3 value (ties to even), saturated at +-448."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def fp8_round_input(x: torch.Tensor, act_scale: torch.Tensor, prequant: torch.Tensor | None = None, *,
                    fast: bool = False) -> torch.Tensor:
    """``x`` (times ``prequant``, rounded to ``x``'s dtype) divided by ``act_scale`` and rounded to
    e4m3: float32 ``[..., in]``; ``fast`` takes the native kernel (bf16 in, same values)."""
    if fast:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        return kernels.fp8_quantize_rows(rows, float(act_scale), prequant).float().view(x.shape)
    if prequant is not None:
        x = (x * prequant).to(x.dtype)
    return round_to_e4m3(x.float() / act_scale)


def fp8_linear(linear: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """An FP8 ``Linear``'s ``x W^T (+ bias)`` (output in ``x``'s dtype): the native kernel on an
    engine's tile-ordered codes, the same arithmetic in PyTorch on a checkpoint's."""
    a = linear.activation_scaling_factor
    if linear.tile_order:
        rows = x.reshape(-1, linear.in_features).to(torch.bfloat16)
        y = kernels.fp8_linear(rows, linear.weight, linear.weights_scaling_factor, float(a), None,
                               None if bias is None else bias.to(torch.bfloat16))
        return y.view(*x.shape[:-1], linear.out_features).to(x.dtype)
    xq = fp8_round_input(x, a)
    y = (xq @ linear.weight.float().t()) * (a * linear.weights_scaling_factor)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 codes ``[m, in]`` of float ``x`` ``[m, in]`` and their float32 scales ``[m, 1]``."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def int8_matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` of int8 ``a`` ``[m, k]`` and ``b`` ``[n, k]`` as int32, computed in float64
    (exact: every partial sum is an integer below 2^53 for any k under 5e11)."""
    return (a.double() @ b.double().t()).to(torch.int32)


_HAS_INT_MM = hasattr(torch, "_int_mm")


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` (int8 ``[m, k]`` by int8 ``[n, k]``) in int32: ``torch._int_mm`` on CPU, which
    in torch 2.13 takes every shape (1 row, odd k and n included, checked by the tests);
    the exact float64 emulation on other devices (CUDA's kernel wants m > 16 and multiples
    of 8) or a torch without it."""
    if _HAS_INT_MM and a.device.type == "cpu":
        return torch._int_mm(a.contiguous(), b.t())
    return int8_matmul_reference(a, b)


def w8a8_linear(x: torch.Tensor, codes: torch.Tensor, weights_scale: torch.Tensor, prequant: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ bias)`` for a SmoothQuant linear (``x`` ``[..., in]``; output in ``x``'s dtype).
    bf16 inputs go through the native kernel where it runs (``kernels.w8a8_linear``: the same
    numbers, bit for bit, without torch's per-op overhead)."""
    rows = x.reshape(-1, x.shape[-1])
    if (kernels.w8a8_supported(rows.dtype, codes) and rows.device.type == "cpu"
            and (bias is None or bias.dtype == torch.bfloat16)):
        return kernels.w8a8_linear(rows, codes, weights_scale, prequant, bias).view(*x.shape[:-1], codes.shape[0])
    rows = rows.float() * prequant
    q, a = quantize_activations(rows)
    y = int8_matmul(q, codes).float() * a * weights_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], codes.shape[0])
