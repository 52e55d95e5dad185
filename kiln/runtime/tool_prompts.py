"""Conversations with tools, made ready for a chat template.

A template written for tools (it reads ``tools``) gets them as Hugging Face templates expect:
the definitions as ``tools``, an assistant's calls as ``tool_calls`` with their arguments
decoded, results as ``tool`` messages. A template without tools (the bundled SmolLM2's) gets
kiln's generic format instead, which any template renders because it uses only system, user
and assistant messages of text:

- the definitions, one JSON object per line between ``<tools>`` tags, and the parser's
  instructions for writing a call, end the first system message (one is added if none leads);
- an assistant's calls are written into its content as the parser writes them;
- results become one user message of ``<tool_response>`` blocks, one per call answered.
"""
from __future__ import annotations

import json

from kiln.errors import RequestError
from kiln.runtime.tool_parsers import ToolCallParser

TOOLS_HEADER = ("You can call functions to help with the user's request. These are the functions, as JSON "
                "Schema, one per line:")


def template_reads_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (and so tool calls and results)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" when there are tools
        template = template.get("tool_use") or template.get("default") or ""
    return "tools" in template


def _arguments(call: dict, where: str) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError as e:
        raise RequestError(f"{where}.function.arguments must be JSON text ({e})") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object")
    return arguments


def tools_system_text(tools: list[dict], parser: ToolCallParser) -> str:
    """The generic tool prompt: the definitions, then how to call them."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{TOOLS_HEADER}\n<tools>\n{lines}\n</tools>\n\n{parser.instructions()}"


def _native(messages: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = [{"id": c.get("id"), "type": "function",
                      "function": {"name": c["function"]["name"],
                                   "arguments": _arguments(c, f"messages[{i}].tool_calls[{j}]")}}
                     for j, c in enumerate(m["tool_calls"])]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _generic(messages: list[dict], tools: list[dict] | None, parser: ToolCallParser) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if i > 0 and messages[i - 1]["role"] == "tool":  # results of one turn share one message
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [(c["function"]["name"], _arguments(c, f"messages[{i}].tool_calls[{j}]"))
                     for j, c in enumerate(m["tool_calls"])]
            content = f"{content}\n{parser.format(calls)}" if content else parser.format(calls)
        out.append({"role": m["role"], "content": content})
    if tools:
        text = tools_system_text(tools, parser)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def tool_chat(messages: list[dict], tools: list[dict] | None, parser: ToolCallParser,
              template_has_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to hand the chat template: as they are for a template that reads tools,
    else in the generic format (tools then live in the system message). Messages are OpenAI's:
    ``tool_calls`` of ``{"id", "type", "function": {"name", "arguments": JSON text}}``, ``tool``
    messages with ``content``. A RequestError names a call whose arguments are not a JSON object."""
    if template_has_tools:
        return _native(messages), tools or None
    return _generic(messages, tools, parser), None
