"""``POST /v1/chat/completions``: messages (and tools) rendered by the tokenizer's chat template, then
generated; with tools, each choice's calls read from its text (``kiln.serve.tools``)."""
from __future__ import annotations

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from kiln.errors import KilnError
from kiln.serve.completions import asked_structured_outputs, default_max_tokens, sampling_kwargs, stream_events
from kiln.serve.engine import Event, ServingEngine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.tool_prompts import tool_chat
from kiln.serve.protocol import (ApiError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                 ChatCompletionResponse, ChatLogprobs, ChatMessage, ChatTokenLogprob, DeltaMessage,
                                 TopLogprob, Usage, now, random_id)
from kiln.serve.tools import ToolDeltas, ToolPlan, finish_reason, plan_tools, reply_message
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
    """The messages as OpenAI dicts of text ("developer" is OpenAI's newer "system")."""
    out = []
    for i, m in enumerate(messages):
        if m.role == "function":
            raise ApiError(400, f"messages[{i}]: 'function' messages are OpenAI's deprecated spelling; send the "
                                "result as a 'tool' message with its tool_call_id", "messages")
        if m.role == "tool" and not m.tool_call_id:
            raise ApiError(400, f"messages[{i}].tool_call_id: a tool message names the call it answers",
                           "messages")
        if m.tool_calls and m.role != "assistant":
            raise ApiError(400, f"messages[{i}].tool_calls: only assistant messages call tools", "messages")
        message = {"role": "system" if m.role == "developer" else m.role, "content": _content(m.content)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def chat_ids(engine: ServingEngine, messages: list[ChatMessage], add_generation_prompt: bool = True,
             tools: list[dict] | None = None) -> list[int]:
    """The token ids of ``messages`` (and ``tools``) rendered by the model's chat template (a 400
    naming ``messages`` when it cannot render them)."""
    try:
        rendered, template_tools = tool_chat(_messages(messages), tools, engine.tool_call_parser,
                                             engine.template_reads_tools)
        return chat_prompt_ids(engine.tokenizer, rendered, add_generation_prompt, template_tools)
    except KilnError as e:
        raise ApiError(400, str(e), "messages") from None
    except Exception as e:  # a template that cannot render these messages
        raise ApiError(400, f"the chat template failed: {e}", "messages") from None


async def serve(engine: ServingEngine, body: ChatCompletionRequest, http_request: HttpRequest):
    plan = plan_tools(body, engine.tool_call_parser, engine.processor.check_structured_outputs,
                      bool(asked_structured_outputs(body)))
    kwargs = sampling_kwargs(body, engine)
    kwargs["structured_outputs"] = plan.constraint or kwargs["structured_outputs"]
    ids = chat_ids(engine, body.messages, tools=plan.tools)
    engine.check_prompt(ids, "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(engine, [ids])
    params = engine.sampling_params(max_tokens=max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs
                                    else None, **kwargs)
    if body.stream:
        return await _stream(engine, body, plan, ids, params)
    return await _whole(engine, body, plan, ids, params, http_request)


async def _stream(engine: ServingEngine, body: ChatCompletionRequest, plan: ToolPlan, ids: list[int],
                  params: SamplingParams):
    rid, created = random_id("chatcmpl"), now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    completion_tokens = [0]
    tool_deltas = [ToolDeltas(plan.parser, plan.parallel) if plan.parser else None for _ in range(params.n)]

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict:
        out = ChatCompletionChunk(id=rid, created=created, model=engine.model_name, choices=choices, usage=usage)
        return out.model_dump(exclude=None if include_usage else {"usage"}, exclude_none=False)

    def on_event(event: Event) -> dict:
        completion_tokens[0] += len(event.token_ids)
        logprobs = _logprobs(engine, event.token_ids, event.logprobs, event.top_logprobs, body.top_logprobs or 0) \
            if body.logprobs else None
        deltas, reason = tool_deltas[event.index], event.finish_reason
        if deltas is None:
            delta = DeltaMessage(content=event.text)
        else:
            delta = deltas.delta(event.text, final=reason is not None)
            reason = finish_reason(reason, deltas.has_calls)
        return chunk([ChatChunkChoice(index=event.index, delta=delta, logprobs=logprobs, finish_reason=reason)])

    def tail() -> list[dict]:
        if not include_usage:
            return []
        return [chunk([], Usage(prompt_tokens=len(ids), completion_tokens=completion_tokens[0],
                                total_tokens=len(ids) + completion_tokens[0]))]

    head = [chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                   for i in range(params.n)])]
    return await stream_events(engine.generate([ids], params, model=body.model), on_event, head=head, tail=tail)


async def _whole(engine: ServingEngine, body: ChatCompletionRequest, plan: ToolPlan, ids: list[int],
                 params: SamplingParams, http_request: HttpRequest) -> JSONResponse:
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
    choices = []
    for i in range(n):
        message = reply_message(plan, "".join(texts[i]))
        logprobs = _logprobs(engine, tokens[i], lps[i], tops[i], body.top_logprobs or 0) if body.logprobs else None
        choices.append(ChatChoice(index=i, message=message, logprobs=logprobs,
                                  finish_reason=finish_reason(reasons[i], bool(message.tool_calls))))
    generated = sum(len(t) for t in tokens)
    usage = Usage(prompt_tokens=len(ids), completion_tokens=generated, total_tokens=len(ids) + generated)
    return JSONResponse(ChatCompletionResponse(id=random_id("chatcmpl"), created=now(), model=engine.model_name,
                                               choices=choices, usage=usage).model_dump())
