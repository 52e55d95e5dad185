"""ServingEngine: the executor, tokenizer and metrics the endpoints share, and the bridge from
the executor's thread to asyncio (a router thread moves responses to each request's queue).

Every choice of every prompt runs as its own streaming executor request (``n`` samples get
seeds ``seed``, ``seed + 1``... like the LLM API), so a stop string found in one choice
cancels just that request and its KV blocks go back to the pool at once.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import Request as HttpRequest

from kiln.checkpoint.peft import read_adapter
from kiln.errors import ConfigError, KilnError, QueueFullError, RequestError, WorldError
from kiln.runtime.executor import Executor, ExecutorConfig, OutputConfig, Request, Response
from kiln.runtime.lora_cache import LoraConfig
from kiln.runtime.prompt_logprobs import PromptLogprobs, prompt_logprobs
from kiln.runtime.request_processor import RequestProcessor, TextTracker
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.tool_parsers import TOOL_CALL_PARSERS
from kiln.runtime.tool_prompts import template_reads_tools
from kiln.serve.metrics import Metrics, engine_gauges
from kiln.serve.protocol import ApiError

logger = logging.getLogger(__name__)

DISCONNECT_CHECK_S = 0.5  # how often a waiting request checks whether its client hung up


@dataclass
class Event:
    """New output of one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # of token_ids
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # on a choice's first event, when asked for


@dataclass(eq=False)
class _Choice:
    index: int
    request_id: int
    tracker: TextTracker
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    first_at: float | None = None
    last_at: float | None = None
    waits: bool = False  # for its prompt's log-probs: its events are held until they come
    scored: PromptLogprobs | None = None  # its prompt's log-probs, until sent with its first event
    held: list[Event] = field(default_factory=list)


def request_error_param(message: str, default: str | None = None) -> str | None:
    """The field a kiln RequestError names (its messages start with it)."""
    m = re.match(r"([a-z_]+)( token ids)? must", message)
    return m.group(1) if m else default


