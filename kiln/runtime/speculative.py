"""Speculative decoding's proposers (the settings: ``kiln.config.speculative``).

A proposer guesses the next few tokens of a sequence cheaply; the target model then computes
them all in one step (a short chunk per sequence, like a prompt chunk) and keeps the longest
prefix its own sampling agrees with, plus one token of its own (``kiln.runtime.verification``).
So a step that reads the weights once yields up to ``num_speculative_tokens + 1`` tokens.

The n-gram proposer ("prompt lookup") finds the last ``n`` tokens earlier in the sequence
(prompt and output), ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, and
proposes what followed that occurrence: free, and right whenever the output copies its input
(summaries, edits, code, quotes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.config.speculative import SpeculativeConfig
from kiln.runtime.sequence import Sequence


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters since start: verifying steps of a sequence (drafts),
    tokens proposed, and of them kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, proposed: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += kept

    @property
    def acceptance_rate(self) -> float:
        """Kept proposals over proposals (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step gives a sequence on average: its kept proposals and its own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def can_speculate(seq: Sequence) -> bool:
    """Whether ``seq`` may decode speculatively: not a beam (beams are re-formed every step), not
    returning every step's raw logits, not decaying top-p token by token (reference 003's rule,
    which verification does not replay)."""
    p = seq.params
    return not p.use_beam_search and not seq.return_generation_logits and p.top_p_decay == 1


def propose_ngram(token_ids: list[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to ``min(num_speculative_tokens, limit)`` tokens following the latest earlier
    occurrence of the sequence's last n tokens (the longest n that occurs); [] if none does."""
    k = min(config.num_speculative_tokens, limit)
    if k <= 0 or len(token_ids) < config.prompt_lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    size = len(tokens)
    for n in range(min(config.prompt_lookup_max, size - 1), config.prompt_lookup_min - 1, -1):
        suffix = tokens[size - n:]
        # Starts of earlier occurrences: the suffix itself (at size - n) is not one.
        starts = np.flatnonzero(tokens[:size - n] == suffix[0])
        for start in starts[::-1]:
            if np.array_equal(tokens[start:start + n], suffix):
                follow = tokens[start + n:start + n + k]
                if len(follow):
                    return follow.tolist()
    return []
