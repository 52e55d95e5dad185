"""``POST /v1/completions``: prompts (text, token ids, or a batch of either) to completions.

Also holds what the chat endpoint shares: request fields to :class:`SamplingParams`
keywords, and server-sent-event streaming.
"""
from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Callable

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.errors import RequestError
from kiln.runtime.structured_outputs import StructuredOutputsParams
from kiln.serve.engine import Event, ServingEngine
from kiln.serve.protocol import (ApiError, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                 CompletionResponse, SamplingFields, Usage, now, random_id)

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


def structured_outputs(body: SamplingFields, engine: ServingEngine | None) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, by whichever spelling (a 400 naming the field when
    it asks for two, or for one that cannot be built or, with ``engine``, compiled)."""
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


async def serve(engine: ServingEngine, body: CompletionRequest, http_request: HttpRequest):
    if body.echo:
        raise ApiError(400, "echo is not supported", "echo")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of is not supported (only best_of equal to n)", "best_of")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    prompts = [engine.encode(p) for p in _prompts(body)]
    limit = engine.executor.config.max_queue_size
    if len(prompts) * body.n > limit:
        raise ApiError(400, f"prompt: a request may ask for at most {limit} completions (prompts x n), "
                            f"this one asks for {len(prompts) * body.n}", "prompt")
    for ids in prompts:
        engine.check_prompt(ids, "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens(engine, prompts)
    params = engine.sampling_params(max_tokens=max_tokens, logprobs=body.logprobs, **sampling_kwargs(body, engine))
    prompt_tokens = sum(len(p) for p in prompts)
    rid, created = random_id("cmpl"), now()
    want_logprobs = body.logprobs is not None
    n_choices = len(prompts) * params.n
    completion_tokens = [0]
    offsets = [0] * n_choices

    if body.stream:
        events = engine.generate(prompts, params, model=body.model)

        def chunk(event: Event) -> dict:
            completion_tokens[0] += len(event.token_ids)
            logprobs = None
            if want_logprobs:
                logprobs = _logprobs(engine, event.token_ids, event.logprobs, event.top_logprobs,
                                     offsets[event.index])
                offsets[event.index] += len(event.text)
            return CompletionResponse(id=rid, created=created, model=engine.model_name, choices=[CompletionChoice(
                index=event.index, text=event.text, logprobs=logprobs, finish_reason=event.finish_reason)]
            ).model_dump(exclude={"usage"} if not (body.stream_options and body.stream_options.include_usage)
                         else None)

        def tail() -> list[dict]:
            if not (body.stream_options and body.stream_options.include_usage):
                return []
            usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens[0],
                          total_tokens=prompt_tokens + completion_tokens[0])
            return [CompletionResponse(id=rid, created=created, model=engine.model_name, choices=[],
                                       usage=usage).model_dump()]

        return await stream_events(events, chunk, tail=tail)

    texts = [[] for _ in range(n_choices)]
    tokens = [[] for _ in range(n_choices)]
    lps = [[] for _ in range(n_choices)]
    tops = [[] for _ in range(n_choices)]
    reasons: list[str | None] = [None] * n_choices
    async for event in engine.generate(prompts, params, model=body.model, http_request=http_request):
        texts[event.index].append(event.text)
        tokens[event.index] += event.token_ids
        lps[event.index] += event.logprobs
        tops[event.index] += event.top_logprobs
        reasons[event.index] = event.finish_reason or reasons[event.index]
    choices = [CompletionChoice(index=i, text="".join(texts[i]), finish_reason=reasons[i],
                                logprobs=_logprobs(engine, tokens[i], lps[i], tops[i], 0) if want_logprobs else None)
               for i in range(n_choices)]
    generated = sum(len(t) for t in tokens)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)
    return JSONResponse(CompletionResponse(id=rid, created=created, model=engine.model_name, choices=choices,
                                           usage=usage).model_dump())
