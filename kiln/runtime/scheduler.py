"""Scheduler: which sequences get how many tokens in the next step (pure Python).

There is no prefill phase and no decode phase. Every step each running sequence is given
tokens to catch up with its ``num_tokens`` -- a whole prompt, a prompt chunk, or the one
token it generated last step -- under a token budget (``max_num_tokens``). Two small
policies decide:

* capacity: a sequence runs only with KV blocks for every token it will hold after the
  step. ``MAX_UTILIZATION`` admits greedily and, when blocks run out, preempts the most
  recently admitted sequence (its blocks freed, recomputed later from its tokens);
  ``GUARANTEED_NO_EVICT`` admits a sequence only when the blocks every running sequence may
  still need up to its ``max_tokens`` fit, so nothing is ever preempted;
* batch composition: running sequences first, in admission order, then waiting ones
  (highest priority first, then arrival order) while the token budget and ``max_num_seqs``
  allow; long prompts are chunked.

A hybrid model's sequence also owns two recurrent-state slots (``kiln.runtime.state_slots``),
taken and given back with its blocks; with prefix caching, states saved at block boundaries
(``kiln.runtime.state_prefix_cache``) let it start after a cached prefix.

With a sliding window (every layer attending to its last ``window`` positions only), a
block every position of which fell out of the window goes back to the pool after the step
(its table entry becomes ``RELEASED``), so a sequence holds about ``window + step`` tokens of
KV cache however long it grows.

The step is ``out = scheduler.schedule(); res = runner.execute(out); scheduler.update(out, res)``.
Between ``schedule`` and ``update`` a step's sequences are *in flight*: a pipeline-parallel
engine schedules the next micro-batch before the last one's tokens are back, from the other
sequences only (and never preempts one in flight).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.errors import CapacityError, ConfigError
from kiln.runtime.block_pool import RELEASED, BlockPool
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative import SpecDecodeStats, pace_proposals
from kiln.runtime.state_prefix_cache import StatePrefixCache
from kiln.runtime.state_slots import StateSlots, commit


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens of seq computed this step, from seq.num_computed_tokens on

    @property
    def completes(self) -> bool:
        """Whether the sequence is caught up after this step, its proposed tokens included (so it
        samples a token, or verifies the proposals)."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens + len(self.seq.spec_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy before the step
    new_blocks: list[int] = field(default_factory=list)  # freshly allocated: cleared before the step
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots: copy before

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(slots=True)
class TokenResult:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class RunnerOutput:
    """What a step produced, keyed by seq_id."""

    tokens: dict[int, TokenResult] = field(default_factory=dict)  # sampled sequences that caught up
    verified: dict[int, list[TokenResult]] = field(default_factory=dict)  # proposals kept, then the target's token
    beam_logprobs: dict = field(default_factory=dict)  # beam sequences: processed log-probs [vocab]
    context_logits: dict = field(default_factory=dict)  # [prompt tokens this step, vocab], when asked
    generation_logits: dict = field(default_factory=dict)  # [vocab] raw logits, when asked
    failed: dict = field(default_factory=dict)  # sequences whose step raised: seq_id -> the exception

    def merge(self, other: RunnerOutput) -> None:
        """Take in ``other``'s results (a part of the same step, run on its own)."""
        for name in ("tokens", "verified", "beam_logprobs", "context_logits", "generation_logits", "failed"):
            getattr(self, name).update(getattr(other, name))


