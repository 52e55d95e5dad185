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
from dataclasses import dataclass

import torch

from kiln.checkpoint.lora import LoraModule
from kiln.errors import RequestError
from kiln.layers.step_context import StepContext


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
        self._fused: dict[tuple[LoraTarget, ...], tuple | None] = {}

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())

    def fused(self, targets: tuple[LoraTarget, ...]) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """This adapter's modules among one linear's ``targets`` as one pair of matmuls:
        ``A`` ``[sum r, in]`` stacked, ``B`` ``[stop - start, sum r]`` with each module's ``B``
        in its own columns and output rows (zeros elsewhere), and the output columns
        ``start:stop`` they cover; None when it adapts none of them. Built once per linear."""
        if targets not in self._fused:
            present = [(t, self.weights[t.layer, t.module_id]) for t in targets
                       if (t.layer, t.module_id) in self.weights]
            if not present:
                self._fused[targets] = None
            else:
                start, stop = min(t.start for t, _ in present), max(t.stop for t, _ in present)
                a = torch.cat([a for _, (a, _) in present])
                b = torch.zeros(stop - start, a.shape[0])
                offset = 0
                for t, (_, module_b) in present:
                    b[t.start - start:t.stop - start, offset:offset + module_b.shape[1]] = module_b
                    offset += module_b.shape[1]
                self._fused[targets] = (a, b, start, stop)
        return self._fused[targets]


class LoraStep:
    """The adapters of one step: ``groups`` of (adapter, int64 row indices into the step's tokens)."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]]):
        self.groups = groups

    def apply(self, targets: tuple[LoraTarget, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the linear's output for ``x``, ``[tokens, out]``) plus every delta of this
        step's adapters for ``targets``: per adapter, one pair of matmuls over its rows (all
        of the linear's modules at once, ``LoraAdapter.fused``)."""
        x = x.reshape(-1, x.shape[-1])
        for adapter, rows in self.groups:
            fused = adapter.fused(targets)
            if fused is None:
                continue
            a, b, start, stop = fused
            every_row = rows.numel() == x.shape[0]  # one adapter for the whole step: no gather
            inputs = (x if every_row else x.index_select(0, rows)).float()
            delta = ((inputs @ a.t()) @ b.t()).to(y.dtype)
            if every_row:
                y[:, start:stop] += delta
            else:
                y[:, start:stop].index_add_(0, rows, delta)
        return y


LORA_STEP: StepContext[LoraStep] = StepContext("kiln_lora_step")
active_step = LORA_STEP.active  # the LoRA step the current model call runs under, or None
lora_step = LORA_STEP.using  # make a step active for the model calls inside the block
