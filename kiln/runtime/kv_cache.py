"""Per-layer paged K/V tensors."""
from __future__ import annotations

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` pairs of ``[num_blocks, block_size, num_kv_heads, head_size]`` tensors.

    Left uninitialised, so the OS commits memory only as blocks are first written. Block 0
    is zeroed: padded attention reads slot 0 under a mask, and masked garbage could be NaN.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    caches = []
    for _ in range(num_layers):
        k, v = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
        k[0].zero_()
        v[0].zero_()
        caches.append((k, v))
    return caches


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
