"""``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template, then generated."""
from __future__ import annotations

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from kiln.errors import KilnError
from kiln.serve.completions import default_max_tokens, sampling_kwargs, stream_events
from kiln.serve.engine import Event, ServingEngine
from kiln.serve.protocol import (ApiError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                 ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                 ChatTokenLogprob, DeltaMessage, TopLogprob, Usage, now, random_id)
from kiln.tokenizer import chat_prompt_ids


def _content(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:  # [{"type": "text", "text": ...}, ...]
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"only text content parts ({{'type': 'text', 'text': '...'}}) are supported, "
                                f"got {part!r:.100}", "messages")
        parts.append(part["text"])
    return "".join(parts)


def _logprobs(engine: ServingEngine, token_ids: list[int], logprobs: list[float], tops: list[dict],
              k: int) -> ChatLogprobs:
    content = []
    for i, (token, lp) in enumerate(zip(token_ids, logprobs)):
        s = engine.tokenizer.decode([token])
        top = sorted((tops[i] if i < len(tops) else {}).items(), key=lambda kv: -kv[1])[:k]
        content.append(ChatTokenLogprob(
            token=s, logprob=lp, bytes=list(s.encode()),
            top_logprobs=[TopLogprob(token=(t := engine.tokenizer.decode([tid])), logprob=v, bytes=list(t.encode()))
                          for tid, v in top]))
    return ChatLogprobs(content=content)


def _messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them ("developer" is OpenAI's newer "system")."""
    out = []
    for i, m in enumerate(messages):
        if m.role in ("tool", "function"):
            raise ApiError(400, f"messages[{i}]: {m.role!r} messages need tool calling, which kiln does not "
                                "support yet", "messages")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": _content(m.content)})
    return out


def chat_ids(engine: ServingEngine, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of ``messages`` rendered by the model's chat template (a 400 naming
    ``messages`` when it cannot render them)."""
    try:
        return chat_prompt_ids(engine.tokenizer, _messages(messages), add_generation_prompt)
    except KilnError as e:
        raise ApiError(400, str(e), "messages") from None
    except Exception as e:  # a template that cannot render these messages
        raise ApiError(400, f"the chat template failed: {e}", "messages") from None


async def serve(engine: ServingEngine, body: ChatCompletionRequest, http_request: HttpRequest):
    ids = chat_ids(engine, body.messages)
    engine.check_prompt(ids, "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    k = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(engine, [ids])
    params = engine.sampling_params(max_tokens=max_tokens, logprobs=k if body.logprobs else None,
                                    **sampling_kwargs(body, engine))
    rid, created = random_id("chatcmpl"), now()
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    completion_tokens = [0]

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict:
        out = ChatCompletionChunk(id=rid, created=created, model=engine.model_name, choices=choices, usage=usage)
        return out.model_dump(exclude=None if include_usage else {"usage"}, exclude_none=False)

    if body.stream:
        def on_event(event: Event) -> dict:
            completion_tokens[0] += len(event.token_ids)
            logprobs = _logprobs(engine, event.token_ids, event.logprobs, event.top_logprobs, k) \
                if body.logprobs else None
            return chunk([ChatChunkChoice(index=event.index, delta=DeltaMessage(content=event.text),
                                          logprobs=logprobs, finish_reason=event.finish_reason)])

        def tail() -> list[dict]:
            if not include_usage:
                return []
            return [chunk([], Usage(prompt_tokens=len(ids), completion_tokens=completion_tokens[0],
                                    total_tokens=len(ids) + completion_tokens[0]))]

        head = [chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                       for i in range(params.n)])]
        return await stream_events(engine.generate([ids], params, model=body.model), on_event, head=head, tail=tail)

    n = params.n
    texts, tokens = [[] for _ in range(n)], [[] for _ in range(n)]
    lps, tops = [[] for _ in range(n)], [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    async for event in engine.generate([ids], params, model=body.model, http_request=http_request):
        texts[event.index].append(event.text)
        tokens[event.index] += event.token_ids
        lps[event.index] += event.logprobs
        tops[event.index] += event.top_logprobs
        reasons[event.index] = event.finish_reason or reasons[event.index]
    choices = [ChatChoice(index=i, message=AssistantMessage(content="".join(texts[i])), finish_reason=reasons[i],
                          logprobs=_logprobs(engine, tokens[i], lps[i], tops[i], k) if body.logprobs else None)
               for i in range(n)]
    generated = sum(len(t) for t in tokens)
    usage = Usage(prompt_tokens=len(ids), completion_tokens=generated, total_tokens=len(ids) + generated)
    return JSONResponse(ChatCompletionResponse(id=rid, created=created, model=engine.model_name, choices=choices,
                                               usage=usage).model_dump())