CAPACITY_POLICIES = ("MAX_UTILIZATION", "GUARANTEED_NO_EVICT")


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_tokens: int,
                 capacity_policy: str = "MAX_UTILIZATION", window: int | None = None,
                 states: StateSlots | None = None, lookahead_tokens: int = 0,
                 state_cache: StatePrefixCache | None = None):
        if capacity_policy not in CAPACITY_POLICIES:
            raise ConfigError(f"capacity_policy {capacity_policy!r} is not one of {CAPACITY_POLICIES}")
        self.capacity_policy = capacity_policy
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.window = window  # every layer's sliding window, when all have one: blocks behind it are released
        if states is not None and pool.enable_caching and state_cache is None:
            raise ConfigError("prefix caching with recurrent-state slots needs a StatePrefixCache")
        self.states = states  # a hybrid model's recurrent-state slots (None: no recurrent layers)
        self.state_cache = state_cache  # their states at cached prefixes (with prefix caching only)
        self.lookahead_tokens = lookahead_tokens  # slots past a step's tokens it may write (an MTP's guesses)
        self.state_copies: list[tuple[int, int]] = []  # queued for the next step (beams taking their parents')
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.spec_stats = SpecDecodeStats()  # speculative decoding's counters
        self.num_tokens_gained = 0  # tokens sampled sequences gained (several a step when proposals are kept)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, seq: Sequence) -> int:
        """The most blocks ``seq`` holds at once: all its tokens', or with a sliding window,
        those of a window and one step (plus the block the window starts inside)."""
        blocks = self.blocks_for(seq.max_total_tokens + self.lookahead_tokens)
        if self.window is None:
            return blocks
        return min(blocks, self.blocks_for(self.window + self.max_num_tokens) + 1)

    def add(self, seq: Sequence) -> None:
        needed = self.peak_blocks(seq)
        if needed > self.pool.num_blocks:
            raise CapacityError(
                f"request {seq.seq_id} may need {seq.max_total_tokens} tokens ({needed} KV blocks) but the "
                f"KV cache holds {self.pool.num_blocks} blocks of {self.block_size} tokens")
        # Behind every waiting sequence of equal or higher priority (FCFS within a priority).
        at = len(self.waiting)
        while at > 0 and self.waiting[at - 1].priority < seq.priority:
            at -= 1
        self.waiting.insert(at, seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """The next step: at most ``max_seqs`` sequences (a pipeline's micro-batch), none of
        them in flight."""
        out = SchedulerOutput(state_copies=self.state_copies)
        self.state_copies = []
        budget = self.max_num_tokens
        max_seqs = max_seqs or self.max_num_seqs
        groups: set[int] = set()  # the groups (a request's sequences) in this step
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._held_back(seq, len(out.chunks) >= max_seqs, groups):
                i += 1
                continue
            if seq.group is not None:
                groups.add(id(seq.group))
            n = self._chunk_size(seq, budget)
            if not self._reserve(seq, n + self.lookahead_tokens, out):
                # Free room by preempting from the back (not from a step in flight); maybe this very sequence.
                victim = next(s for s in reversed(self.running) if not s.in_flight)
                self.running.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
                continue
            self._add_chunk(out, seq, n)
            budget -= n
            i += 1
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted
               and len(out.chunks) < max_seqs):
            seq = self.waiting[0]
            if self.capacity_policy == "GUARANTEED_NO_EVICT" and not self._fits_to_the_end(seq):
                break
            self._take_cached_prefix(seq)
            n = self._capped(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if not self._reserve(seq, n + self.lookahead_tokens, out):
                self._release_blocks(seq)
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._add_chunk(out, seq, n)
            budget -= n
        if not out.chunks:  # no step runs: the state copies wait for one that does
            self.state_copies, out.state_copies = out.state_copies, []
        if self.state_cache is not None:
            self.state_cache.scheduled(bool(out.chunks))
        return out

    def _capped(self, seq: Sequence, n: int) -> int:
        return n if self.state_cache is None else self.state_cache.cap_chunk(seq, n)

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """A running sequence's tokens this step: what it has to catch up with, and its proposed
        tokens as far as the token budget and the free blocks allow (the rest are dropped)."""
        behind = seq.num_tokens - seq.num_computed_tokens
        if seq.spec_tokens:
            room = self.pool.num_free * self.block_size + len(seq.block_ids) * self.block_size - seq.num_tokens
            del seq.spec_tokens[max(0, min(budget - behind, room)):]
        return self._capped(seq, min(behind + len(seq.spec_tokens), budget))

    @staticmethod
    def _held_back(seq: Sequence, full: bool, groups: set[int]) -> bool:
        """Whether a running ``seq`` sits this step out: it is in flight, or the micro-batch is
        ``full``. A request's sequences go together (a beam search steps all its beams at
        once): one joins its group in this step even when full, and waits while a member of
        its group is in flight."""
        if seq.in_flight:  # in an earlier micro-batch (this step's chunks are marked too)
            return True
        group = seq.group
        if group is None:
            return full
        if id(group) in groups:
            return False
        return full or any(s.in_flight for s in getattr(group, "seqs", ()))

    @staticmethod
    def _add_chunk(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.chunks.append(ScheduledChunk(seq, n))
        seq.in_flight = True

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Start a fresh sequence from the cached blocks of its longest known prefix.

        At least one token is always left to compute, so the step yields its logits. A sequence
        that returns context logits computes its whole prompt: cached blocks have no logits.
        """
        if seq.block_ids or seq.num_computed_tokens or seq.return_context_logits:
            return
        blocks, hashes = self.pool.take_cached_prefix(seq.token_ids, self.block_size,
                                                      (seq.num_tokens - 1) // self.block_size, seq.cache_salt)
        if self.state_cache is not None:  # only as far as a recurrent state was kept
            blocks, hashes = self.state_cache.take_prefix(seq, blocks, hashes, self.pool)
        seq.block_ids, seq.block_hashes = blocks, hashes
        seq.num_computed_tokens = len(blocks) * self.block_size

    def _release_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids, seq.block_hashes = [], []
        seq.num_computed_tokens = 0
        self._release_state(seq)

    def _release_state(self, seq: Sequence) -> None:
        if seq.state_slots:
            self.states.free(seq.state_slots)
            seq.state_slots = []

    def _release_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks no later query of ``seq`` reads: the next token (position
        ``num_computed_tokens``) reads from ``num_computed_tokens - window + 1`` on; one more
        position is kept for a beam that recomputes its last token."""
        ids = seq.block_ids
        stop = min(max(seq.num_computed_tokens - self.window, 0) // self.block_size, len(ids))
        start = min(seq.num_released_blocks, stop)
        if start > 0 and ids[start - 1] != RELEASED:  # a stale hint (tables are copied between beams)
            start = 0
        for j in range(start, stop):
            if ids[j] != RELEASED:
                self.pool.free([ids[j]])
                ids[j] = RELEASED
        seq.num_released_blocks = max(stop, start)

    def _fits_to_the_end(self, seq: Sequence) -> bool:
        """Whether ``seq`` and every running sequence can all reach their maximum length."""
        def still_needed(s: Sequence) -> int:
            return self.peak_blocks(s) - sum(b != RELEASED for b in s.block_ids)

        return sum(still_needed(s) for s in self.running) + still_needed(seq) <= self.pool.num_free

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Make sure ``seq`` owns writable blocks for ``n`` more tokens; False if the pool lacks them.

        The block the step writes into first may be shared with another sequence (beams
        forked from one parent): it is copied first (copy-on-write). A hybrid model's sequence
        takes its state slots with its first blocks.
        """
        first = seq.num_computed_tokens // self.block_size
        shared = first < len(seq.block_ids) and self.pool.ref_count(seq.block_ids[first]) > 1
        missing = self.blocks_for(seq.num_computed_tokens + n) - len(seq.block_ids)
        if max(missing, 0) + shared > self.pool.num_free:
            return False
        if self.states is not None and not seq.state_slots:
            if self.states.num_free_pairs == 0:
                return False
            seq.state_slots = self.states.allocate()
            if self.state_cache is not None:
                self.state_cache.restore(seq, out.state_copies)
        if shared:
            new = self.pool.allocate(1)[0]
            out.block_copies.append((seq.block_ids[first], new))
            self.pool.free([seq.block_ids[first]])
            seq.block_ids[first] = new
        if missing > 0:
            blocks = self.pool.allocate(missing)
            seq.block_ids.extend(blocks)
            out.new_blocks.extend(blocks)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.spec_tokens = []
        self._release_blocks(seq)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Sequence]:
        """Advance sequences by the step's results; returns the sequences that got a token.

        Beam sequences get their tokens from their beam group afterwards (see EngineCore).
        A sequence whose step failed (``result.failed``) does not advance; one whose own
        update raises is added to ``result.failed`` and the others go on.
        """
        advanced = []
        for chunk in out.chunks:
            seq = chunk.seq
            seq.in_flight = False
            # Cancelled while its step was in flight (its blocks are gone), or its step failed.
            if seq.is_finished or seq.seq_id in result.failed:
                continue
            try:
                if self._advance(seq, chunk, result):
                    advanced.append(seq)
            except Exception as error:  # noqa: BLE001 - this sequence's request fails alone
                result.failed[seq.seq_id] = error
        return advanced

    def _advance(self, seq: Sequence, chunk: ScheduledChunk, result: RunnerOutput) -> bool:
        """Apply one sequence's step; whether it got a token."""
        if seq.spec_tokens:
            return self._advance_verified(seq, chunk, result.verified.get(seq.seq_id))
        completes = chunk.completes
        seq.num_computed_tokens += chunk.num_tokens
        if seq.state_slots:
            commit(seq.state_slots)
        self._after_compute(seq)
        if not (completes and seq.seq_id in result.tokens):
            return False
        r = result.tokens[seq.seq_id]
        seq.append_token(r.token, r.logprob, r.top_logprobs)
        self.num_tokens_gained += 1
        if seq.is_finished:
            self.finish(seq)
        return True

    def _advance_verified(self, seq: Sequence, chunk: ScheduledChunk, verified: list[TokenResult] | None) -> bool:
        """Apply a step that verified proposed tokens: the K/V of the proposals kept stay, those
        of the rest are dropped (their slots are written again later; blocks past the sequence's
        tokens go back to the pool). A recurrent state cannot drop tokens: unless every proposal
        was kept, the state before the step stays and the kept tokens run again next step."""
        proposals, seq.spec_tokens = seq.spec_tokens, []
        if not verified:
            raise RuntimeError(f"sequence {seq.seq_id}: its proposed tokens were not verified")
        kept = next((i for i, (r, p) in enumerate(zip(verified, proposals)) if r.token != p),
                    min(len(verified), len(proposals)))
        pace_proposals(seq, len(proposals), kept)
        self.spec_stats.record(len(proposals), kept)
        before = seq.num_tokens
        computed = seq.num_computed_tokens + chunk.num_tokens - len(proposals) + kept
        if seq.state_slots and kept == len(proposals):
            commit(seq.state_slots)
        elif seq.state_slots:
            computed = seq.num_computed_tokens
        for r in verified:
            seq.append_token(r.token, r.logprob, r.top_logprobs)
            if seq.is_finished:
                break
        self.num_tokens_gained += seq.num_tokens - before
        seq.num_computed_tokens = min(computed, seq.num_tokens - 1)
        keep = self.blocks_for(seq.num_tokens)
        if len(seq.block_ids) > keep:
            self.pool.free([b for b in seq.block_ids[keep:] if b != RELEASED])
            del seq.block_ids[keep:]
        self._after_compute(seq)
        if seq.is_finished:
            self.finish(seq)
        return True

    def _after_compute(self, seq: Sequence) -> None:
        """Bookkeeping once a step's K/V are in: full blocks findable, blocks behind the window freed."""
        if self.pool.enable_caching:  # before any release: released blocks stay findable
            self.pool.register_full_blocks(seq, self.block_size)
            if seq.state_slots:
                self.state_cache.after_compute(seq, self.state_copies)
        if self.window is not None:
            self._release_out_of_window(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or cancelled) sequence's blocks and drop it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_ids:
            self.pool.free(seq.block_ids)
            seq.block_ids, seq.block_hashes = [], []
        self._release_state(seq)
