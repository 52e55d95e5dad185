"""Per-layer paged K/V tensors."""
from __future__ import annotations

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` pairs of ``[num_blocks, block_size, num_kv_heads, head_size]`` tensors.

    Left uninitialised, so the OS commits memory only as blocks are first written; the
    runner zeroes each block when the scheduler hands it out (``ModelRunner.clear_blocks``).
    """
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def available_memory_bytes() -> int:
    """Memory the OS reports as available (MemAvailable), or 8 GiB if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_size * torch.empty((), dtype=dtype).element_size()
