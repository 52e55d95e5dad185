"""Executor: in-flight batching for requests that arrive at any time (reference 003/004).

A background thread owns the :class:`EngineCore` and loops: take newly enqueued requests
(a bad one gets an error response, nobody else notices), run one step, and turn what
advanced into :class:`Response` objects that callers collect with ``await_responses`` or,
in asyncio code, ``generate_async``. Streaming requests get a response per step with the
new tokens; others get one final response.

    executor = Executor(engine_dir, ExecutorConfig(max_batch_size=32))
    rid = executor.enqueue_request(Request(input_token_ids=[1, 2, 3], max_tokens=16))
    (response,) = executor.await_responses(rid)
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import torch

from kiln import kernels
from kiln.errors import ConfigError, KilnError, QueueFullError, RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_core import SequenceGroup
from kiln.runtime.executor_types import (SERVING_MAX_NUM_TOKENS, ExecutorConfig, IterationStats, KvCacheConfig,
                                         OutputConfig, Request, Response, Result, error_response)
from kiln.runtime.lora_cache import LoraCache, LoraConfig
from kiln.runtime.prompt_tuning import PromptTuningConfig
from kiln.runtime.sequence import FinishReason

__all__ = ["Executor", "ExecutorConfig", "IterationStats", "KvCacheConfig", "OutputConfig", "Request", "Response",
           "Result"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Tracked:
    """Executor-side state of one request."""

    request_id: int
    request: Request
    core: SequenceGroup | None = None
    deadline: float | None = None
    sent: dict[int, int] = field(default_factory=dict)  # seq_id -> output tokens already streamed
    lora_task: int | None = None  # the task id whose LoRA device slot it holds
    lora_loaded: bool = False  # its LoRA weights are in the cache (loaded at its first admission try)


class Executor:
    def __init__(self, engine: Engine | str | Path, config: ExecutorConfig | None = None):
        self.config = config or ExecutorConfig()
        self.engine = engine if isinstance(engine, Engine) else Engine(engine)
        kv = self.config.kv_cache_config
        num_blocks = None
        if kv.max_tokens is not None:
            num_blocks = max(1, kv.max_tokens // self.engine.build_config.tokens_per_block)
        elif not 0 < kv.free_memory_fraction <= 1:
            raise ConfigError(f"kv_cache_config.free_memory_fraction must be in (0, 1], got {kv.free_memory_fraction}")
        self.core = EngineCore(self.engine, max_num_seqs=self.config.max_batch_size,
                               max_num_tokens=self.config.max_num_tokens or SERVING_MAX_NUM_TOKENS,
                               num_blocks=num_blocks,
                               capacity_policy=self.config.capacity_policy,
                               attention_backend=self.config.attention_backend,
                               memory_fraction=kv.free_memory_fraction, enable_prefix_caching=kv.enable_block_reuse,
                               speculative_config=self.config.speculative_config)
        self.lora_cache = LoraCache(self.engine.config, self.config.lora_cache_config, self.engine.lora_config)
        self._waiting_for_lora: collections.deque[_Tracked] = collections.deque()
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._incoming: collections.deque[_Tracked] = collections.deque()
        self._cancelled: set[int] = set()
        self._live: dict[int, _Tracked] = {}
        self._responses: dict[int, list[Response]] = collections.defaultdict(list)
        self._stats: collections.deque[IterationStats] = collections.deque(maxlen=self.config.iteration_stats_max)
        self._iteration = 0
        self._shutdown = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kiln-executor", daemon=True)
        kernels.release_thread_pool()  # the model now runs on the executor's thread only
        self._thread.start()

    # -- the public API ---------------------------------------------------------------------

    def enqueue_request(self, request: Request) -> int:
        """Queue a request; returns its id. Validation errors come back as an error response."""
        return self.enqueue_requests([request])[0]

    def enqueue_requests(self, requests: list[Request]) -> list[int]:
        with self._lock:
            self._check_running()
            if len(self._incoming) + len(self.core.scheduler.waiting) + len(requests) > self.config.max_queue_size:
                raise QueueFullError(f"the executor queue is full ({self.config.max_queue_size} requests waiting)")
            ids = []
            for request in requests:
                tracked = _Tracked(next(self._ids), request)
                if request.allotted_time_ms is not None:
                    tracked.deadline = time.monotonic() + request.allotted_time_ms / 1000
                self._incoming.append(tracked)
                ids.append(tracked.request_id)
            self._lock.notify_all()
        return ids

    def await_responses(self, request_ids: int | list[int] | None = None, timeout: float | None = None
                        ) -> list[Response]:
        """Responses ready for ``request_ids`` (one id, several, or ``None`` for any).

        Waits up to ``timeout`` seconds (``None``: until at least one response is ready) and
        returns what is ready, oldest first; an empty list on timeout.
        """
        wanted = None if request_ids is None else ({request_ids} if isinstance(request_ids, int) else set(request_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                ready = [rid for rid in self._responses if wanted is None or rid in wanted]
                if ready:
                    out = []
                    for rid in ready:
                        out.extend(self._responses.pop(rid))
                    return out
                if self._error is not None or self._shutdown:
                    self._check_running()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                self._lock.wait(remaining)

    def register_lora(self, task_id: int, weights, config) -> None:
        """Register a LoRA adapter for good (``LoraCache.register``): requests may name it by
        ``LoraConfig(task_id)`` alone, and it is reloaded whenever the cache evicted it."""
        self.lora_cache.register(task_id, weights, config)

    def cancel_request(self, request_id: int) -> None:
        """Stop a request; it gets a final response with finish reason "cancelled"."""
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify_all()

    def get_latest_iteration_stats(self) -> list[IterationStats]:
        """Stats of the iterations since the last call (oldest first)."""
        with self._lock:
            stats = list(self._stats)
            self._stats.clear()
            return stats

    def shutdown(self) -> None:
        """Stop the loop; requests still in flight get a final "cancelled" response; the other
        ranks of a world are released."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            self._lock.notify_all()
        self._thread.join()
        self.core.close()

    async def generate_async(self, request: Request) -> AsyncIterator[Response]:
        """Enqueue ``request`` and yield its responses as they come (asyncio)."""
        request_id = self.enqueue_request(request)
        loop = asyncio.get_running_loop()
        try:
            while True:
                responses = await loop.run_in_executor(None, self.await_responses, request_id, 0.5)
                for response in responses:
                    yield response
                    if response.has_error() or response.result.is_final:
                        return
        finally:
            self.cancel_request(request_id)  # a no-op once final; frees blocks if the caller left early

    # -- the loop ---------------------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """What stopped the executor's loop (a ``kiln.errors.WorldError`` when another rank of its
        world died), or None while it runs."""
        return self._error

    def _check_running(self) -> None:
        if self._error is not None:
            raise KilnError(f"the executor stopped after an internal error: {self._error!r}")
        if self._shutdown:
            raise KilnError("the executor has been shut down")

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._incoming or self._cancelled or self._live or self._waiting_for_lora
                               or self._shutdown):
                        self._lock.wait()
                    if self._shutdown:
                        break
                    incoming, self._incoming = list(self._incoming), collections.deque()
                    cancelled, self._cancelled = self._cancelled, set()
                waiting, self._waiting_for_lora = list(self._waiting_for_lora), collections.deque()
                for tracked in waiting + incoming:  # those waiting for a LoRA slot first, in order
                    self._admit(tracked)
                self._cancel(cancelled)
                self._expire()
                if self.core.has_unfinished:
                    self._step()
                else:  # nothing left to compute: whatever is still tracked is done
                    for tracked in list(self._live.values()):
                        del self._live[tracked.request_id]
                        self._respond(tracked, final=True)
        except BaseException as e:  # an engine bug: fail every request loudly instead of hanging
            logger.exception("executor loop failed")
            with self._lock:
                self._error = e
                for tracked in list(self._live.values()):
                    self._responses[tracked.request_id].append(Response(tracked.request_id, error_msg=repr(e),
                                                                        internal_error=True))
                self._live.clear()
                self._lock.notify_all()
            return
        with self._lock:  # enqueued but not yet admitted: in flight too, so they get their final response
            incoming, self._incoming = list(self._incoming), collections.deque()
        for tracked in incoming:
            self._admit(tracked)
        while self._waiting_for_lora:  # never started: cancelled, with nothing generated
            self._cancel_waiting(self._waiting_for_lora.popleft())
        for tracked in list(self._live.values()):
            self.core.abort(tracked.core)
            self._respond(tracked, final=True)
        with self._lock:
            self._lock.notify_all()

    def _admit(self, tracked: _Tracked) -> None:
        r = tracked.request
        try:
            params = r.engine_params()
            adapter = self._lora_adapter(tracked)
            if adapter is False:  # every LoRA device slot is held: wait for one
                self._waiting_for_lora.append(tracked)
                return
            tracked.core = self.core.add_request(
                list(r.input_token_ids), params, r.end_id, return_context_logits=r.output_config.return_context_logits,
                return_generation_logits=r.output_config.return_generation_logits, priority=r.priority, lora=adapter,
                prompt_table=self._prompt_table(r))
        except Exception as e:  # noqa: BLE001 - this request fails alone
            if not isinstance(e, KilnError):
                logger.exception("admitting request %d failed", tracked.request_id)
            self._release_lora(tracked)
            self._post(error_response(tracked.request_id, e))
            return
        self._live[tracked.request_id] = tracked

    @staticmethod
    def _prompt_table(r: Request):
        config = r.prompt_tuning_config
        if config is None:
            return None
        if not isinstance(config, PromptTuningConfig):
            raise RequestError(f"prompt_tuning_config must be a PromptTuningConfig, got {type(config).__name__}")
        return config.embedding_table

    def _lora_adapter(self, tracked: _Tracked):
        """The request's adapter, holding a device slot for it; None without one, False when
        no slot is free. Weights sent with the task id are loaded into the cache first."""
        lora = tracked.request.lora_config
        if lora is None:
            return None
        if not isinstance(lora, LoraConfig):
            raise RequestError(f"lora_config must be a LoraConfig, got {type(lora).__name__}")
        if (lora.weights is None) != (lora.config is None):
            raise RequestError(f"lora_config (task_id {lora.task_id}): weights and config come together "
                               "(or neither, for a task id already loaded)")
        if lora.weights is not None and not tracked.lora_loaded:
            self.lora_cache.put(lora.task_id, lora.weights, lora.config)
            tracked.lora_loaded = True  # a wait and retry must not load it again
        adapter = self.lora_cache.acquire(lora.task_id)
        if adapter is None:
            return False
        tracked.lora_task = lora.task_id
        return adapter

    def _cancel_waiting(self, tracked: _Tracked) -> None:
        """Final response of a request that never left the wait for a LoRA slot."""
        r = tracked.request
        tokens = [] if r.output_config.exclude_input_from_output or r.streaming else list(r.input_token_ids)
        self._post(Response(tracked.request_id, Result([tokens], True, ["cancelled"])))

    def _release_lora(self, tracked: _Tracked) -> None:
        if tracked.lora_task is not None:
            self.lora_cache.release(tracked.lora_task)
            tracked.lora_task = None

    def _cancel(self, request_ids: set[int]) -> None:
        for tracked in [t for t in self._waiting_for_lora if t.request_id in request_ids]:
            self._waiting_for_lora.remove(tracked)
            self._cancel_waiting(tracked)
        for rid in request_ids:
            tracked = self._live.pop(rid, None)
            if tracked is not None:
                self.core.abort(tracked.core)
                self._respond(tracked, final=True)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, tracked in list(self._live.items()):
            if tracked.deadline is not None and now >= tracked.deadline:
                for seq in tracked.core.seqs:
                    self.core.finish_sequence(seq, FinishReason.TIMEOUT)
                if tracked.core.beam is not None and tracked.core.hypotheses is None:
                    tracked.core.hypotheses = []
                del self._live[rid]
                self._respond(tracked, final=True)

    def _step(self) -> None:
        started = time.perf_counter()
        advanced = self.core.step()
        by_core = {id(t.core): t for t in self._live.values()}
        for core_request, error in self.core.take_failures():  # finished in the core, blocks freed
            tracked = by_core.get(id(core_request))
            if tracked is not None:
                del self._live[tracked.request_id]
                self._release_lora(tracked)
                self._post(error_response(tracked.request_id, error))
        for core_request in advanced:
            tracked = by_core.get(id(core_request))
            if tracked is None:
                continue
            final = core_request.is_finished
            if final:
                del self._live[tracked.request_id]
            if final or tracked.request.streaming:
                self._respond(tracked, final)
        self._iteration += 1
        stats = IterationStats.of(self.core, self._iteration, 1000 * (time.perf_counter() - started),
                                  len(self._live), self.lora_cache.stats(), len(self._waiting_for_lora))
        with self._lock:
            self._stats.append(stats)

    def _respond(self, tracked: _Tracked, final: bool) -> None:
        """Post the request's new output (its final one when ``final``); a request whose output
        cannot be built gets an error instead, and is stopped."""
        if final:
            self._release_lora(tracked)
        try:
            response = Response(tracked.request_id, self._result(tracked, final))
        except Exception as e:  # noqa: BLE001 - this request fails alone
            logger.exception("building the output of request %d failed", tracked.request_id)
            if not final:
                self._live.pop(tracked.request_id, None)
                self._release_lora(tracked)
                self.core.abort(tracked.core, FinishReason.ERROR)
            response = error_response(tracked.request_id, e)
        self._post(response)

    def _result(self, tracked: _Tracked, final: bool) -> Result:
        core, r = tracked.core, tracked.request
        prompt = [] if r.output_config.exclude_input_from_output else list(r.input_token_ids)
        if core.beam is not None and core.hypotheses is not None:
            beams = [(h.token_ids, h.log_probs, "end_id" if h.token_ids and h.token_ids[-1] in core.beam.params.end_ids
                      else "length") for h in core.hypotheses]
            if not core.hypotheses:  # cancelled or timed out before any hypothesis
                beams = [(s.output_token_ids, [], s.finish_reason.value if s.finish_reason else None) for s in core.seqs]
        else:
            beams = [(s.output_token_ids, s.logprobs, s.finish_reason.value if s.finish_reason else None)
                     for s in core.seqs]
        if r.streaming and core.beam is None:
            tokens = []
            for seq, (out, _, _) in zip(core.seqs, beams):
                tokens.append(out[tracked.sent.get(seq.seq_id, 0):])
                tracked.sent[seq.seq_id] = len(out)
        else:
            tokens = [prompt + list(out) for out, _, _ in beams]
        result = Result(tokens, final, [reason if final else None for _, _, reason in beams])
        if r.output_config.return_log_probs:
            result.log_probs = [list(lp) for _, lp, _ in beams]
            result.cum_log_probs = [float(sum(lp)) for _, lp, _ in beams]
        if core.beam is None and (core.params.logprobs or 0) > 0:
            result.top_log_probs = [list(s.top_logprobs) for s in core.seqs]
        if r.output_config.return_context_logits and core.context_logits and (final or r.streaming and sum(
                len(rows) for rows in core.context_logits) >= len(core.prompt_token_ids)):
            result.context_logits = torch.cat(core.context_logits)
            if r.streaming:  # sent once, as soon as the prompt is computed; vocab-wide rows: freed now
                core.context_logits = []
        if final and r.output_config.return_generation_logits:
            result.generation_logits = core.generation_logits
        return result

    def _post(self, response: Response) -> None:
        with self._lock:
            self._responses[response.request_id].append(response)
            self._lock.notify_all()
