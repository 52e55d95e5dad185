"""Prompt tuning requests (reference 001's PromptTuningEmbedding, in a batch of many tasks).

A request brings its task's embedding table ``[n_virtual, hidden]``; its prompt names the
table's rows as token ids ``vocab_size + i``. The runner gathers the tables of a step's
requests into one (``prompt_step``), each task ``task_vocab_size`` rows (the largest table's
size; smaller ones zero-padded), and gives every token its task, so one embedding call serves
every task in the batch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kiln.errors import RequestError
from kiln.layers.embedding import PromptStep


@dataclass
class PromptTuningConfig:
    """A request's prompt-tuning task (reference 003/001): its ``embedding_table``
    ``[n_virtual, hidden]``; the prompt names row ``i`` as token id ``vocab_size + i``."""

    embedding_table: object


@dataclass(frozen=True, eq=False)
class PromptTable:
    """A task's prompt embedding table, checked against the model; ``key`` salts the prefix
    cache (the same virtual ids mean other vectors in another table)."""

    table: torch.Tensor
    key: int

    _keys = itertools.count(1)

    @classmethod
    def of(cls, table, hidden_size: int, dtype: torch.dtype) -> "PromptTable":
        if not isinstance(table, torch.Tensor):
            try:
                table = torch.as_tensor(table)
            except (TypeError, ValueError, RuntimeError):
                raise RequestError(f"prompt_tuning_config: the embedding table must be a tensor or array, got "
                                   f"{type(table).__name__}") from None
        if table.dim() != 2 or table.shape[1] != hidden_size or table.shape[0] < 1:
            raise RequestError(f"prompt_tuning_config: the embedding table must be [n_virtual >= 1, {hidden_size}] "
                               f"(the model's hidden size), got {list(table.shape)}")
        if not table.is_floating_point():
            raise RequestError(f"prompt_tuning_config: the embedding table must be floating point, got {table.dtype}")
        return cls(table.detach().to(dtype).contiguous(), next(cls._keys))

    @property
    def num_virtual_tokens(self) -> int:
        return self.table.shape[0]


def check_table_size(table: PromptTable, max_size: int) -> None:
    """A table within the engine's ``max_prompt_embedding_table_size`` (0: no prompt tuning)."""
    if max_size == 0:
        raise RequestError("prompt tuning: this engine was built without it (build with "
                           "--max_prompt_embedding_table_size N, or LLM(..., max_prompt_embedding_table_size=N))")
    if table.num_virtual_tokens > max_size:
        raise RequestError(f"prompt_tuning_config: the embedding table has {table.num_virtual_tokens} rows, more "
                           f"than the engine's max_prompt_embedding_table_size {max_size}")


def check_prompt_ids(ids: list[int], vocab_size: int, table: PromptTable | None) -> None:
    """Ids below the vocabulary, or (with a table) virtual ids naming one of its rows."""
    limit = vocab_size + (table.num_virtual_tokens if table is not None else 0)
    bad = [t for t in ids if not 0 <= t < limit]
    if bad:
        extra = (f"; virtual tokens {vocab_size}..{limit - 1} name the rows of the prompt-tuning table"
                 if table is not None else " (ids from the vocabulary size up are virtual tokens, which need a "
                                           "prompt-tuning table)")
        raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}){extra}")


def prompt_step(chunks, input_ids: list[int], vocab_size: int) -> PromptStep | None:
    """The step's tables and each token's task; None when no token of the step is virtual
    (only the tokens of sequences with a table are looked at: the check runs every step)."""
    offset, virtual = 0, False
    for chunk in chunks:
        if chunk.seq.prompt_table is not None and not virtual:
            virtual = any(t >= vocab_size for t in input_ids[offset:offset + chunk.num_tokens])
        offset += chunk.num_tokens
    if not virtual:
        return None
    tables: dict[int, tuple[int, PromptTable]] = {}
    tasks = []
    for chunk in chunks:
        table = chunk.seq.prompt_table
        task = 0 if table is None else tables.setdefault(table.key, (len(tables), table))[0]
        tasks.extend([task] * chunk.num_tokens)
    ordered = [table for _, table in sorted(tables.values(), key=lambda item: item[0])]
    width = max(t.num_virtual_tokens for t in ordered)
    joined = torch.zeros(len(ordered) * width, ordered[0].table.shape[1], dtype=ordered[0].table.dtype)
    for i, t in enumerate(ordered):
        joined[i * width:i * width + t.num_virtual_tokens] = t.table
    return PromptStep(joined, torch.tensor(tasks), width)
