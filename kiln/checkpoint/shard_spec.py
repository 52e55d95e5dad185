"""How one tensor-parallel rank takes its part of one external tensor (the loader reads just
that part; layers say which part they need through ``load_spec``)."""
from __future__ import annotations

import math
from dataclasses import dataclass


def rank_range(size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` of ``size`` entries that rank ``tp_rank`` of ``tp_size`` holds
    (chunks of ceil(size / tp_size); the last may be short)."""
    chunk = math.ceil(size / tp_size)
    start = min(tp_rank * chunk, size)
    return start, min(start + chunk, size)


@dataclass(frozen=True)
class ShardSpec:
    """How one rank takes its part of one external tensor.

    ``dim`` is the dimension split over ranks (``None``: the whole tensor). When that
    dimension is a concatenation of parts (a fused qkv, say), ``parts`` lists them as
    ``(size, tp_size, tp_rank)``: each part is split on its own and the rank's pieces are
    concatenated; a part with ``tp_size`` 0 is skipped (another parameter takes it). ``size``
    may be ``None`` for a single part spanning the dimension.
    """

    dim: int | None = None
    parts: tuple[tuple[int | None, int, int], ...] = ((None, 1, 0),)

    @staticmethod
    def even(dim: int | None, tp_size: int, tp_rank: int) -> "ShardSpec":
        if dim is None or tp_size == 1:
            return ShardSpec()
        return ShardSpec(dim, ((None, tp_size, tp_rank),))

    def transposed(self) -> "ShardSpec":
        """The same split for a 2-D tensor stored the other way round."""
        return self if self.dim is None else ShardSpec(1 - self.dim, self.parts)
