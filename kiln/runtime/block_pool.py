"""BlockPool: fixed KV-cache blocks with reference counts (pure Python, no tensors).

A block is free when its reference count is zero. ``fork`` shares blocks between
sequences (beam search, prefix reuse) by raising their counts.
"""
from __future__ import annotations

from collections import deque

from kiln.errors import CapacityError


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise CapacityError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, or :class:`CapacityError` (and nothing taken) if there are fewer free."""
        if n > len(self._free):
            raise CapacityError(f"KV cache full: {n} blocks needed, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share ``blocks`` with another owner."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} is not allocated")
            self._ref_counts[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block with none left becomes free."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
