"""Embedding with tensor parallelism (reference 001).

``sharding_dim == 0`` splits the vocabulary: each rank holds ``ceil(vocab / tp_size)`` rows
(the last rank zero-padded), looks up only the ids in its range, zeroes the rest, and the
ranks' results are summed with an all-reduce. ``sharding_dim == 1`` splits the hidden
dimension: each rank looks up every id in its columns and the columns are all-gathered.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln import distributed
from kiln.checkpoint.shard_spec import ShardSpec


class Embedding(nn.Module):
    """Token (or position) embedding table ``[num_embeddings, embedding_dim]``, maybe sharded."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype | None = None,
                 tp_size: int = 1, tp_rank: int = 0, sharding_dim: int = 0):
        super().__init__()
        self.num_embeddings = num_embeddings  # the whole vocabulary, whatever the sharding
        self.embedding_dim = embedding_dim
        self.tp_size, self.tp_rank, self.sharding_dim = tp_size, tp_rank, sharding_dim
        if tp_size > 1 and sharding_dim == 0:
            shape = (math.ceil(num_embeddings / tp_size), embedding_dim)
        elif tp_size > 1 and sharding_dim == 1:
            shape = (num_embeddings, embedding_dim // tp_size)
        else:
            shape = (num_embeddings, embedding_dim)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        if self.sharding_dim == 0:
            rows = self.weight.shape[0]
            local = ids - rows * self.tp_rank
            in_range = (local >= 0) & (local < rows)
            out = F.embedding(torch.where(in_range, local, 0), self.weight)
            out = out * in_range.unsqueeze(-1).to(out.dtype)
            return distributed.all_reduce(out, self.tp_size)
        return distributed.all_gather(F.embedding(ids, self.weight), self.tp_size, dim=-1)

    # -- weight loading -----------------------------------------------------------------

    def load_spec(self, param_name: str, num_external: int) -> list[ShardSpec]:
        # Vocabulary sharding splits rows by ceil(vocab / tp_size), as the loader does, so
        # only the last rank comes up short (and is padded in postprocess).
        dim = None if self.tp_size == 1 else self.sharding_dim
        return [ShardSpec.even(dim, self.tp_size, self.tp_rank)] * num_external

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        tensor = weights[0]
        missing = self.weight.shape[0] - tensor.shape[0]
        if missing > 0 and self.sharding_dim == 0:  # the last vocabulary shard is zero-padded
            tensor = torch.cat([tensor, tensor.new_zeros(missing, tensor.shape[1])])
        return {key: tensor.contiguous()}


class PromptTuningEmbedding(Embedding):
    """The token embedding of reference 001 with prompt tuning: ids at or above ``vocab_size``
    are virtual tokens, looked up in a ``prompt_embedding_table`` given with the call instead
    of the model's table. Several tasks share one call: the table is the tasks' tables
    concatenated, ``task_vocab_size`` rows each, and ``tasks`` (one per token) picks the
    task whose rows a virtual token ``vocab_size + i`` reads (row ``task * task_vocab_size + i``).
    Without a table it is a plain :class:`Embedding`."""

    def forward(self, ids: torch.Tensor, prompt_embedding_table: torch.Tensor | None = None,
                tasks: torch.Tensor | None = None, task_vocab_size: int = 0) -> torch.Tensor:
        if prompt_embedding_table is None:
            return super().forward(ids)
        virtual = ids >= self.num_embeddings
        normal = super().forward(torch.where(virtual, self.num_embeddings - 1, ids))  # clipped into the vocabulary
        rows = torch.where(virtual, ids - self.num_embeddings + tasks * task_vocab_size, 0)
        prompts = F.embedding(rows, prompt_embedding_table.to(normal.dtype))
        return torch.where(virtual.unsqueeze(-1), prompts, normal)


@dataclass
class PromptStep:
    """A step's prompt-tuning inputs: the tasks' tables concatenated (``task_vocab_size`` rows
    each) and each token's task."""

    table: torch.Tensor
    tasks: torch.Tensor
    task_vocab_size: int

