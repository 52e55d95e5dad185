"""``POST /v1/completions``: prompts (text, token ids, or a batch of either) to completions.

Also holds what the chat endpoint shares: request fields to :class:`SamplingParams`
keywords, and server-sent-event streaming.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.errors import RequestError
from kiln.runtime.prompt_logprobs import PromptLogprobs, top_of
from kiln.runtime.structured_outputs import StructuredOutputsParams
from kiln.serve.engine import Event, ServingEngine
from kiln.serve.protocol import (ApiError, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                 CompletionResponse, PromptLogprob, SamplingFields, Usage, now, random_id)

logger = logging.getLogger(__name__)


def sampling_kwargs(body: SamplingFields, engine: ServingEngine | None = None) -> dict:
    """The SamplingParams keywords of the fields both endpoints share (OpenAI defaults); with
    ``engine``, a structured-output constraint is also compiled for its tokenizer."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return dict(n=body.n, stop=stop, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, logit_bias=bias,
                top_k=body.top_k, min_tokens=body.min_tokens, repetition_penalty=body.repetition_penalty,
                ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
                structured_outputs=structured_outputs(body, engine))


def asked_structured_outputs(body: SamplingFields) -> dict[str, dict]:
    """The request's structured-output fields: field name -> StructuredOutputsParams keywords."""
    asked: dict[str, dict] = {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema", "response_format")
        asked["response_format"] = {"json": fmt.json_schema.schema_}
    if body.structured_outputs is not None:
        so = body.structured_outputs
        asked["structured_outputs"] = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object),
                                                         ("regex", so.regex), ("choice", so.choice),
                                                         ("grammar", so.grammar)) if v is not None}
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            asked[name] = {key: getattr(body, name)}
    return asked


def structured_outputs(body: SamplingFields, engine: ServingEngine | None) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, by whichever spelling (a 400 naming the field when
    it asks for two, or for one that cannot be built or, with ``engine``, compiled)."""
    asked = asked_structured_outputs(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(400, f"ask for one structured output, got {' and '.join(asked)}", list(asked)[1])
    (field, constraint), = asked.items()
    try:
        params = StructuredOutputsParams(**constraint)
        if engine is not None:
            engine.processor.check_structured_outputs(params)
    except RequestError as e:
        raise ApiError(400, f"{field}: {e}", field) from None
    return params


def default_max_tokens(engine: ServingEngine, prompts: list[list[int]]) -> int:
    return max(1, engine.build.max_seq_len - max(len(p) for p in prompts))


def sse(payload) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream_events(events: AsyncIterator[Event], chunk: Callable[[Event], dict], *,
                        head: list[dict] = (), tail: Callable[[], list[dict]] = lambda: []) -> StreamingResponse:
    """An SSE response of ``chunk(event)`` per event, after ``head`` and before ``tail()`` and ``[DONE]``.

    Waits for the first event before answering, so that errors found when the request is
    admitted (queue full, a bad request) still get their HTTP status. The generator's cleanup
    (a client that disconnects cancels the response task) cancels the executor requests.
    """
    first = await events.__anext__()

    async def body():
        try:
            for payload in head:
                yield sse(payload)
            yield sse(chunk(first))
            async for event in events:
                yield sse(chunk(event))
            for payload in tail():
                yield sse(payload)
        except ApiError as e:
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 - a bug while streaming: this stream ends with the error
            logger.error("streaming a response failed", exc_info=e)
            yield sse(ApiError.internal(e).body())
        finally:
            await events.aclose()
        yield sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _prompts(body: CompletionRequest) -> list:
    p = body.prompt
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
        return [p]
    if not p:
        raise ApiError(400, "prompt must not be empty", "prompt")
    return list(p)


def _token_str(engine: ServingEngine, token: int) -> str:
    return engine.tokenizer.decode([token])


def _logprobs(engine: ServingEngine, token_ids: list[int], logprobs: list[float], tops: list[dict],
              offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for i, (token, lp) in enumerate(zip(token_ids, logprobs)):
        s = _token_str(engine, token)
        top = tops[i] if i < len(tops) else {}
        out.tokens.append(s)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({**{_token_str(engine, t): v for t, v in top.items()}, s: lp})
        out.text_offset.append(offset)
        offset += len(s)
    return out


def _echo_logprobs(engine: ServingEngine, ids: list[int], scored: PromptLogprobs, k: int) -> CompletionLogprobs:
    """The prompt tokens' part of an echoing choice's ``logprobs``: the first token's log-prob
    and top entry are None (nothing comes before it)."""
    out = CompletionLogprobs()
    offset = 0
    for token, entry in zip(ids, scored.entries):
        s = _token_str(engine, token)
        out.tokens.append(s)
        out.token_logprobs.append(None if entry is None else entry[token])
        out.top_logprobs.append(None if entry is None else
                                {_token_str(engine, t): v for t, v in top_of(entry, token, k).items()})
        out.text_offset.append(offset)
        offset += len(s)
    return out


def _vllm_prompt_logprobs(engine: ServingEngine, ids: list[int], scored: PromptLogprobs,
                          k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token, the token and the top ``k``."""
    out: list[dict[str, PromptLogprob] | None] = []
    for token, entry, rank in zip(ids, scored.entries, scored.ranks):
        if entry is None:
            out.append(None)
            continue
        item = {str(token): PromptLogprob(logprob=entry[token], rank=rank, decoded_token=_token_str(engine, token))}
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        for r, (t, lp) in enumerate(top, start=1):
            item.setdefault(str(t), PromptLogprob(logprob=lp, rank=r, decoded_token=_token_str(engine, t)))
        out.append(item)
    return out