class ServingEngine:
    """The executor, tokenizer and metrics the endpoints share."""

    def __init__(self, engine_dir: str | Path, tokenizer_dir: str | Path | None = None,
                 executor_config: ExecutorConfig | None = None, served_model_name: str | None = None,
                 on_world_error: Callable[[BaseException], None] | None = None,
                 request_timeout: float | None = None, tool_call_parser: str = "hermes"):
        if tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool_call_parser: one of {', '.join(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}")
        # How the served model writes tool calls (its chat template's format, or kiln's generic one).
        self.tool_call_parser = TOOL_CALL_PARSERS[tool_call_parser]()
        self.executor = Executor(engine_dir, executor_config)
        # Seconds a request may take from arrival to its last token; then it ends ("abort").
        self.request_timeout = request_timeout
        self.draining = False  # set by drain(): new requests get 503, those in flight finish
        # Called once when another rank of the engine's world died: the executor cannot run
        # again, so the CLI's server exits instead of answering errors forever.
        self.on_world_error = on_world_error
        try:
            engine = self.executor.engine
            self.processor = RequestProcessor.load(tokenizer_dir or engine.tokenizer_dir, engine_dir,
                                                   engine.config.vocab_size)
            self.executor.core.use_grammar_tokenizer(self.processor.grammar_tokenizer)
        except BaseException:
            self.executor.shutdown()
            raise
        self.tokenizer = self.processor.tokenizer
        self.template_reads_tools = template_reads_tools(self.tokenizer)
        self.build = engine.build_config
        self.vocab_size = engine.config.vocab_size
        self.model_name = served_model_name or Path(engine_dir).name
        self.lora_task_ids: dict[str, int] = {}  # served adapter name -> its LoRA task id
        self.metrics = Metrics()
        self._last_stats = None  # the executor's latest iteration stats, for /metrics
        self._queues: dict[int, asyncio.Queue] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._router: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop serving the app (once started)."""
        return self._loop

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._router = threading.Thread(target=self._route, name="kiln-serve-router", daemon=True)
        self._router.start()

    def shutdown(self) -> None:
        self._stopping.set()
        if self._router is not None:
            self._router.join()
        self.executor.shutdown()

    def _route(self) -> None:
        """Move executor responses to the asyncio queue of whoever waits for them."""
        while not self._stopping.is_set():
            try:
                responses = self.executor.await_responses(None, timeout=0.1)
            except KilnError as e:  # the executor stopped: fail everyone waiting
                with self._lock:
                    waiting = list(self._queues.items())
                for rid, queue in waiting:
                    self._loop.call_soon_threadsafe(queue.put_nowait,
                                                    Response(rid, error_msg=str(e), internal_error=True))
                if isinstance(self.executor.failure, WorldError) and self.on_world_error is not None:
                    on_world_error, self.on_world_error = self.on_world_error, None
                    on_world_error(self.executor.failure)
                self._stopping.wait(0.1)
                continue
            for response in responses:
                with self._lock:
                    queue = self._queues.get(response.request_id)
                if queue is not None:
                    self._loop.call_soon_threadsafe(queue.put_nowait, response)

    # -- requests -------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        return list(prompt)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        if len(ids) > self.build.max_input_len or len(ids) >= self.build.max_seq_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens, more than this model's limit "
                                f"(max_input_len {self.build.max_input_len}, max_seq_len {self.build.max_seq_len})",
                           param, code="context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                           param)

    def sampling_params(self, **kwargs) -> SamplingParams:
        """SamplingParams from request fields, validated against the engine; errors become 400s."""
        try:
            params = SamplingParams(**kwargs)
            params.validate(vocab_size=self.vocab_size)
        except RequestError as e:
            raise ApiError(400, str(e), request_error_param(str(e))) from None
        if params.n > self.executor.core.max_num_seqs:  # more choices than run at once would only queue
            raise ApiError(400, f"n must be at most {self.executor.core.max_num_seqs} (the most sequences this "
                                f"server generates at once), got {params.n}", "n")
        return params

    # -- health and shutdown ----------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine (it cannot serve again), or None while it can."""
        return self.executor.failure

    async def drain(self, timeout: float) -> None:
        """Stop taking requests (they get 503), let those in flight finish for up to ``timeout``
        seconds, then cancel what still runs (finish reason "abort") and wait for it to end."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.metrics.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.metrics.in_flight:
            with self._lock:
                running = list(self._queues)
            logger.warning("cancelling %d requests still running after %.0f s of draining", len(running), timeout)
            for rid in running:
                self.executor.cancel_request(rid)
            deadline = loop.time() + 10
            while self.metrics.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)

    def load_lora(self, name: str, path: str | Path) -> None:
        """Serve the LoRA adapter in ``path`` (a PEFT adapter or a ``kiln lora convert``
        directory) as model ``name``; errors are 400s naming what is wrong."""
        if not name or name == self.model_name or name in self.lora_task_ids:
            raise ApiError(400, f"the model name {name!r} is already served (or empty)", "lora_name")
        try:
            weights, config = read_adapter(path)
            task_id = len(self.lora_task_ids) + 1
            self.executor.register_lora(task_id, weights, config)
        except KilnError as e:
            raise ApiError(400, str(e), "lora_path") from None
        self.lora_task_ids[name] = task_id

    async def generate(self, prompts: list[list[int]], params: SamplingParams, *, model: str | None = None,
                       http_request: HttpRequest | None = None) -> AsyncIterator[Event]:
        """Run ``params.n`` choices per prompt (index ``prompt * n + i``); yield their new output.

        Stop strings are matched on the detokenized text; the executor request of a choice that
        hit one is cancelled. ``http_request``: poll it and stop if the client went away (the
        streaming path is cancelled by the server instead). Leaving early cancels what still runs.

        With ``params.prompt_logprobs`` (top-k), the first event of every choice carries its
        prompt's :class:`PromptLogprobs`: the first choice of each prompt returns the context
        logits (vocabulary-wide rows per prompt token, so only one choice per prompt, dropped
        once scored), and a sibling's events wait until they are scored.
        """
        requests = self._requests(prompts, params, model)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            try:
                rids = self.executor.enqueue_requests(requests)
            except QueueFullError as e:  # worth trying again shortly
                raise ApiError(503, str(e), None, "overloaded_error", headers={"Retry-After": "1"}) from None
            except KilnError as e:  # the executor stopped
                raise ApiError(503, str(e), None, "server_error") from None
            for rid in rids:
                self._queues[rid] = queue
        started = time.perf_counter()
        for ids in prompts:
            self.metrics.add_prompt_tokens(len(ids) * params.n)
        choices = [_Choice(index, rid, self.processor.text_tracker(params), waits=params.prompt_logprobs is not None)
                   for index, rid in enumerate(rids)]
        by_rid = {c.request_id: c for c in choices}
        self.metrics.in_flight += 1
        try:
            remaining = len(choices)
            next_check = time.monotonic() + DISCONNECT_CHECK_S
            while remaining:
                try:
                    response = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_CHECK_S)
                except asyncio.TimeoutError:
                    response = None
                # Checked on a clock, not only when idle: a non-streaming answer keeps the
                # queue busy and would otherwise be generated to the end for nobody.
                if http_request is not None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + DISCONNECT_CHECK_S
                    if await http_request.is_disconnected():
                        return
                if response is None:
                    continue
                choice = by_rid[response.request_id]
                if choice.finished:
                    continue
                if response.has_error():
                    if response.internal_error:
                        raise ApiError(500, response.error_msg, None, "server_error")
                    raise ApiError(400, response.error_msg, request_error_param(response.error_msg))
                event = self._advance(choice, response.result, started)
                if choice.finished:
                    remaining -= 1
                for ready in self._release(choice, event, response.result, prompts, params, choices):
                    yield ready
        finally:
            self.metrics.in_flight -= 1
            for choice in choices:
                if not choice.finished:
                    self.executor.cancel_request(choice.request_id)
            with self._lock:
                for rid in rids:
                    self._queues.pop(rid, None)

    def _requests(self, prompts: list[list[int]], params: SamplingParams, model: str | None) -> list[Request]:
        """The executor requests of every choice of every prompt (the first choice of a prompt
        returns its context logits when prompt log-probs are asked for)."""
        want_logprobs = params.logprobs is not None
        timeout_ms = None if self.request_timeout is None else max(1, round(self.request_timeout * 1000))
        lora_task = self.lora_task_ids.get(model)
        lora = LoraConfig(lora_task) if lora_task is not None else None
        return [Request(input_token_ids=ids, max_tokens=params.max_tokens, streaming=True,
                        sampling_config=self.processor.engine_params(params, sample=i), end_id=self.processor.end_id,
                        output_config=OutputConfig(return_log_probs=want_logprobs, return_context_logits=(
                            params.prompt_logprobs is not None and i == 0)),
                        lora_config=lora, allotted_time_ms=timeout_ms)
                for ids in prompts for i in range(params.n)]

    @staticmethod
    def _release(choice: _Choice, event: Event, result, prompts: list[list[int]], params: SamplingParams,
                 choices: list[_Choice]) -> list[Event]:
        """The events ready to send after ``event``: those of a choice whose prompt is scored
        (its first carrying the prompt log-probs), or, once the scoring choice's context logits
        (or its end) arrive, every held event of its prompt."""
        if event.text or event.token_ids or event.finish_reason:
            choice.held.append(event)
        n, p = params.n, choice.index // params.n
        siblings = choices[p * n:(p + 1) * n]
        if choice.index % n == 0 and choice.waits and (result.context_logits is not None or result.is_final):
            scored = prompt_logprobs(result.context_logits, prompts[p], params.prompt_logprobs)
            result.context_logits = None  # vocabulary-wide: not kept past scoring
            for sibling in siblings:
                sibling.scored, sibling.waits = scored, False
        ready = []
        for c in siblings if choice.index % n == 0 else [choice]:
            if c.waits or not c.held:
                continue
            if c.scored is not None:
                c.held[0].prompt_logprobs, c.scored = c.scored, None
            ready += c.held
            c.held = []
        return ready

    def _advance(self, choice: _Choice, result, started: float) -> Event:
        new = list(result.output_token_ids[0])
        start = len(choice.tokens)
        choice.tokens += new
        now = time.perf_counter()
        if new:
            ttft = None if choice.first_at is not None else now - started
            itl = None if choice.last_at is None else now - choice.last_at
            choice.first_at = choice.first_at or now
            choice.last_at = now
            self.metrics.add_generated(len(new), ttft, itl)
        tracker = choice.tracker
        reason = None
        if new or result.is_final:
            if tracker.update(choice.tokens, final=result.is_final):
                reason = "stop"
                self.executor.cancel_request(choice.request_id)
        if reason is None and result.is_final:
            reason = self.processor.finish_name(result.finish_reasons[0]) or "stop"
        if reason is not None:
            choice.finished = True
            self.metrics.finished(reason)
            text = tracker.text[tracker.emitted:]  # nothing held back any more
            tracker.emitted = len(tracker.text)
        else:
            text = tracker.delta()
        event = Event(choice.index, text, new, finish_reason=reason)
        if result.log_probs is not None:
            event.logprobs = list(result.log_probs[0][start:len(choice.tokens)])
            top = result.top_log_probs
            if top is not None:
                event.top_logprobs = list(top[0][start:len(choice.tokens)])
        return event

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The gauges /metrics reads at scrape time (the executor's latest iteration stats)."""
        stats = self.executor.get_latest_iteration_stats()
        if stats:
            self._last_stats = stats[-1]
        core = self.executor.core
        return engine_gauges(self._last_stats, core.pool, idle=self.metrics.in_flight == 0,
                             states=core.scheduler.states, slot_bytes=core.runner.state_slot_bytes,
                             state_cache=core.scheduler.state_cache)
