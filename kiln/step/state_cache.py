"""Per-layer recurrent state tensors (hybrid models), beside the paged KV cache.

A recurrent layer (a short convolution, Gated DeltaNet, Mamba2) keeps, per sequence, a fixed
amount of state however long the sequence grows: the last few inputs of its causal convolution
and, for the linear-attention kinds, a matrix per head. Its cache is one tensor per state part
of shape ``[num_slots, *part_shape]``; a sequence owns two slots (``kiln.runtime.state_slots``):
a step reads the state from one and writes the next state to the other, so a step that fails
leaves every sequence's state as it was.

    layer 0 (conv)       conv state   [slots, K-1, channels]
    layer 1 (attention)  paged K/V    [blocks, kv_heads, block_size, head]   (kiln.step.kv_cache)
    layer 2 (deltanet)   conv state   [slots, K-1, channels]
                         delta state  [slots, heads, key_dim, value_dim]  (float32)
"""
from __future__ import annotations

import math

import torch

# One state part: its shape per slot and element type.
StatePart = tuple[tuple[int, ...], torch.dtype]


def allocate_state_caches(specs: list[list[StatePart]], num_slots: int,
                          device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, ...]]:
    """For each recurrent layer (``specs``: its state parts), one tensor per part with
    ``num_slots`` slots. Left uninitialised, so memory is committed only as slots are first
    written: a sequence's first step starts from zeros instead of reading its slot."""
    return [tuple(torch.empty((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in parts)
            for parts in specs]


def state_bytes_per_slot(specs: list[list[StatePart]]) -> int:
    """Bytes one slot takes over all recurrent layers (a sequence holds two)."""
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for parts in specs for shape, dtype in parts)


def copy_state_slots(caches: list[tuple[torch.Tensor, ...]], copies: list[tuple[int, int]]) -> None:
    """Copy whole slots ``src -> dst`` in every recurrent layer (a beam taking its parent's state)."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies])
    dst = torch.tensor([d for _, d in copies])
    for parts in caches:
        for tensor in parts:
            tensor[dst] = tensor[src]
