"""Tool calls in a model's output: how each model family writes them, how to read them back
(whole, or while the text streams) and a grammar that admits only calls of the given tools.

A parser knows one format. ``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (Hermes, Qwen and kiln's generic tool prompt for templates without tools); ``llama3_json``
reads the bare ``{"name": ..., "parameters": {...}}`` objects Llama 3.1+'s template asks for,
several joined by ``"; "``. More formats register in ``TOOL_CALL_PARSERS``.

Text that does not hold a well-formed call stays content: a model answering in prose, or
writing half a call before it ran out of tokens, is never turned into a broken call.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kiln.runtime.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Scan:
    """What a text holds so far: ``content`` safe to show (a prefix the stream may extend) and
    the complete ``calls`` found in it."""

    content: str
    calls: list[tuple[str, str]]


def _call(obj, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            if isinstance(arguments, str):  # some models write the arguments as JSON text
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
            return (obj["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None
    return obj["name"], "{}"


def _schema(tool: dict, arguments_key: str) -> dict:
    """The JSON Schema of one call object of ``tool`` (an OpenAI tool definition)."""
    function = tool["function"]
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             arguments_key: function.get("parameters") or {"type": "object"}},
            "required": ["name", arguments_key], "additionalProperties": False}


class ToolCallParser(ABC):
    """One model family's tool-call format."""

    name: str
    arguments_key: str  # the key holding a call's arguments
    separator: str  # between two calls

    @abstractmethod
    def instructions(self) -> str:
        """How to write calls, for the tool prompt of a chat template that has no tools."""

    @abstractmethod
    def format(self, calls: list[tuple[str, dict]]) -> str:
        """The text of ``calls`` (name, arguments) as the model writes them (for the history)."""

    @abstractmethod
    def call_rule(self, call_schema: dict) -> str:
        """The Lark expression of one call whose JSON object follows ``call_schema``."""

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The content and complete calls of ``text``; ``final``: no more text will come, so
        what was held back as a possible call is settled (content, unless it was calls)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None when only calls) and calls of a finished output."""
        found = self.scan(text, final=True)
        return (found.content if found.content.strip() or not found.calls else None,
                [ToolCall(name, arguments) for name, arguments in found.calls])

    def constraint(self, tools: list[dict], parallel: bool) -> StructuredOutputsParams:
        """A grammar admitting only calls of ``tools`` (one, or with ``parallel`` one or more)."""
        schemas = [_schema(t, self.arguments_key) for t in tools]
        one = self.call_rule(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
        more = f"({json.dumps(self.separator)} call)*" if parallel else ""
        return StructuredOutputsParams(grammar=f"start: call {more}\ncall: {one}\n")


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, after any content."""

    name, arguments_key, separator = "hermes", "arguments", "\n"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def instructions(self) -> str:
        return ("To call a function, write a JSON object with its name and arguments between "
                f"{self.OPEN} and {self.CLOSE}, one block per call:\n{self.OPEN}\n"
                '{"name": "<function name>", "arguments": {"<argument>": <value>}}\n'
                f"{self.CLOSE}\nEach result comes back to you between <tool_response> and </tool_response>.")

    def format(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(f"{self.OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{self.CLOSE}"
                         for n, a in calls)

    def call_rule(self, call_schema: dict) -> str:
        return f'"{self.OPEN}\\n" %json {json.dumps(call_schema)} "\\n{self.CLOSE}"'

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.OPEN)
        if start < 0:  # hold back a tail that may be the start of <tool_call>
            keep = 0 if final else next((k for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1)
                                         if self.OPEN.startswith(text[-k:])), 0)
            return Scan(text[:len(text) - keep], [])
        calls, at = [], start
        while (begin := text.find(self.OPEN, at)) >= 0:
            end = text.find(self.CLOSE, begin)
            body = text[begin + len(self.OPEN): end if end >= 0 else len(text)]
            if end < 0 and not final:
                break  # this block is still being written
            try:
                call = _call(json.loads(body), (self.arguments_key,))
            except json.JSONDecodeError:
                call = None
            if call is None or text[at:begin].strip():
                break  # not a call, or prose between calls: the rest is content
            calls.append(call)
            at = end + len(self.CLOSE) if end >= 0 else len(text)
        if not final:
            return Scan(text[:start], calls)
        rest = text[at:]
        if not calls:
            return Scan(text, [])
        return Scan(text[:start] + (rest if rest.strip() else ""), calls)


class Llama3JsonParser(ToolCallParser):
    """A reply that is only ``{"name": ..., "parameters": {...}}`` objects joined by ``"; "``
    (an optional ``<|python_tag|>`` first), as Llama 3.1+'s chat template asks for."""

    name, arguments_key, separator = "llama3_json", "parameters", "; "
    TAG = "<|python_tag|>"

    def instructions(self) -> str:
        return ('To call a function, reply with only a JSON object {"name": "<function name>", "parameters": '
                '{"<argument>": <value>}}; for several calls, join the objects with "; ".')

    def format(self, calls: list[tuple[str, dict]]) -> str:
        return self.separator.join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def call_rule(self, call_schema: dict) -> str:
        return f"%json {json.dumps(call_schema)}"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        maybe_calls = body.startswith("{") or self.TAG.startswith(text.lstrip())
        if not maybe_calls:
            return Scan(text, [])
        if not final:
            return Scan("", [])  # calls are known only once the whole reply is
        calls, at, decoder = [], 0, json.JSONDecoder()
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return Scan(text, [])
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return Scan(text, [])
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return Scan("", calls) if calls else Scan(text, [])


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


class ToolCallStream:
    """One streamed reply's content and tool calls, as they become known."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.content_sent = ""
        self.calls_sent: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """The new content and the newly complete calls, ``text`` being the whole reply so far."""
        found = self.parser.scan(text, final)
        content = found.content
        new_content = content[len(self.content_sent):] if content.startswith(self.content_sent) else ""
        self.content_sent += new_content
        new_calls = [ToolCall(name, arguments) for name, arguments in found.calls[len(self.calls_sent):]]
        self.calls_sent += new_calls
        return new_content, new_calls
