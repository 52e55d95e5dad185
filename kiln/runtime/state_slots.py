"""StateSlots: the recurrent-state slots of a hybrid model's sequences (pure Python).

Beside its KV blocks (attention layers only), a running sequence of a hybrid model owns two state
slots, taken when the scheduler admits it and given back with its blocks (finished, preempted,
cancelled, failed)::

    sequence 7:  blocks [4, 9, 12]     state slots [current 2, spare 3]
    step:        read slot 2  ->  recurrent layers  ->  write slot 3
    success:     slots become [current 3, spare 2]       (a failed step changes nothing)

Reading one slot and writing the other costs what an update in place costs (each state is read
and written once) and keeps the state before the step: a step that raises is rerun from it, and
a beam that recomputes its last token steps back to it (``step_back``).
"""
from __future__ import annotations

from kiln.errors import CapacityError


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise CapacityError(f"the recurrent state cache needs at least two slots, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_free_pairs(self) -> int:
        return len(self._free) // 2

    def allocate(self) -> list[int]:
        """A sequence's two slots ``[current, spare]``, or :class:`CapacityError` if fewer are free."""
        if len(self._free) < 2:
            raise CapacityError(f"recurrent state cache full: all {self.num_slots} slots are in use")
        return [self._free.pop(), self._free.pop()]

    def adopt(self, slots: list[int], source: int, copies: list[tuple[int, int]]) -> list[int]:
        """A sequence's slots (``slots``, or new ones for a sequence without) made to hold a copy of
        slot ``source`` (a beam taking its parent's current state): the copy goes to ``copies``
        (made before the next step) into the spare slot, which becomes current now."""
        if slots and slots[0] == source:
            return slots
        slots = slots or self.allocate()
        copies.append((source, slots[1]))
        commit(slots)
        return slots

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            if slot in self._free:
                raise ValueError(f"state slot {slot} freed twice")
            self._free.append(slot)


def commit(slots: list[int]) -> None:
    """After a step that ran a sequence's tokens: the slot written (the spare) becomes current."""
    slots.reverse()


def step_back(slots: list[int]) -> None:
    """Undo the last ``commit``: the state before the last step is current again (its slot was not
    written since)."""
    slots.reverse()
