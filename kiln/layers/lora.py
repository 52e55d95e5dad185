"""LoRA adapters applied inside a step.

A step may mix sequences with different adapters and sequences with none. The runner builds
a :class:`LoraStep` (which rows of the step's packed tokens use which adapter) and makes it
active around the model call (``lora_step``); every adapted linear (``Linear.lora_targets``,
set by ``DecoderModelForCausalLM.assign_lora_targets``) then adds, per adapter present in
the step, ``(x[rows] A^T) B^T`` to the output columns of each reference module it holds
(q, k and v are column ranges of the fused qkv projection; gate and up of the fused
gate/up one). The matmuls run once per adapter and linear, whatever the number of sequences
using it.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

from kiln.checkpoint.lora import LoraModule
from kiln.errors import RequestError


@dataclass(frozen=True)
class LoraTarget:
    """A reference module (``module_id``) of layer ``layer`` inside a linear: its delta goes
    to output columns ``start:stop``."""

    layer: int
    module_id: int
    start: int
    stop: int


class LoraAdapter:
    """An adapter's rows, ready to apply: ``A`` ``[r, in]`` and ``B`` ``[out, r]`` per
    (layer, module id), float32 (the deltas are computed in float32 and rounded once)."""

    _keys = itertools.count(1)

    def __init__(self, modules: list[LoraModule]):
        if any(m.magnitude is not None for m in modules):
            raise RequestError("LoRA: DoRA rows (is_dora 1) are not supported yet")
        self.key = ("lora", next(self._keys))  # distinct per adapter: salts its prefix-cache hashes
        self.weights = {(m.layer, m.module_id): (m.a.float().contiguous(), m.b.float().contiguous())
                        for m in modules}

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


class LoraStep:
    """The adapters of one step: ``groups`` of (adapter, int64 row indices into the step's tokens)."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]]):
        self.groups = groups

    def apply(self, targets: tuple[LoraTarget, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the linear's output for ``x``, ``[tokens, out]``) plus every delta of this
        step's adapters for ``targets``."""
        for adapter, rows in self.groups:
            inputs = None
            for target in targets:
                pair = adapter.weights.get((target.layer, target.module_id))
                if pair is None:
                    continue
                if inputs is None:
                    inputs = x.reshape(-1, x.shape[-1]).index_select(0, rows).float()
                a, b = pair
                delta = (inputs @ a.t()) @ b.t()
                y[:, target.start:target.stop].index_add_(0, rows, delta.to(y.dtype))
        return y


_active: ContextVar[LoraStep | None] = ContextVar("kiln_lora_step", default=None)


def active_step() -> LoraStep | None:
    """The LoRA step the current model call runs under, or None."""
    return _active.get()


@contextmanager
def lora_step(step: LoraStep | None) -> Iterator[None]:
    """Make ``step`` active for the model calls inside the block."""
    token = _active.set(step)
    try:
        yield
    finally:
        _active.reset(token)
