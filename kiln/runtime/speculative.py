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


def pace_proposals(seq: Sequence, proposed: int, kept: int) -> None:
    """After a step verified ``proposed`` tokens of ``seq`` and kept ``kept``: how many to propose
    next (``spec_limit``), and whether to pause proposing (``spec_pause``)."""
    # Propose a little more than was kept: a rejected token's row costs the step compute for
    # nothing, but rows are nearly free while a step is bound by reading the weights; when
    # all were kept, four more (bundled model, bf16, k 10: 2.05x plain against 1.89x with
    # "kept + 1 / all + 2" on input-grounded prompts; docs/benchmark-log.md).
    seq.spec_limit = proposed + 4 if kept == proposed else kept + 2
    # A draft model's proposals that keep missing (it does not know this text) cost k draft
    # steps each time: decode plainly for 2, 4, ... up to 32 steps, then try again. (n-gram
    # proposals cost nothing to make and ignore the pause: pausing them lost more than it saved.)
    seq.spec_misses = seq.spec_misses + 1 if kept == 0 else 0
    seq.spec_pause = min(2 ** seq.spec_misses, 32) if kept == 0 else 0


def ready_to_propose(seq: Sequence, k: int) -> bool:
    """Whether ``seq`` is decoding, so a step may verify proposals after its tokens: one token
    behind. A hybrid model's sequence may be a few generated tokens behind instead: a step that
    rejected some proposals keeps the state from before it (a state cannot drop tokens), and the
    tokens it did keep run again in front of the next step's proposals (nearly free while a step
    reads the weights once). Past ``k + 1`` behind (a second rejection in a row) it catches up
    plainly, so recomputation stays bounded."""
    behind = seq.num_tokens - seq.num_computed_tokens
    return behind == 1 or (bool(seq.state_slots) and behind <= min(k + 1, seq.num_output_tokens))


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


# The most tokens a step verifying proposals computes: below it a CPU step costs about one read
# of the weights whatever its tokens, past it speculation would cost more than it saves.
SPECULATIVE_TOKEN_BUDGET = 64


def speculation_pays(num_seqs: int, k: int) -> bool:
    """Whether ``num_seqs`` sequences verifying ``k`` proposals each (``k + 1`` tokens) stay
    within ``SPECULATIVE_TOKEN_BUDGET``: a step bound by reading the weights, not by compute."""
    return num_seqs * (k + 1) <= SPECULATIVE_TOKEN_BUDGET


class Speculator:
    """Proposes tokens for the decoding sequences of the next step: n-gram lookup, or ``drafter``
    (``kiln.runtime.draft.DraftProposer``) for a draft model."""

    def __init__(self, config: SpeculativeConfig, drafter=None):
        self.config = config
        self.drafter = drafter

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's ``spec_tokens``: for one that decodes and may speculate,
        up to ``num_speculative_tokens`` and a little more than it kept last time (``spec_limit``).
        Verifying ``k`` proposals computes ``k + 1`` tokens: while the batch is small a decode step
        reads the weights for little compute, nearly free; past ``SPECULATIVE_TOKEN_BUDGET`` tokens
        a step is compute-bound, and speculation switches off."""
        k = self.config.num_speculative_tokens
        enabled = speculation_pays(len(running), k)
        wanted = []
        for seq in running:
            seq.spec_tokens = []
            ready = ready_to_propose(seq, k)
            if self.drafter is not None and seq.spec_pause and ready:
                seq.spec_pause -= 1  # the draft's proposals kept missing, at k draft steps each: pause
                continue
            if enabled and can_speculate(seq) and ready:
                room = seq.max_total_tokens - seq.num_tokens - 1  # the step adds up to k + 1 tokens
                if seq.spec_limit is not None:
                    room = min(room, seq.spec_limit)
                if self.drafter is None:
                    seq.spec_tokens = propose_ngram(seq.token_ids, self.config, room)
                else:
                    wanted.append((seq, min(room, k)))
        if self.drafter is not None:
            self.drafter.propose(wanted)

    def forget(self, seq_id: int) -> None:
        """A sequence ended: drop what was kept for it (its draft mirror)."""
        if self.drafter is not None:
            self.drafter.forget(seq_id)
