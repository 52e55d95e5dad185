"""Tool calling on the chat endpoint: what a request's ``tools`` and ``tool_choice`` ask for, and
the calls read back from each choice's text (whole, or as deltas while it streams). With
``parallel_tool_calls: false`` a reply has at most one call: a forced one is held to one, and of
what a model writes on its own ("auto") the first is kept.

``tool_choice`` "auto" (the default with tools) lets the model answer or call; "required" and a
named function hold the output to calls of those tools with a grammar (structured outputs), so
the calls always parse and their arguments follow the tools' schemas; "none" renders no tools.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import RequestError
from kiln.runtime.structured_outputs import StructuredOutputsParams
from kiln.runtime.tool_parsers import ToolCall, ToolCallParser, ToolCallStream
from kiln.serve.protocol import (ApiError, AssistantMessage, ChatCompletionRequest, DeltaFunctionCall, DeltaMessage,
                                 DeltaToolCall, FunctionCall, NamedToolChoice, ToolCallBody)


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools."""

    tools: list[dict] | None = None  # the definitions the chat template renders
    parser: ToolCallParser | None = None  # reads calls from the output (None: it is all content)
    constraint: StructuredOutputsParams | None = None  # holds the output to calls ("required", named)
    parallel: bool = True  # more than one call per reply (parallel_tool_calls)


def plan_tools(body: ChatCompletionRequest, parser: ToolCallParser, check, asks_structured_output: bool) -> ToolPlan:
    """The plan of ``body``'s tool fields (400s name the field). ``check(params)`` compiles a
    constraint for the model's tokenizer (raising RequestError); ``asks_structured_output``: the
    request holds its output to a format already, which a forced call cannot share."""
    choice = body.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return ToolPlan()
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"tools: function names must differ, got {names}", "tools")
    if choice == "none":
        return ToolPlan()
    parallel = body.parallel_tool_calls is not False
    if choice in (None, "auto"):
        return ToolPlan(tools, parser, parallel=parallel)
    forced = tools
    if isinstance(choice, NamedToolChoice):
        forced = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not forced:
            raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among tools {names}",
                           "tool_choice")
    if asks_structured_output:
        raise ApiError(400, "a forced tool call (tool_choice required or a named function) cannot also follow "
                            "response_format or another structured output", "tool_choice")
    try:
        constraint = parser.constraint(forced, parallel=parallel)
        check(constraint)
    except RequestError as e:
        raise ApiError(400, f"tools: the tools' parameters cannot be held to ({e})", "tools") from None
    return ToolPlan(tools, parser, constraint, parallel)


def _body(call: ToolCall) -> ToolCallBody:
    return ToolCallBody(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself after calling tools."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def reply_message(plan: ToolPlan, text: str) -> AssistantMessage:
    """The assistant message of a finished choice: its content and the calls in it."""
    if plan.parser is None:
        return AssistantMessage(content=text)
    content, calls = plan.parser.parse(text)
    return AssistantMessage(content=content, tool_calls=[_body(c) for c in calls[:None if plan.parallel else 1]])


class ToolDeltas:
    """One streamed choice's deltas: content as it is known not to be a call, each call whole
    once it is complete (its name and all its arguments in one delta); without ``parallel``, the
    first call only."""

    def __init__(self, parser: ToolCallParser, parallel: bool = True):
        self.text = ""
        self.stream = ToolCallStream(parser)
        self.parallel = parallel

    @property
    def has_calls(self) -> bool:
        return bool(self.stream.calls_sent)

    def delta(self, text: str, final: bool) -> DeltaMessage:
        self.text += text
        content, calls = self.stream.feed(self.text, final)
        first = len(self.stream.calls_sent) - len(calls)
        if not self.parallel:
            calls = calls[:max(0, 1 - first)]
        deltas = [DeltaToolCall(index=first + k, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                  for k, c in enumerate(calls)]
        return DeltaMessage(content=content if content or not deltas else None, tool_calls=deltas or None)
