"""Host memory on transparent huge pages, for the KV cache and checkpoints loaded for conversion.

Attention reads a sequence's whole cache every step, and the plain-layout GEMVs of a
checkpoint stream whole weights: on 4 KiB pages the TLB misses and the hardware prefetcher
stopping at each page edge left ~12% of a GEMV's bandwidth unused here (~16% of a 4-bit
GEMV's speed). So the KV cache, a checkpoint's tensors and an engine's 4-bit codes (read from
the file straight into it, ``empty_many``; kiln.models.loading) live in a private anonymous
mapping advised ``MADV_HUGEPAGE``. An engine's other weights are mapped from its file: bf16
tiles and int8 codes decode as fast on file pages (kiln.checkpoint.safetensors_io ``mapped``).

Off when the kernel's THP mode is ``never``, off the CPU, or with ``KILN_HUGE_PAGES=0``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys
from functools import lru_cache

import torch

from kiln import env

HUGE_PAGE_BYTES = 2 << 20
_ALIGN = 64  # a cache line: every tensor starts on its own line


@lru_cache(maxsize=1)
def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages (Linux, THP not ``never``)."""
    if not env.huge_pages_enabled() or sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8`` tensor of ``nbytes`` on 2 MiB-aligned, huge-page-advised memory.

    The mapping is private and anonymous (shared anonymous memory is shmem, which THP
    usually skips); the OS commits it as it is first written, like ``torch.empty``.
    """
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + nbytes]


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty`` on huge pages when they are available for ``device``."""
    if torch.device(device).type != "cpu" or not huge_pages_available():
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_page_bytes(nbytes).view(dtype).view(shape)


def empty_many(numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Uninitialised 1-D tensors of ``numels`` elements, carved from one huge-page arena (each
    starting on a cache line); ordinary ``torch.empty`` tensors without huge pages."""
    if not huge_pages_available():
        return [torch.empty(n, dtype=dtype) for n in numels]
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [-(-n * itemsize // _ALIGN) * _ALIGN for n in numels]
    arena = huge_page_bytes(sum(sizes))
    out, offset = [], 0
    for n, size in zip(numels, sizes):
        out.append(arena[offset:offset + n * itemsize].view(dtype))
        offset += size
    return out


@lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c") if sys.platform == "linux" else None
    return ctypes.CDLL(name) if name else None


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``): a long loop of
    large temporaries of varying sizes (a layer-by-layer calibration) otherwise leaves freed
    chunks counted in the process's memory, growing layer after layer. No-op off glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
