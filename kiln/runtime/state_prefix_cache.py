"""Prefix caching for hybrid models: recurrent states kept at block boundaries (pure Python).

A cached prefix's K/V blocks serve the attention layers, but a recurrent layer keeps no history
to attend to: a later sequence can skip the prefix only if it also gets the state each recurrent
layer had right after it. So states are saved at block boundaries, into checkpoint slots of
the state cache beside the sequences' own (``kiln.runtime.state_slots``), under the hash of the
block that ends there (the prefix cache's chained hash, ``BlockPool``)::

    sequence A:  [b0][b1][b2][t..]      step ends at b2's end -> copy A's state into checkpoint 5,
                                        findable under hash(b0 b1 b2)
    sequence B:  [b0][b1][b2][u..]      takes blocks b0-b2 and checkpoint 5's copy as its state,
                                        computes from u on

Which boundaries get a state: every one a sequence's computed tokens end on after a step --
each block a decode crosses (so a finished conversation's last full block has one: its next
turn starts there), and the last block boundary before a prompt's last token, which a prompt's
chunk is cut at (``cap_chunk``). A sequence keeps its prompt's and its latest other one (each new one replaces
the last), in a fixed pool of checkpoints whose least recently saved or used is given up first. A cached prefix is used up to its last block with a
state; blocks past it are computed again. A beam search's sequences save none (their slots
change hands between steps).

Copies run at the start of the next step, all of a step's at once (every source read before any
destination is written), and a checkpoint becomes findable only after its copy has run.
"""
from __future__ import annotations

from collections import OrderedDict

from kiln.runtime.block_pool import BlockPool
from kiln.runtime.sequence import Sequence


class StatePrefixCache:
    def __init__(self, slots: range, block_size: int):
        """``slots``: the checkpoint slots' indices in the state cache (past the sequences')."""
        self.num_slots = len(slots)
        self.block_size = block_size
        self._free = list(reversed(slots))
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._saving: list[tuple[int, int]] = []  # (hash, slot) whose copies the next step runs
        self._copying: list[tuple[int, int]] = []  # (hash, slot) whose copies the step just scheduled runs
        self.num_saved = 0  # statistics
        self.num_restored = 0

    def take_prefix(self, seq: Sequence, blocks: list[int], hashes: list[int], pool: BlockPool
                    ) -> tuple[list[int], list[int]]:
        """The part of a cached prefix (``blocks``, their ``hashes``) ``seq`` can start from: up
        to its last block with a saved state (the blocks past it go back to ``pool``). The state
        is copied into the sequence's current slot when it gets its slots (``restore``)."""
        keep, seq.state_restore = 0, None
        for j in range(len(hashes), 0, -1):
            slot = self._slot_of.get(hashes[j - 1])
            if slot is not None:
                self._slot_of.move_to_end(hashes[j - 1])
                keep, seq.state_restore = j, slot
                break
        pool.give_back_prefix(blocks[keep:])
        return blocks[:keep], hashes[:keep]

    @staticmethod
    def restore(seq: Sequence, copies: list[tuple[int, int]]) -> None:
        """Once ``seq`` has its slots: its saved starting state into the current one."""
        if seq.state_restore is not None:
            copies.append((seq.state_restore, seq.state_slots[0]))
            seq.state_restore = None

    def cap_chunk(self, seq: Sequence, n: int) -> int:
        """``n`` tokens of ``seq`` this step, cut at the last block boundary before its last token
        when the chunk would cross it (so a state is saved where the same prompt again, which
        computes at least its last token, can start); a chunk verifying proposed tokens is never
        cut (they are verified together or not at all)."""
        start, boundary = seq.num_computed_tokens, self._last_boundary(seq.num_tokens)
        return boundary - start if start < boundary < start + n and not seq.spec_tokens else n

    def _last_boundary(self, num_tokens: int) -> int:
        return (num_tokens - 1) // self.block_size * self.block_size

    def after_compute(self, seq: Sequence, copies: list[tuple[int, int]]) -> None:
        """After a step: when ``seq``'s computed tokens end on a block boundary, save its current
        state there (a copy queued in ``copies``) unless that prefix has one. The state at the
        prompt's last boundary (``cap_chunk``) stays; each later one replaces the sequence's previous one
        (``seq.state_checkpoint``), so a sequence holds at most two checkpoints however long it
        runs, and a finished one keeps its last two until they are the least recently used."""
        computed, bs = seq.num_computed_tokens, self.block_size
        full = computed // bs
        if getattr(seq.group, "beam", None) is not None or not full or computed % bs or len(seq.block_hashes) < full:
            return
        block_hash = seq.block_hashes[full - 1]
        if block_hash in self._slot_of or any(h == block_hash for h, _ in self._saving + self._copying):
            return
        prompt_end = computed == self._last_boundary(seq.num_prompt_tokens)
        previous = None if prompt_end else seq.state_checkpoint
        if previous is not None and self._slot_of.get(previous[0]) == previous[1]:
            slot = self._slot_of.pop(previous[0])  # (a restore queued earlier reads it before this copy writes)
        elif self._free:
            slot = self._free.pop()
        elif self._slot_of:  # give up the least recently used checkpoint (its copies have all run)
            slot = self._slot_of.popitem(last=False)[1]
        else:  # every slot is being written by pending copies
            return
        if not prompt_end:
            seq.state_checkpoint = (block_hash, slot)
        self._saving.append((block_hash, slot))
        copies.append((seq.state_slots[0], slot))
        self.num_saved += 1

    def scheduled(self, runs: bool) -> None:
        """After each ``schedule``: the checkpoints the previous step copied become findable;
        those queued since are copied by this step if it ``runs`` (else they wait for one)."""
        for block_hash, slot in self._copying:
            self._slot_of[block_hash] = slot
        self._copying = []
        if runs:
            self._copying, self._saving = self._saving, []

    @property
    def num_cached(self) -> int:
        return len(self._slot_of)
