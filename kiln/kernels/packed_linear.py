"""bf16 linears on a weight packed into tiles (panel_linear.c, amx_linear.c): the tile layout,
packing it (``kiln build`` writes engines' bf16 linear weights this way), and the kernel that
multiplies on AMX tiles or with AVX512-BF16 dot products, for any number of rows."""
from __future__ import annotations

from functools import lru_cache

import torch

from kiln.kernels.library import native_library, output


@lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether AMX bf16 tiles work here (the CPU has them and Linux granted them to us);
    ``KILN_AMX=0`` turns them off (the packed kernels then use AVX512-BF16 dot products)."""
    lib = native_library()
    return lib is not None and bool(lib.kiln_amx_available())


@lru_cache(maxsize=1)
def packed_linear_available() -> bool:
    """Whether ``packed_linear`` runs on vector units here: AMX tiles, AVX512-BF16 dot products,
    or AVX2 FMAs on bf16 widened to fp32 (its plain-C loop is slower than oneDNN)."""
    lib = native_library()
    return lib is not None and bool(lib.kiln_amx_available() or lib.kiln_vector_panels_available())


def tile_packable(shape: tuple[int, ...]) -> bool:
    """Whether a weight of this shape has the tile layout of ``pack_bf16``: ``[n, k]`` with
    n % 16 == 0 and k % 32 == 0."""
    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 32 == 0


def packed_supported(weight: torch.Tensor) -> bool:
    """Whether ``packed_linear`` takes this weight, fast, here: bf16 that ``tile_packable``, on
    a CPU where its panels run on vector units (packed_linear_available)."""
    return (weight.dtype == torch.bfloat16 and tile_packable(tuple(weight.shape)) and weight.device.type == "cpu"
            and packed_linear_available())


def pack_bf16(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` ``[n, k]`` in the VNNI tile layout of ``packed_linear`` (amx_linear.c), same
    shape, or written into ``out`` (``weight.numel()`` contiguous elements)::

        packed[nb][kb][p][c][e] = weight[16 nb + c][32 kb + 2 p + e]     (p, c < 16; e < 2)

    Pure data movement, so ``kiln build`` writes it on any machine (and any dtype packs)."""
    if not tile_packable(tuple(weight.shape)):
        raise ValueError(f"pack_bf16: needs a weight [n, k] with n % 16 == 0 and k % 32 == 0; "
                         f"got {tuple(weight.shape)}")
    n, k = weight.shape
    tiles = weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
    if out is None:
        return tiles.contiguous().view(n, k)
    if out.numel() != weight.numel() or out.dtype != weight.dtype or not out.is_contiguous():
        raise ValueError(f"pack_bf16: out must be {weight.numel()} contiguous {weight.dtype} elements")
    out.view(tiles.shape).copy_(tiles)
    return out.view(n, k)


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """The row-major ``[n, k]`` weight a ``pack_bf16`` tensor of that shape holds."""
    n, k = packed.shape
    return packed.reshape(n // 16, k // 32, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(n, k)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, *,
                  out: torch.Tensor | None = None, portable: bool = False) -> torch.Tensor:
    """``F.linear`` of bf16 ``x`` ``[m, k]`` with a weight packed by ``pack_bf16``: on AMX tiles,
    else AVX512-BF16 dot products (panel_linear.c); ``portable`` forces the plain-C loop."""
    m, k = x.shape
    y = output(out, m, out_features, torch.bfloat16)
    fn = native_library().kiln_portable_linear_bf16 if portable else native_library().kiln_packed_linear_bf16
    fn(x.contiguous().data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(), m,
       out_features, k, torch.get_num_threads())
    return y
