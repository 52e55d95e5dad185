"""Per-layer paged K/V tensors."""
from __future__ import annotations

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` pairs of ``[num_blocks, block_size, num_kv_heads, head_size]`` tensors.

    Zero-filled: padded attention reads masked slots, and masked garbage could be NaN.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_size * torch.empty((), dtype=dtype).element_size()
