"""AttentionMetadata: everything about one packed step that attention needs.

A step's tokens are packed without padding: sequence ``i`` contributes ``query_lens[i]``
tokens (a prompt chunk, or one generated token) and afterwards holds ``seq_lens[i]``
tokens in the KV cache::

    tokens:   | seq0 chunk (5) | seq1 (1) | seq2 (1) | seq3 chunk (3) |
    query_start_loc: 0          5          6          7                10

Token ``t`` is written to cache slot ``slot_mapping[t]`` (``block * block_size + offset``).
Block-table entries a sliding window released (``RELEASED``) are never attended to; they are
replaced by the sequence's last block so no backend indexes the cache with them.

Recurrent layers (hybrid models) keep a fixed-size state per sequence instead of K/V per token:
each sequence of the step names two state slots, the one its state is read from and the one the
layer writes the state after this step's tokens to (see ``kiln.runtime.state_slots``), grouped
for the layers as ``state_groups``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.layers.embedding import PromptStep
from kiln.layers.lora import LoraStep
from kiln.step.kv_cache import SlotIndex, slot_index

RELEASED = -1  # a block-table entry whose block went back to the pool (kiln.runtime.block_pool)


@dataclass
class StateGroup:
    """Sequences of a step whose tokens a recurrent layer processes together: ``count`` sequences
    of ``length`` tokens each, in rows ``rows`` of the step (``count * length`` rows, sequence
    by sequence). Their states are read from slots ``read`` and written to slots ``write``
    (``[count]`` int64); a ``fresh`` sequence (``[count]`` bool) starts from a zero state."""

    rows: slice
    count: int
    length: int
    read: torch.Tensor
    write: torch.Tensor
    fresh: torch.Tensor


def state_groups(query_lens: list[int], seq_lens: list[int], query_start_loc: list[int],
                 state_slots: list[tuple[int, int]]) -> list[StateGroup]:
    """The step's sequences as recurrent layers process them: each run of consecutive one-token
    sequences (decode rows) as one group, each longer chunk (a prompt) as a group of its own."""
    groups: list[StateGroup] = []
    i, n = 0, len(query_lens)
    while i < n:
        j = i + 1
        if query_lens[i] == 1:
            while j < n and query_lens[j] == 1:
                j += 1
        slots = state_slots[i:j]
        groups.append(StateGroup(
            slice(query_start_loc[i], query_start_loc[j]), j - i, query_lens[i],
            torch.tensor([r for r, _ in slots], dtype=torch.int64), torch.tensor([w for _, w in slots], dtype=torch.int64),
            torch.tensor([s == q for q, s in zip(query_lens[i:j], seq_lens[i:j])])))
        i = j
    return groups


@dataclass
class AttentionMetadata:
    backend: object  # the attention backend; see kiln.step.attention
    query_lens: list[int]
    seq_lens: list[int]  # KV length of each sequence after this step
    query_start_loc: list[int]
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: list[list[int]]  # block ids of each sequence, in order
    block_size: int
    token_seq_lens: torch.Tensor  # [num_tokens]: its sequence's seq_len (dynamic rope)
    lora: LoraStep | None = None  # the step's adapters and their rows, for every adapted linear
    prompts: PromptStep | None = None  # the step's prompt-tuning tables, for the embedding
    # Per-layer inputs of the step's tokens, ``[num_tokens, layers, size]`` (Gemma 4's per-layer
    # embeddings), computed once before the first layer; None for models without them.
    layer_inputs: torch.Tensor | None = None
    # Layer index -> its (K, V) of this step, kept for layers that read another's (kv_source).
    shared_kv: dict = field(default_factory=dict)
    # The groups of sequences recurrent layers process, with their state slots; None for models
    # without recurrent layers.
    state_groups: list[StateGroup] | None = None
    _rotary_cache: dict = field(default_factory=dict)
    _slot_index: SlotIndex | None = None
    backend_state: dict = field(default_factory=dict)  # backend-specific per-step tensors

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def slot_index(self) -> SlotIndex:
        """``slot_mapping`` as the cache's ``(blocks, offsets)``, computed once per step and shared by layers."""
        if self._slot_index is None:
            self._slot_index = slot_index(self.slot_mapping, self.block_size)
        return self._slot_index

    def rotary_cos_sin(self, rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for this step's positions, computed once per step and shared by layers."""
        key = id(rotary)
        if key not in self._rotary_cache:
            self._rotary_cache[key] = rotary.cos_sin(positions, self.token_seq_lens, max(self.seq_lens) - 1)
        return self._rotary_cache[key]

    @classmethod
    def build(cls, backend, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, lora: LoraStep | None = None, prompts: PromptStep | None = None,
              state_slots: list[tuple[int, int]] | None = None) -> "AttentionMetadata":
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        slots, token_seq_lens = [], []
        block_tables = [_without_released(table) for table in block_tables]
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            token_seq_lens.extend([s] * q)
        md = cls(backend=backend, query_lens=list(query_lens), seq_lens=list(seq_lens), query_start_loc=starts,
                 slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=block_tables,
                 block_size=block_size, token_seq_lens=torch.tensor(token_seq_lens, dtype=torch.int64),
                 lora=lora, prompts=prompts)
        if state_slots is not None:
            if len(state_slots) != len(query_lens):
                raise ValueError(f"{len(state_slots)} state slot pairs for {len(query_lens)} sequences")
            md.state_groups = state_groups(md.query_lens, md.seq_lens, starts, state_slots)
        backend.prepare(md)
        return md


def _without_released(table: list[int]) -> list[int]:
    """``table`` with its released leading entries pointing at its last block (always live:
    a step writes into it), which masks and windows then ignore."""
    if not table or table[0] != RELEASED:
        return table
    return [table[-1] if block == RELEASED else block for block in table]