@dataclass
class _Answer:
    """How a request's choices are written: what of the prompt each starts with, and what of
    what the engine generated is kept."""

    engine: ServingEngine
    body: CompletionRequest
    prompts: list  # as sent: text, or token ids
    ids: list[list[int]]
    score_only: bool  # echo with max_tokens 0: the token sampled to end the prefill is dropped

    def prompt_of(self, index: int) -> int:
        return index // self.body.n

    def head(self, index: int, scored: PromptLogprobs | None) -> tuple[str, CompletionLogprobs | None, list | None]:
        """A choice's first text, prompt log-probs and vLLM prompt_logprobs (echo, prompt_logprobs)."""
        body, p = self.body, self.prompt_of(index)
        text, logprobs, vllm = "", None, None
        if body.echo:
            prompt = self.prompts[p]
            text = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(self.ids[p])
            if body.logprobs is not None:
                logprobs = _echo_logprobs(self.engine, self.ids[p], scored, body.logprobs)
        if body.prompt_logprobs is not None:
            vllm = _vllm_prompt_logprobs(self.engine, self.ids[p], scored, body.prompt_logprobs)
        return text, logprobs, vllm

    def kept(self, event: Event) -> Event:
        """``event`` as answered: with max_tokens 0, nothing generated and finish reason "length"."""
        if not self.score_only:
            return event
        return Event(event.index, "", [], finish_reason=event.finish_reason and "length",
                     prompt_logprobs=event.prompt_logprobs)


def _join(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + second.text_offset)


def _prompt_logprobs_k(body: CompletionRequest) -> int | None:
    """The top-k the engine computes for the prompt tokens: the most of what echo with logprobs
    and prompt_logprobs ask (None: neither, no context logits)."""
    asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


def _check_request(engine: ServingEngine, body: CompletionRequest, prompts: list[list[int]]) -> None:
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of is not supported (only best_of equal to n)", "best_of")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if body.max_tokens == 0 and not body.echo:  # as vLLM: nothing to answer
        raise ApiError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt), got 0", "max_tokens")
    if body.max_tokens == 0 and body.min_tokens:
        raise ApiError(400, f"min_tokens must be at most max_tokens 0, got {body.min_tokens}", "min_tokens")
    limit = engine.executor.config.max_queue_size
    if len(prompts) * body.n > limit:
        raise ApiError(400, f"prompt: a request may ask for at most {limit} completions (prompts x n), "
                            f"this one asks for {len(prompts) * body.n}", "prompt")
    for ids in prompts:
        engine.check_prompt(ids, "prompt")


