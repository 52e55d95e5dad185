"""Sequence: the plain state of one request as it is generated (no tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from kiln.runtime.sampling import SamplingParams


class FinishReason(str, Enum):
    END_ID = "end_id"
    STOP_WORDS = "stop_words"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt and what has been generated for it.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; each step gives the
    sequence tokens to catch up with ``num_tokens``. When it has caught up, the step's
    logits at its last token yield the next token.
    """

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    end_id: int | None
    max_seq_len: int
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.generator = self.params.make_generator()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_total_tokens(self) -> int:
        """The longest this sequence can become."""
        return min(self.num_prompt_tokens + self.params.max_tokens, self.max_seq_len)

    def append_token(self, token: int) -> None:
        """Add a generated token and decide whether the sequence is done."""
        self.token_ids.append(token)
        p = self.params
        if token == self.end_id and not p.ignore_eos:
            self.finish_reason = FinishReason.END_ID
        elif token in p.stop_token_ids:
            self.finish_reason = FinishReason.STOP_WORDS
        elif self.num_output_tokens >= p.max_tokens or self.num_tokens >= self.max_seq_len:
            self.finish_reason = FinishReason.LENGTH
