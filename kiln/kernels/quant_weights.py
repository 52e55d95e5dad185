"""Weight-only quantized linears (quant_linear.c): which shapes tile, the kernels' layout of
codes, scales and offsets (``kiln build`` packs engines this way), and the matmul on them."""
from __future__ import annotations

import torch

from kiln.kernels.library import native_library, output

CODES_E2M1 = 0x100  # kernels.h KILN_CODES_E2M1: or'd into the bits of MXFP4's 4-bit E2M1 codes
SCALES_SUPER = 0x200  # kernels.h KILN_SCALES_SUPER: scales and offsets in super-block records
SUPER_K = 256  # kernels.h KILN_SUPER_K: inputs under one super-block multiplier
CODEBOOKS = ("e2m1",)  # 4-bit codes through a table (quant_linear.c); None: plain integers


def super_bytes(group_size: int) -> int:
    """kernels.h KILN_SUPER_BYTES: a super-block record's bytes (16 columns' codes and multipliers)."""
    return SUPER_K // group_size * 16 + 16 * 2


def quant_shape_tiles(out_features: int, in_features: int, bits: int, group_size: int | None) -> bool:
    """Whether the quantized-linear kernel's tile order fits this shape: 16-column blocks,
    32-wide k blocks, and groups made of whole k blocks (``group_size`` None: int8 with a scale
    per output channel); 6-bit codes in groups of 16 and whole super-blocks."""
    if bits == 6:
        return out_features % 16 == 0 and in_features % SUPER_K == 0 and group_size == 16
    return (bits in (4, 8) and out_features % 16 == 0 and in_features % 32 == 0
            and (group_size is None and bits == 8 or group_size is not None and group_size % 32 == 0
                 and in_features % group_size == 0))