async def serve(engine: ServingEngine, body: CompletionRequest, http_request: HttpRequest):
    sent = _prompts(body)
    prompts = [engine.encode(p) for p in sent]
    _check_request(engine, body, prompts)
    score_only = body.echo and body.max_tokens == 0
    # max_tokens 0 (with echo) scores the prompt: the engine samples at least one token, and the
    # prefill that gives the prompt's log-probs is the whole cost, so one is sampled and dropped.
    max_tokens = 1 if score_only else body.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(engine, prompts)
    params = engine.sampling_params(max_tokens=max_tokens, logprobs=body.logprobs,
                                    prompt_logprobs=_prompt_logprobs_k(body), **sampling_kwargs(body, engine))
    answer = _Answer(engine, body, sent, prompts, score_only)
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        return await _stream(answer, params, prompt_tokens)
    return await _whole(answer, params, prompt_tokens, http_request)


async def _stream(answer: _Answer, params, prompt_tokens: int) -> StreamingResponse:
    """Each choice's prompt part (echo, prompt log-probs) comes in its first chunk."""
    engine, body = answer.engine, answer.body
    rid, created = random_id("cmpl"), now()
    want_logprobs = body.logprobs is not None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n_choices = len(answer.ids) * params.n
    completion_tokens = [0]
    offsets = [0] * n_choices
    started = [False] * n_choices
    events = engine.generate(answer.ids, params, model=body.model)

    def chunk(event: Event) -> dict:
        event = answer.kept(event)
        completion_tokens[0] += len(event.token_ids)
        text, logprobs, vllm = "", None, None
        if not started[event.index]:
            started[event.index] = True
            text, logprobs, vllm = answer.head(event.index, event.prompt_logprobs)
            offsets[event.index] = len(text)
        if want_logprobs:
            logprobs = _join(logprobs, _logprobs(engine, event.token_ids, event.logprobs, event.top_logprobs,
                                                 offsets[event.index]))
            offsets[event.index] += len(event.text)
        return CompletionResponse(id=rid, created=created, model=engine.model_name, choices=[CompletionChoice(
            index=event.index, text=text + event.text, logprobs=logprobs, finish_reason=event.finish_reason,
            prompt_logprobs=vllm)]).model_dump(exclude=None if include_usage else {"usage"})

    def tail() -> list[dict]:
        if not include_usage:
            return []
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens[0],
                      total_tokens=prompt_tokens + completion_tokens[0])
        return [CompletionResponse(id=rid, created=created, model=engine.model_name, choices=[],
                                   usage=usage).model_dump()]

    return await stream_events(events, chunk, tail=tail)


async def _whole(answer: _Answer, params, prompt_tokens: int, http_request: HttpRequest) -> JSONResponse:
    engine, body = answer.engine, answer.body
    n_choices = len(answer.ids) * params.n
    texts = [[] for _ in range(n_choices)]
    tokens = [[] for _ in range(n_choices)]
    lps = [[] for _ in range(n_choices)]
    tops = [[] for _ in range(n_choices)]
    scored: list[PromptLogprobs | None] = [None] * n_choices
    reasons: list[str | None] = [None] * n_choices
    async for event in engine.generate(answer.ids, params, model=body.model, http_request=http_request):
        event = answer.kept(event)
        texts[event.index].append(event.text)
        tokens[event.index] += event.token_ids
        lps[event.index] += event.logprobs
        tops[event.index] += event.top_logprobs
        scored[event.index] = event.prompt_logprobs or scored[event.index]
        reasons[event.index] = event.finish_reason or reasons[event.index]
    choices = []
    for i in range(n_choices):
        head, logprobs, vllm = answer.head(i, scored[i])
        if body.logprobs is not None:
            logprobs = _join(logprobs, _logprobs(engine, tokens[i], lps[i], tops[i], len(head)))
        choices.append(CompletionChoice(index=i, text=head + "".join(texts[i]), finish_reason=reasons[i],
                                        logprobs=logprobs, prompt_logprobs=vllm))
    generated = sum(len(t) for t in tokens)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)
    return JSONResponse(CompletionResponse(id=random_id("cmpl"), created=now(), model=engine.model_name,
                                           choices=choices, usage=usage).model_dump())
