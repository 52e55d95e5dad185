"""EngineCore: an engine, its KV cache, a scheduler, and the three-call step.

Every front end (GenerationSession, LLM, the in-flight Executor) drives this::

    out = scheduler.schedule(); result = runner.execute(out); scheduler.update(out, result)

A request is a :class:`SequenceGroup`: one sequence, ``best_of`` independent samples, or the
live beams of a beam search, which move in lockstep and are re-formed after every step
from the :class:`~kiln.runtime.beam_search.BeamSearch` decision (children share their
parent's KV blocks; the block a child writes next is copied on write; a hybrid model's child
takes a copy of its parent's recurrent state).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kiln.config.speculative import SpeculativeConfig
from kiln.distributed import world
from kiln.errors import CapacityError, ConfigError, KilnError, RequestError, WorldError
from kiln.runtime.beam_search import BeamHypothesis, BeamSearch, BeamSearchParams
from kiln.runtime.block_pool import BlockPool
from kiln.runtime.draft import DraftProposer
from kiln.runtime.engine import Engine
from kiln.runtime.kv_blocks import KV_CACHE_MEMORY_FRACTION, agreed_num_blocks, common_window, state_slot_counts
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.prompt_tuning import PromptTable, check_prompt_ids, check_table_size
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import RunnerOutput, Scheduler
from kiln.runtime.sequence import FinishReason, Sequence
from kiln.runtime.speculative import SpecDecodeStats, Speculator
from kiln.runtime.state_prefix_cache import StatePrefixCache
from kiln.runtime.state_slots import StateSlots, step_back
from kiln.runtime.worker import CacheSettings, Leader

# Steps in a row whose every request failed with an internal error: past this, the engine
# itself is taken to be broken and ``step`` raises (an engine that fails everything must say
# so, not answer each request with an error forever).
MAX_FAILED_STEPS = 8


@dataclass
class StepStats:
    num_steps: int = 0
    num_tokens: int = 0  # tokens computed (prompt and generated)
    num_generated: int = 0  # tokens sequences gained
    spec: SpecDecodeStats | None = None  # speculative decoding's counters (the scheduler's), when it is on
    seconds: float = 0.0
    last_step_tokens: int = 0
    max_in_flight: int = 0  # the most micro-batches in flight at once (pipeline stages busy together)


@dataclass(eq=False)
class SequenceGroup:
    """One request's sequences: samples, or the live beams of a beam search."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    beam: BeamSearch | None = None
    hypotheses: list[BeamHypothesis] | None = None  # beam search results, once done
    context_logits: list[torch.Tensor] = field(default_factory=list)  # chunks, when asked
    generation_logits: list[list[torch.Tensor]] = field(default_factory=list)  # per step, per live seq

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.hypotheses is not None
        return all(s.is_finished for s in self.seqs)