def fit_offset_groups(weight: torch.Tensor, importance: torch.Tensor, group: int,
                      stretch: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """W4A16_IMATRIX's per-group search (quant_search.c) over float32 ``weight`` ``[rows, cols]``
    with per-column ``importance`` ``[cols]``: float32 ``(scale, offset)`` ``[rows, cols / group]``;
    None without the native library (``kiln.quantization.imatrix`` searches in PyTorch then)."""
    lib = native_library()
    if lib is None:
        return None
    rows, cols = weight.shape
    x, w = weight.float().contiguous(), importance.float().contiguous()
    s = torch.tensor(stretch, dtype=torch.float32)
    scale, offset = torch.empty(rows, cols // group), torch.empty(rows, cols // group)
    lib.kiln_fit_offset_groups(x.data_ptr(), w.data_ptr(), rows, cols, group, s.data_ptr(), len(stretch),
                               scale.data_ptr(), offset.data_ptr(), torch.get_num_threads())
    return scale, offset


def quant_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Row-major codes (int8 or e4m3 ``[n, k]``, or 4-bit pairs ``[n, k / 2]`` low nibble first)
    in the kernels' order (quant_linear.c: int8 tiles, 4-bit chunks); same dtype and shape.
    6-bit codes (int8 ``[n, k]``, -32..31) become uint8 ``[n, k * 3 / 4]``: their low nibbles in
    4-bit chunks, then their high bits."""
    if bits == 6:
        return _pack_6bit(codes)
    n, width = codes.shape
    k = width if bits == 8 else 2 * width
    if native_library() is None or not quant_shape_tiles(n, k, bits, 32) or codes.element_size() != 1:
        raise ValueError(f"quant_pack: {bits}-bit codes of shape {tuple(codes.shape)} {codes.dtype} do not tile "
                         "(needs 1-byte codes, out_features % 16 == 0 and in_features % 32 == 0)")
    codes = codes.contiguous()
    out = torch.empty_like(codes)
    native_library().kiln_quant_pack(codes.data_ptr(), out.data_ptr(), n, k, bits, torch.get_num_threads())
    return out


def _pack_6bit(codes: torch.Tensor) -> torch.Tensor:
    """6-bit codes (int8 ``[n, k]``, -32..31) as quant_linear.c reads them: ``u = code + 32``'s low
    nibbles in 4-bit chunks, then its high bit pairs in the same panel order."""
    n, k = codes.shape
    if native_library() is None or not quant_shape_tiles(n, k, 6, 16) or codes.dtype != torch.int8:
        raise ValueError(f"quant_pack: 6-bit codes of shape {tuple(codes.shape)} {codes.dtype} do not tile "
                         f"(needs int8 codes, out_features % 16 == 0 and in_features % {SUPER_K} == 0)")
    u = (codes.to(torch.int16) + 32).to(torch.uint8)
    low = quant_pack((u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4), 4)
    # byte 4c + i of block b, pair p: column c's k 16p + 4q + i high bits at bit 2q
    high = (u >> 4).reshape(n // 16, 16, k // 16, 4, 4)
    high = sum(high[:, :, :, q] << (2 * q) for q in range(4)).permute(0, 2, 1, 3).reshape(n // 16, k // 16, 64)
    pairs = n // 32  # blocks pair up into panels whose records alternate (quant_linear.c's high_bits_at)
    panels = high[:2 * pairs].reshape(pairs, 2, k // 16, 64).transpose(1, 2).reshape(-1)
    return torch.cat([low.reshape(-1), panels, high[2 * pairs:].reshape(-1)]).reshape(n, k * 3 // 4)


def quant_pack_scales(scales: torch.Tensor, zeros: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                      super_scale: torch.Tensor | None = None,
                      super_offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A checkpoint's float32 scales and zero points or offsets in the kernels' layout: scales per
    channel ``[n]`` unchanged; group scales ``[n, groups]`` as float16 ``[n / 16, groups, 16]`` (a
    block's 16 scales are one vector load), group offsets (``offsets``, or ``-zero * scale``) too.
    kiln's quantizers give float16-exact scales. With ``super_scale`` (GGUF K-quants): ``scales``
    and ``offsets`` are int8 codes ``[n, groups]`` under float16-exact multipliers ``super_scale``
    and ``super_offset`` ``[n, k / SUPER_K]``, packed as super-block records uint8 ``[n / 16,
    k / SUPER_K, super_bytes(group)]`` (quant_linear.c)."""
    if super_scale is not None:
        return _super_blocks(scales, super_scale), None if offsets is None else _super_blocks(offsets, super_offset)
    if scales.dim() == 1:
        return scales.float().contiguous(), None

    def tiled(t: torch.Tensor) -> torch.Tensor:
        n, groups = t.shape
        return t.reshape(n // 16, 16, groups).transpose(1, 2).to(torch.float16).contiguous()

    if zeros is not None:
        offsets = -zeros.float() * scales.float()
    return tiled(scales), None if offsets is None else tiled(offsets)


def _super_blocks(codes: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[n, groups]`` and their multipliers ``[n, supers]`` as records ``[n / 16,
    supers, super_bytes(group)]``: each super-block's codes group-major (16 columns a group),
    then its 16 columns' float16 multipliers."""
    (n, groups), supers = codes.shape, multipliers.shape[1]
    per = groups // supers
    c = codes.to(torch.int8).view(torch.uint8).reshape(n // 16, 16, supers, per).permute(0, 2, 3, 1)
    m = multipliers.to(torch.float16).reshape(n // 16, 16, supers).transpose(1, 2).contiguous()
    return torch.cat([c.reshape(n // 16, supers, per * 16), m.view(torch.uint8)], dim=-1).contiguous()


def quant_kernel_group(scales: torch.Tensor, group_size: int | None) -> int:
    """The kernels' group for engine ``scales``: 0 for int8's scales per channel, else ``group_size``."""
    return 0 if scales.dim() == 1 else int(group_size)


def quant_bits_arg(bits: int, codebook: str | None, super_scales: bool = False) -> int:
    """The kernels' ``bits`` argument for ``bits``-bit codes read through ``codebook``, with
    super-block scales (``super_scales``) or not."""
    arg = bits | (SCALES_SUPER if super_scales else 0)
    if codebook is None:
        return arg
    if codebook not in CODEBOOKS or bits != 4:
        raise ValueError(f"codebook {codebook!r} with {bits}-bit codes: the kernels take {CODEBOOKS} 4-bit codes")
    return arg | CODES_E2M1


def quant_batch_invariant_rows() -> int:
    """Up to how many rows of x a 4- or 6-bit ``quant_linear`` computes each row exactly as a
    call of that row alone would (the integer GEMV, or AMX int8 tiles with its arithmetic): 12
    with AVX512-VNNI, 32 with AMX or AVX2 alone; 0 without the native library."""
    lib = native_library()
    return 0 if lib is None else int(lib.kiln_quant_batch_invariant_rows())


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
                 group_size: int | None, bias: torch.Tensor | None, out_features: int, *,
                 out: torch.Tensor | None = None, codebook: str | None = None,
                 super_scales: bool = False) -> torch.Tensor:
    """``F.linear`` of bf16 ``x`` ``[m, k]`` with a weight-only quantized weight in the kernels'
    layout: ``codes`` from ``quant_pack``, ``scales`` and ``offsets`` (or None) from
    ``quant_pack_scales`` (see quant_linear.c; ``super_scales``: its super-block records);
    ``group_size`` is ignored for scales per channel; ``codebook`` "e2m1": 4-bit codes are
    MXFP4's E2M1 nibbles."""
    m, k = x.shape
    y = output(out, m, out_features, torch.bfloat16)
    native_library().kiln_quant_linear_bf16(
        x.contiguous().data_ptr(), codes.data_ptr(), scales.data_ptr(),
        offsets.data_ptr() if offsets is not None else None, quant_bits_arg(bits, codebook, super_scales),
        quant_kernel_group(scales, group_size),
        bias.data_ptr() if bias is not None else None, y.data_ptr(), m, out_features, k, torch.get_num_threads())
    return y
