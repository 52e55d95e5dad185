"""Collectives used by tensor-parallel layers.

Layers call these explicitly in ``forward``. With ``tp_size == 1`` they are no-ops; with
more ranks they need an initialised ``torch.distributed`` process group.
"""
from __future__ import annotations

import torch

from kiln.errors import KilnError


def _require_group(tp_size: int) -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise KilnError(
            f"this model is split over tp_size={tp_size} ranks, but no torch.distributed process "
            "group is initialised; run one process per rank"
        )


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group."""
    if tp_size == 1:
        return x
    _require_group(tp_size)
    torch.distributed.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    if tp_size == 1:
        return x
    _require_group(tp_size)
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
