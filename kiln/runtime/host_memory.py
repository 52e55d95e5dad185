"""Host memory on transparent huge pages, for the weights and the KV cache.

Decode reads every weight once per token, so it runs at memory bandwidth. On 4 KiB pages a
270 MB model spans ~66,000 pages: TLB misses and the hardware prefetcher stopping at each
page edge left ~12% of the batch-1 GEMV bandwidth unused here. Memory-mapped safetensors
pages cannot be huge, so a loaded engine's parameters are copied once into a private
anonymous mapping advised ``MADV_HUGEPAGE`` (the copy takes a few tens of milliseconds).

Off when the kernel's THP mode is ``never``, off the CPU, or with ``KILN_HUGE_PAGES=0``.
"""
from __future__ import annotations

import math
import mmap
import os
import sys
from functools import lru_cache

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 << 20
_ALIGN = 64  # a cache line: every tensor starts on its own line


@lru_cache(maxsize=1)
def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages (Linux, THP not ``never``)."""
    if os.environ.get("KILN_HUGE_PAGES", "1") == "0" or sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
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


def move_parameters_to_huge_pages(model: nn.Module) -> int:
    """Copy ``model``'s CPU parameters into one huge-page arena; returns the bytes moved.

    Tied parameters (one ``Parameter`` in two modules) are moved once and stay tied.
    """
    if not huge_pages_available():
        return 0
    params = {id(p): p for p in model.parameters() if p.device.type == "cpu" and p.numel() > 0}
    params = {key: p for key, p in params.items() if p.is_contiguous()}
    offsets, total = {}, 0
    for key, p in params.items():
        offsets[key] = total
        total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    if total == 0:
        return 0
    arena = huge_page_bytes(total)
    for key, p in params.items():
        nbytes = p.numel() * p.element_size()
        slot = arena[offsets[key]:offsets[key] + nbytes].view(p.dtype).view(p.shape)
        slot.copy_(p.data)
        p.data = slot
    return total
