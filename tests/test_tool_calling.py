"""Tool calling through ``kiln serve`` of the bundled SmolLM2 model with the official openai
client: forced calls (``required``, a named function) parse and follow their tool's schema, whole
and streamed; a call's result goes back into the conversation and gets an answer; "auto" reads
the calls a model writes; tools that cannot be held to are a 400 naming ``tools``."""
from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _check_calls(calls) -> list[tuple[str, dict]]:
    """Each call names one of TOOLS and its arguments satisfy that tool's schema."""
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        out.append((call.function.name, arguments))
    return out


@pytest.mark.parametrize("tool_choice, name", [("required", None),
                                               ({"type": "function", "function": {"name": "get_time"}}, "get_time")])
def test_forced_call_round_trip(served, tool_choice, name) -> None:
    """tools -> tool_calls -> a tool message with the result -> an answer."""
    client = served.client()
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                       parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    ((called, arguments),) = _check_calls(choice.message.tool_calls)
    assert name is None or called == name
    history = ASK + [choice.message,  # as OpenAI clients send it back
                     {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=20, temperature=0).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content and not answer.message.tool_calls
    # What the model read: the tools, its call and the result, in the generic format SmolLM2 gets.
    plain = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history]
    body = json.dumps({"model": "smollm2", "messages": plain, "tools": TOOLS}).encode()
    request = urllib.request.Request(served.url("/tokenize"), body, {"Content-Type": "application/json"})
    ids = json.load(urllib.request.urlopen(request, timeout=60))["tokens"]
    prompt = served.engine.tokenizer.decode(ids)
    assert f'"name": "{called}", "arguments": {json.dumps(arguments)}' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt and json.dumps(TOOLS[1]) in prompt


def test_streamed_calls_arrive_as_tool_call_deltas(served) -> None:
    stream = served.client().chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                                     tool_choice="required", max_tokens=120, temperature=0,
                                                     stream=True)
    calls: dict[int, dict] = {}
    content, reasons = "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:  # accumulated by index, as OpenAI clients do
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert calls and sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # Parallel calls are allowed: the model may write more than fit, the cut one staying content.
    assert reasons[-1] in ("tool_calls", "length") and "get_weather" not in content.split("<tool_call>")[0]


def test_auto_reads_the_calls_the_model_writes(served) -> None:
    """With tool_choice auto the output is the model's own; here a regex makes it write two calls,
    both kept with parallel_tool_calls (streamed), the first only without (whole)."""
    client = served.client()
    call = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", "unit": "celsius"\}\}'
            r"\n</tool_call>")
    for stream in (False, True):
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                           stream=stream, parallel_tool_calls=stream,
                                           extra_body={"guided_regex": r"Sure\.\n" + call + r"\n" + call})
        if stream:
            chunks = list(r)
            deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "tool_calls" and content == "Sure.\n"
            assert len(_check_calls(deltas)) == 2 and [d.index for d in deltas] == [0, 1]
        else:
            assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Sure.\n"
            assert len(_check_calls(r.choices[0].message.tool_calls)) == 1
    plain = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls in (None, []) and plain.choices[0].message.content


def test_tools_that_cannot_be_held_to_are_a_400(served) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model="smollm2", messages=ASK, tools=bad, tool_choice="required")
    assert e.value.body["param"] == "tools"
