"""LoRA adapters applied inside a step.

A step may mix sequences with different adapters and sequences with none. The runner builds
a :class:`LoraStep` (which rows of the step's packed tokens use which adapter) and hands it
to the model in the step's metadata (``AttentionMetadata.lora``); every adapted linear
(``Linear.lora_targets``, set by ``DecoderModelForCausalLM.assign_lora_targets``) then adds, per adapter present in
the step, ``(x[rows] A^T) B^T`` to the output columns of each reference module it holds
(q, k and v are column ranges of the fused qkv projection; gate and up of the fused
gate/up one). The matmuls run once per adapter and linear, whatever the number of sequences
using it. A DoRA row also carries its module's normalized magnitude ``m`` (``kiln lora
normalize-dora``: the trained magnitude over the row norms of ``W + B A``); its output columns
become ``m * (W x + B A x)`` plus the bias, as PEFT's DoRA computes them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kiln.checkpoint.lora import LoraModule


@dataclass(frozen=True, eq=False)
class LoraTarget:
    """A reference module (``module_id``) of layer ``layer`` inside a linear: its delta goes
    to output columns ``start:stop``. ``rows`` (int64 indices), when the linear holds only some
    of the module's output rows (one half of a gate/up pair kiln keeps as two linears, or Qwen3-Next's
    rows of a fused projection kiln splits), says which, in column order; None: all of them.
    ``columns`` likewise, when the linear's inputs are the module's in another order (a Gated
    DeltaNet out_proj over llama.cpp's tiled value heads): the module's input feature for each
    of the linear's; None: the same order.
    Compared by identity: a linear's targets are made once and key the fused-matmul cache."""

    layer: int
    module_id: int
    start: int
    stop: int
    rows: torch.Tensor | None = None
    columns: torch.Tensor | None = None


class LoraAdapter:
    """An adapter's rows, ready to apply: ``A`` ``[r, in]``, ``B`` ``[out, r]`` and (DoRA) the
    magnitude ``[out]`` per (layer, module id), float32 (the deltas are computed in float32 and
    rounded once)."""

    _keys = itertools.count(1)

    def __init__(self, modules: list[LoraModule]):
        self.key = ("lora", next(self._keys))  # distinct per adapter: salts its prefix-cache hashes
        self.source = None  # the reference (weights, config) it was parsed from, for other ranks to shard
        self.weights = {(m.layer, m.module_id): (m.a.float().contiguous(), m.b.float().contiguous(),
                                                 None if m.magnitude is None else m.magnitude.float())
                        for m in modules}
        self._fused: dict[tuple[LoraTarget, ...], FusedLora | None] = {}

    @property
    def nbytes(self) -> int:
        return sum(4 * sum(t.numel() for t in row if t is not None) for row in self.weights.values())

    def fused(self, targets: tuple[LoraTarget, ...]) -> FusedLora | None:
        """This adapter's modules among one linear's ``targets`` as one pair of matmuls (None
        when it adapts none of them). Built once per linear."""
        if targets not in self._fused:
            present = [(t, self.weights[t.layer, t.module_id]) for t in targets
                       if (t.layer, t.module_id) in self.weights]
            self._fused[targets] = _fuse(present) if present else None
        return self._fused[targets]


@dataclass(frozen=True)
class FusedLora:
    """One adapter's modules of one linear: ``a`` ``[sum r, in]`` stacked, ``b`` ``[stop -
    start, sum r]`` with each module's ``B`` in its own columns and output rows (zeros
    elsewhere), the output columns ``start:stop`` they cover, and ``scale`` ``[stop - start]``
    (DoRA magnitudes; 1 in the columns of plain LoRA modules) or None without DoRA."""

    a: torch.Tensor
    b: torch.Tensor
    start: int
    stop: int
    scale: torch.Tensor | None


def _fuse(present: list[tuple[LoraTarget, tuple]]) -> FusedLora:
    start, stop = min(t.start for t, _ in present), max(t.stop for t, _ in present)
    a = torch.cat([a if t.columns is None else a[:, t.columns] for t, (a, _, _) in present])
    b = torch.zeros(stop - start, a.shape[0])
    dora = any(m is not None for _, (_, _, m) in present)
    scale = torch.ones(stop - start) if dora else None
    offset = 0
    for t, (_, module_b, magnitude) in present:
        columns = slice(t.start - start, t.stop - start)
        b[columns, offset:offset + module_b.shape[1]] = module_b if t.rows is None else module_b[t.rows]
        offset += module_b.shape[1]
        if magnitude is not None:
            scale[columns] = magnitude if t.rows is None else magnitude[t.rows]
    return FusedLora(a, b, start, stop, scale)


class LoraStep:
    """The adapters of one step: ``groups`` of (adapter, int64 row indices into the step's tokens)."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]]):
        self.groups = groups

    def apply(self, targets: tuple[LoraTarget, ...], x: torch.Tensor, y: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``y`` (the linear's output for ``x``, ``[tokens, out]``, ``bias`` included) plus
        every delta of this step's adapters for ``targets``: per adapter, one pair of matmuls
        over its rows (all of the linear's modules at once, ``LoraAdapter.fused``)."""
        x = x.reshape(-1, x.shape[-1])
        for adapter, rows in self.groups:
            fused = adapter.fused(targets)
            if fused is None:
                continue
            every_row = rows.numel() == x.shape[0]  # one adapter for the whole step: no gather
            inputs = (x if every_row else x.index_select(0, rows)).float()
            delta = (inputs @ fused.a.t()) @ fused.b.t()
            out = y[:, fused.start:fused.stop]
            if fused.scale is not None:  # DoRA: m * (W x + B A x) + bias
                base = (out if every_row else out.index_select(0, rows)).float()
                shift = None if bias is None else bias[fused.start:fused.stop].float()
                delta = (base + delta if shift is None else base - shift + delta) * fused.scale
                delta = (delta if shift is None else delta + shift).to(y.dtype)
                if every_row:
                    out.copy_(delta)
                else:
                    out.index_copy_(0, rows, delta)
            elif every_row:
                out += delta.to(y.dtype)
            else:
                out.index_add_(0, rows, delta.to(y.dtype))
        return y

