"""Tool calls read back from model text (whole and streamed), and conversations with tools made
ready for chat templates with and without tool support."""
from __future__ import annotations

import json

import pytest

from kiln.errors import RequestError
from kiln.runtime.tool_parsers import HermesParser, Llama3JsonParser, ToolCallStream
from kiln.runtime.tool_prompts import TOOLS_HEADER, template_reads_tools, tool_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def _streamed(parser, text: str) -> tuple[str, list]:
    """Content and calls of ``text`` fed a character at a time, as a stream sees it."""
    stream, content, calls = ToolCallStream(parser), "", []
    for end in range(1, len(text) + 1):
        new_content, new_calls = stream.feed(text[:end], final=end == len(text))
        content, calls = content + new_content, calls + new_calls
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_reads_content_then_calls_whole_and_streamed() -> None:
    content, calls = HermesParser().parse(HERMES_TWO)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert _streamed(HermesParser(), HERMES_TWO) == ("Let me check.\n", [("get_weather", {"city": "Paris"}),
                                                                          ("get_time", {"zone": "CET"})])


@pytest.mark.parametrize("text", ["Just prose, and a < sign.", "<tool_call>\n{not json}\n</tool_call>",
                                  '<tool_call>\n{"arguments": {}}\n</tool_call>', "<tool_c"])
def test_hermes_keeps_what_is_not_a_call_as_content(text) -> None:
    assert HermesParser().parse(text) == (text, [])
    assert _streamed(HermesParser(), text) == (text, [])


def test_hermes_call_cut_short_stays_content() -> None:
    text = HERMES_TWO[:HERMES_TWO.rindex("</tool_call>") - 8]  # the second call never closed
    content, calls = HermesParser().parse(text)
    assert [c.name for c in calls] == ["get_weather"]
    assert content.startswith("Let me check.\n") and content.endswith(text[-10:])


def test_llama3_json_reads_one_or_more_bare_objects() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "noop", "parameters": {}}'
    content, calls = Llama3JsonParser().parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("noop", {})]
    assert _streamed(Llama3JsonParser(), text)[1] == [("get_weather", {"city": "Oslo"}), ("noop", {})]
    for prose in ("It is sunny in Oslo.", '{"not": "a call"}', '{"name": "x", "parameters": 3}'):
        assert Llama3JsonParser().parse(prose) == (prose, [])
        assert _streamed(Llama3JsonParser(), prose) == (prose, [])


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
def test_the_constraint_grammar_writes_what_the_parser_reads(parser) -> None:
    """The call format the grammar spells is the one ``format`` writes and ``parse`` reads."""
    grammar = parser.constraint([WEATHER], parallel=True).grammar
    assert "get_weather" in grammar and "call (" in grammar
    assert "call (" not in parser.constraint([WEATHER], parallel=False).grammar
    written = parser.format([("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})])
    assert [(c.name, json.loads(c.arguments)) for c in parser.parse(written)[1]] == [
        ("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})]


def _call(id_: str, arguments: str) -> dict:
    return {"id": id_, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [_call("call_1", '{"city": "Paris"}'),
                                                                 _call("call_2", '{"city": "Lyon"}')]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
           {"role": "tool", "tool_call_id": "call_2", "content": "20 C"}]


def test_generic_format_for_templates_without_tools() -> None:
    messages, template_tools = tool_chat(HISTORY, [WEATHER], HermesParser(), template_has_tools=False)
    assert template_tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith(TOOLS_HEADER) and json.dumps(WEATHER) in messages[0]["content"]
    assert HermesParser().parse(messages[2]["content"])[1][1].arguments == '{"city": "Lyon"}'
    assert messages[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n20 C\n</tool_response>"
    with_system, _ = tool_chat([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], [WEATHER], HermesParser(),
                               template_has_tools=False)
    assert with_system[0]["content"].startswith("Be brief.\n\n" + TOOLS_HEADER) and len(with_system) == 2


def test_templates_with_tools_get_them_as_hf_expects() -> None:
    messages, template_tools = tool_chat(HISTORY, [WEATHER], HermesParser(), template_has_tools=True)
    assert template_tools == [WEATHER] and messages[2:] == HISTORY[2:]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert template_reads_tools(type("T", (), {"chat_template": "{% if tools %}{{ tools }}{% endif %}"}))
    assert not template_reads_tools(type("T", (), {"chat_template": "{{ messages }}"}))
    bad = [{**HISTORY[1], "tool_calls": [_call("call_1", "[1]")]}]
    with pytest.raises(RequestError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        tool_chat(bad, None, HermesParser(), template_has_tools=False)
