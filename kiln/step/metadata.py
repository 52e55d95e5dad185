"""AttentionMetadata: everything about one packed step that attention needs.

A step's tokens are packed without padding: sequence ``i`` contributes ``query_lens[i]``
tokens (a prompt chunk, or one generated token) and afterwards holds ``seq_lens[i]``
tokens in the KV cache::

    tokens:   | seq0 chunk (5) | seq1 (1) | seq2 (1) | seq3 chunk (3) |
    query_start_loc: 0          5          6          7                10

Token ``t`` is written to cache slot ``slot_mapping[t]`` (``block * block_size + offset``).
Block-table entries a sliding window released (``RELEASED``) are never attended to; they are
replaced by the sequence's last block so no backend indexes the cache with them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.layers.embedding import PromptStep
from kiln.layers.lora import LoraStep
from kiln.step.kv_cache import SlotIndex, slot_index

RELEASED = -1  # a block-table entry whose block went back to the pool (kiln.runtime.block_pool)


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
              block_size: int, lora: LoraStep | None = None, prompts: PromptStep | None = None) -> "AttentionMetadata":
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
        backend.prepare(md)
        return md


def _without_released(table: list[int]) -> list[int]:
    """``table`` with its released leading entries pointing at its last block (always live:
    a step writes into it), which masks and windows then ignore."""
    if not table or table[0] != RELEASED:
        return table
    return [table[-1] if block == RELEASED else block for block in table]