class EngineCore:
    def __init__(self, engine: Engine, *, max_num_seqs: int | None = None, max_num_tokens: int | None = None,
                 num_blocks: int | None = None, attention_backend: str = "auto",
                 capacity_policy: str = "MAX_UTILIZATION", memory_fraction: float = KV_CACHE_MEMORY_FRACTION,
                 enable_prefix_caching: bool = False,
                 speculative_config: SpeculativeConfig | dict | str | None = None):
        build = engine.build_config
        self.engine = engine
        self.max_num_seqs = min(max_num_seqs or build.max_batch_size, build.max_batch_size)
        self.max_num_tokens = min(max_num_tokens or build.max_num_tokens, build.max_num_tokens)
        block = build.tokens_per_block
        current = world()
        settings = CacheSettings(self.max_num_seqs, memory_fraction, num_blocks, attention_backend)
        leader = None
        if current is not None and current.mapping.world_size > 1:
            if current.mapping.rank != 0:
                raise ConfigError("the engine core runs on rank 0 of a world; other ranks call "
                                  "kiln.runtime.worker.follow(engine)")
            leader = Leader(settings)
        speculative_config = SpeculativeConfig.parse(speculative_config)
        mtp = 0  # guesses a step for the MTP draft to make (method mtp)
        if speculative_config is not None and speculative_config.method == "mtp":
            mtp = speculative_config.num_speculative_tokens
        num_blocks = agreed_num_blocks(engine, num_blocks, self.max_num_seqs, memory_fraction, bool(mtp),
                                       enable_prefix_caching)
        self.runner = ModelRunner(engine, num_blocks, attention_backend, self.max_num_seqs, mtp_tokens=mtp)
        self.runner.leader = leader
        # Micro-batches in flight: one per pipeline stage (see ``step``).
        self.pipeline_depth = engine.config.mapping.pp_size
        if speculative_config is not None and self.pipeline_depth > 1:
            raise ConfigError("speculative_config: speculative decoding runs without pipeline stages (pp_size 1)")
        slots, checkpoints = state_slot_counts(engine, self.max_num_seqs)  # (hybrid models)
        kept_states = range(slots, slots + checkpoints) if slots and enable_prefix_caching else None
        self._in_flight: deque = deque()
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, block, self.max_num_seqs, self.max_num_tokens, capacity_policy,
                                   window=common_window(engine.model), states=StateSlots(slots) if slots else None,
                                   lookahead_tokens=max(mtp - 1, 0),
                                   state_cache=StatePrefixCache(kept_states, block) if kept_states else None)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._requests: dict[int, SequenceGroup] = {}  # seq_id -> request, for live sequences
        self._failures: list[tuple[SequenceGroup, Exception]] = []  # requests that failed alone, not yet taken
        self._failed_steps = 0  # steps in a row that advanced nothing and failed with an internal error
        self.stats = StepStats(spec=self.scheduler.spec_stats if speculative_config is not None else None)
        self.speculator = None  # proposes tokens before each step, when speculative decoding is on
        if speculative_config is not None:
            drafter = self.runner.mtp
            if speculative_config.method == "draft_model":
                drafter = DraftProposer(engine, speculative_config.model, num_blocks * block, self.max_num_seqs,
                                        EngineCore)
            self.speculator = Speculator(speculative_config, drafter)

    def close(self) -> None:
        """Release the other ranks of a world (their ``follow`` returns); a no-op in one process."""
        if self.runner.leader is not None:
            try:
                while self._in_flight:  # the sampling rank answers every step before it stops
                    self._in_flight.popleft()
                    self.runner.collect()
            except WorldError:
                pass
            self.runner.leader.stop()

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, end_id: int | None,
                    return_context_logits: bool = False, return_generation_logits: bool = False,
                    priority: float = 0.5, lora=None, prompt_table=None) -> SequenceGroup:
        """Validate and queue one request (``lora``: the ``kiln.layers.lora.LoraAdapter`` its
        sequences run with, or None; ``prompt_table``: a prompt-tuning embedding table
        ``[n_virtual, hidden]`` whose rows the prompt's ids ``vocab_size + i`` name, or None)."""
        build = self.engine.build_config
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_token_ids) > build.max_input_len:
            raise RequestError(f"prompt has {len(prompt_token_ids)} tokens, more than the engine's "
                               f"max_input_len {build.max_input_len}")
        if len(prompt_token_ids) >= build.max_seq_len:
            raise RequestError(f"prompt has {len(prompt_token_ids)} tokens, leaving no room under max_seq_len "
                               f"{build.max_seq_len}")
        vocab = self.engine.config.vocab_size
        if prompt_table is not None:
            if not isinstance(prompt_table, PromptTable):
                prompt_table = PromptTable.of(prompt_table, self.engine.config.hidden_size,
                                              self.engine.model.transformer.vocab_embedding.weight.dtype)
            check_table_size(prompt_table, build.max_prompt_embedding_table_size)
        check_prompt_ids(prompt_token_ids, vocab, prompt_table)
        if end_id is not None and not 0 <= end_id < vocab:
            raise RequestError(f"end_id {end_id} is outside the vocabulary [0, {vocab})")
        params.validate(vocab_size=vocab, max_beam_width=build.max_beam_width)
        group = params.beam_width if params.use_beam_search else params.num_samples  # generated together
        if group > self.max_num_seqs:
            what = "beam width" if params.use_beam_search else "n (best_of)"
            raise RequestError(f"{what} {group} exceeds the batch limit {self.max_num_seqs}")
        if params.use_beam_search:
            total = min(len(prompt_token_ids) + params.max_tokens, build.max_seq_len)
            if params.beam_width * self.scheduler.blocks_for(total) > self.pool.num_blocks:
                raise CapacityError(f"{params.beam_width} beams of up to {total} tokens need more KV blocks than "
                                    f"the cache's {self.pool.num_blocks}")
        request = SequenceGroup(next(self._request_ids), list(prompt_token_ids), params, [])
        if params.use_beam_search:
            request.beam = BeamSearch(BeamSearchParams(
                beam_width=params.beam_width, length_penalty=params.length_penalty,
                early_stopping=params.early_stopping, num_return_sequences=params.n,
                diversity_rate=params.beam_search_diversity_rate,
                end_ids=tuple([] if end_id is None or params.ignore_eos else [end_id]) + tuple(params.stop_token_ids),
                max_new_tokens=min(params.max_tokens, build.max_seq_len - len(prompt_token_ids))),
                prompt_len=len(prompt_token_ids))
            copies = 1  # one sequence for the prompt; beams branch from it
        else:
            copies = params.num_samples
        for i in range(copies):
            seq_params = params
            if copies > 1 and params.seed is not None:
                seq_params = dataclasses.replace(params, seed=params.seed_for(i))  # distinct, reproducible draws
            seq = Sequence(next(self._seq_ids), list(prompt_token_ids), seq_params, end_id, build.max_seq_len)
            seq.return_context_logits = return_context_logits and i == 0
            seq.return_generation_logits = return_generation_logits
            seq.priority = priority
            seq.lora = lora
            seq.prompt_table = prompt_table
            seq.group = request
            request.seqs.append(seq)
        added = []
        try:
            for seq in request.seqs:
                self.scheduler.add(seq)
                added.append(seq)
        except Exception:
            for seq in added:
                self.scheduler.finish(seq)
            raise
        for seq in request.seqs:
            self._requests[seq.seq_id] = request
        return request

    def abort(self, request: SequenceGroup, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Stop a request now; its unfinished sequences end with ``reason`` (cancelled)."""
        for seq in request.seqs:
            self.finish_sequence(seq, reason)
        if request.beam is not None and request.hypotheses is None:
            request.hypotheses = []

    def take_failures(self) -> list[tuple[SequenceGroup, Exception]]:
        """The requests that failed alone in the steps since the last call, with their errors.
        They are finished (``FinishReason.ERROR``) and hold no KV blocks; the engine goes on."""
        failures, self._failures = self._failures, []
        return failures

    def use_grammar_tokenizer(self, source) -> None:
        """Where structured outputs' grammars get the tokenizer (``RequestProcessor.grammar_tokenizer``,
        called on the first constrained request)."""
        self.runner.grammars.source = source

    def finish_sequence(self, seq: Sequence, reason: FinishReason) -> None:
        """End one sequence now (a stop string found in its text, a cancel) and free its blocks."""
        if not seq.is_finished:
            seq.finish_reason = reason
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id)
        self.scheduler.finish(seq)
        self.runner.release(seq)
        self._requests.pop(seq.seq_id, None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[SequenceGroup]:
        """Run one step; returns the requests that advanced (got tokens or finished).

        With ``pp_size`` pipeline stages, up to ``pp_size`` micro-batches (disjoint sets of
        sequences, each at most its share of the running ones) are in flight: a call schedules
        and starts one when fewer are, and returns at once while the pipeline fills; otherwise
        it takes the oldest one's tokens. So while stage 1 computes micro-batch A, stage 0
        computes B — the schedule of TensorRT-LLM's in-flight batching across pipeline ranks
        (each step of a sequence still waits for its previous token)."""
        started = time.perf_counter()
        if len(self._in_flight) < self.pipeline_depth:
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running)
            out = self.scheduler.schedule(self._micro_batch_seqs())
            if out.chunks:
                self.runner.submit(out)
                self._in_flight.append(out)
                self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._in_flight))
                if len(self._in_flight) < self.pipeline_depth:  # the pipeline is still filling
                    self.stats.seconds += time.perf_counter() - started
                    return []
            elif not self._in_flight:
                raise CapacityError("no sequence could be scheduled: the KV cache is too small for the work queued")
        out = self._in_flight.popleft()
        result = self.runner.collect()
        self._collect_logits(result)
        gained = self.scheduler.num_tokens_gained
        advanced_seqs = self.scheduler.update(out, result)
        gained = self.scheduler.num_tokens_gained - gained
        advanced: dict[int, SequenceGroup] = {}
        for seq in advanced_seqs:
            request = self._requests[seq.seq_id]
            advanced[request.request_id] = request
            if seq.is_finished:
                self._release(seq)
        beam_requests = {r.request_id: r for r in map(self._requests.get, result.beam_logprobs) if r is not None}
        for request in beam_requests.values():
            try:
                if self._advance_beams(request, result):
                    advanced[request.request_id] = request
            except Exception as error:  # noqa: BLE001 - this request fails alone
                result.failed.update({seq.seq_id: error for seq in request.seqs})
        for request in self._fail(result.failed, progressed=bool(advanced)):
            advanced.pop(request.request_id, None)
        s = self.stats
        s.num_steps += 1
        s.num_tokens += out.num_tokens
        s.last_step_tokens = out.num_tokens
        s.num_generated += gained + sum(len(r.seqs) for r in beam_requests.values())
        s.seconds += time.perf_counter() - started
        return list(advanced.values())

    def _fail(self, failed: dict[int, Exception], progressed: bool) -> list[SequenceGroup]:
        """Finish the requests of the sequences that failed this step; returns them. Raises once
        ``MAX_FAILED_STEPS`` steps in a row failed with internal errors and advanced nothing."""
        requests: dict[int, tuple[SequenceGroup, Exception]] = {}
        for seq_id, error in failed.items():
            request = self._requests.get(seq_id)
            if request is not None:
                requests.setdefault(request.request_id, (request, error))
        for request, error in requests.values():
            self.abort(request, FinishReason.ERROR)
            self._failures.append((request, error))
        internal = [e for _, e in requests.values() if not isinstance(e, KilnError)]
        self._failed_steps = self._failed_steps + 1 if internal and not progressed else 0
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise RuntimeError(f"{MAX_FAILED_STEPS} steps in a row failed every request they ran; "
                               f"the last error: {internal[0]!r}") from internal[0]
        return [request for request, _ in requests.values()]

    def _micro_batch_seqs(self) -> int | None:
        """The most sequences one micro-batch takes: an even share of the work, so each stage
        has a batch in every slot (None with one stage: all of them)."""
        if self.pipeline_depth == 1:
            return None
        work = min(self.max_num_seqs, len(self.scheduler.running) + len(self.scheduler.waiting))
        return max(1, math.ceil(work / self.pipeline_depth))

    def _collect_logits(self, result: RunnerOutput) -> None:
        for seq_id, logits in result.context_logits.items():
            request = self._requests.get(seq_id)
            if request is None:  # cancelled while in flight
                continue
            seq = next(s for s in request.seqs if s.seq_id == seq_id)
            if seq.num_computed_tokens == 0:  # its first chunk, or recomputed after a preemption
                request.context_logits = []
            request.context_logits.append(logits)
            if seq.num_computed_tokens + len(logits) >= seq.num_prompt_tokens:
                seq.return_context_logits = False  # all there: a recompute after a preemption adds none
        by_request: dict[int, tuple[SequenceGroup, dict]] = {}
        for seq_id, logits in result.generation_logits.items():
            request = self._requests.get(seq_id)
            if request is None:
                continue
            by_request.setdefault(request.request_id, (request, {}))[1][seq_id] = logits
        for request, by_seq in by_request.values():
            request.generation_logits.append([by_seq.get(s.seq_id) for s in request.seqs])

    def _advance_beams(self, request: SequenceGroup, result: RunnerOutput) -> bool:
        """Apply one beam search step once every live beam has its log-probs."""
        live = request.seqs
        if not all(s.seq_id in result.beam_logprobs for s in live):
            # A beam was preempted or had not caught up: the others recompute their last token later.
            for s in live:
                if s.seq_id in result.beam_logprobs:
                    s.num_computed_tokens -= 1
                    if s.state_slots:
                        step_back(s.state_slots)
            return False
        decision = request.beam.step(torch.stack([result.beam_logprobs[s.seq_id] for s in live]))
        parent_states = [live[p].state_slots[:1] for p in decision.parents]  # (hybrid models) before any change
        parents = [(list(live[p].token_ids), list(live[p].block_ids), live[p].num_computed_tokens,
                    list(live[p].block_hashes)) for p in decision.parents]
        # Children take references to their parents' blocks before the parents let go of theirs.
        child_blocks = [self.pool.fork(blocks) for _, blocks, _, _ in parents]
        for s in live:
            self.pool.free(s.block_ids)
            s.block_ids = []
        while len(live) < len(parents):  # the first step turns the prompt into beam_width beams
            seq = Sequence(next(self._seq_ids), [], request.params, live[0].end_id, live[0].max_seq_len)
            seq.num_prompt_tokens = live[0].num_prompt_tokens
            seq.group = request
            seq.return_generation_logits = live[0].return_generation_logits
            seq.lora = live[0].lora
            seq.prompt_table = live[0].prompt_table
            live.append(seq)
            self._requests[seq.seq_id] = request
            self.scheduler.running.append(seq)
        for seq, (tokens, _, computed, hashes), blocks, token in zip(live, parents, child_blocks, decision.tokens):
            seq.token_ids = tokens + [token]
            seq.block_ids, seq.block_hashes = blocks, hashes
            seq.num_computed_tokens = computed
            self.runner.release(seq)  # its tokens were rewritten: per-sequence state starts again
        for seq, parent_state in zip(live, parent_states):  # each child a copy of its parent's state
            if parent_state:
                seq.state_slots = self.scheduler.states.adopt(seq.state_slots, parent_state[0],
                                                              self.scheduler.state_copies)
        if decision.done:
            request.hypotheses = request.beam.finalize()
            for seq in live:
                seq.finish_reason = FinishReason.LENGTH
                self._release(seq)
        return True
