"""Structured outputs on the bundled SmolLM2 model, through the LLM API and through ``kiln serve``
with the official openai client: every output of a JSON Schema request parses and validates
(jsonschema), regexes, choices and grammars hold, a constrained request leaves the free ones of
its batch as they were, and what cannot compile fails that request with its reason (a 400 naming
the field on the server)."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from kiln import SamplingParams, StructuredOutputsParams
from kiln.errors import RequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "manager", "designer"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a colleague as JSON.", "Who is Ada Lovelace? Answer in JSON.", "Make up a person.",
           "Tell me about your manager.", "A short profile of a designer:"]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no extra keys for the model to ramble in
    name: str = Field(max_length=20)  # bounded: a 135M model may otherwise ramble past max_tokens
    population: int = Field(ge=0, le=10**9)


def _texts(llm, prompts, params) -> list[str]:
    return [o.text for out in llm.generate(prompts, params) for o in out.outputs]


def test_json_schema_outputs_validate(smollm2_llm) -> None:
    """Greedy and two seeded samples for each prompt: all parse and satisfy the schema."""
    so = StructuredOutputsParams(json=PERSON)
    greedy = _texts(smollm2_llm, PROMPTS, SamplingParams(max_tokens=80, temperature=0, structured_outputs=so))
    sampled = _texts(smollm2_llm, PROMPTS, SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=2,
                                                          structured_outputs=so))
    assert len(greedy) == 5 and len(sampled) == 10
    for text in greedy + sampled:
        jsonschema.validate(json.loads(text), PERSON)


def test_schema_spellings_regex_choice_and_grammars(smollm2_llm) -> None:
    """A pydantic class and JSON text as the schema, JSON mode, a regex, a choice, and a Lark and a
    GBNF grammar: each output is what it was held to."""
    def one(**constraint) -> str:
        params = SamplingParams(max_tokens=60, temperature=0.7, seed=1,
                                structured_outputs=StructuredOutputsParams(**constraint))
        return _texts(smollm2_llm, ["Answer:"], params)[0]

    City.model_validate_json(one(json=City))
    jsonschema.validate(json.loads(one(json=json.dumps(PERSON))), PERSON)
    assert re.fullmatch(r"\d{3}-\d{4}", one(regex=r"\d{3}-\d{4}"))
    assert one(choice=["yes", "no", "not (quite) sure"]) in {"yes", "no", "not (quite) sure"}
    lark = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: "world" | "there"'
    assert re.fullmatch(r"(hello|hi) (world|there)!", one(grammar=lark))
    assert re.fullmatch(r"[xy]z[0-9]", one(grammar='root ::= ("x" | "y") "z" [0-9]'))


def test_json_mode_gives_objects(smollm2_llm) -> None:
    """Any JSON object: every sample opens one, and each that ended on its own (free JSON may
    run past max_tokens) parses as one."""
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=5, n=4,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    outputs = smollm2_llm.generate(["Give me some data:"], params)[0].outputs
    assert all(o.text.lstrip().startswith("{") for o in outputs)
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(o.text), dict) for o in finished)


def test_a_constrained_request_leaves_its_batch_alone(smollm2_llm) -> None:
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = _texts(smollm2_llm, ["The capital of France is"], free)
    together = smollm2_llm.generate(["Pick one:", "The capital of France is"],
                                    [SamplingParams(max_tokens=12, temperature=0,
                                                    structured_outputs=StructuredOutputsParams(choice=["red", "blue"])),
                                     free])
    assert together[0].outputs[0].text in {"red", "blue"}
    assert together[1].outputs[0].text == alone[0]


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "(unclosed"}, "structured_outputs"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"json": 42}, "structured_outputs.json: a JSON Schema"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({}, "exactly one of"),
])
def test_what_cannot_compile_is_a_request_error(smollm2_llm, constraint, message) -> None:
    with pytest.raises(RequestError, match=re.escape(message)):
        smollm2_llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint)))


def test_held_under_a_lora_adapter_and_cut_by_stop_strings(smollm2_llm) -> None:
    """The mask applies to what the adapter makes of the logits; a stop string ends the text
    inside the constraint."""
    from kiln.bench.common import random_lora_modules
    from kiln.layers.lora import LoraAdapter

    adapter = LoraAdapter(random_lora_modules(smollm2_llm.engine.config, 8, ("attn_q", "attn_v", "mlp_4h_to_h"),
                                              scale=0.05))
    free = SamplingParams(max_tokens=12, temperature=0)
    assert _texts(smollm2_llm, ["The sky is"], free) != [smollm2_llm.generate(["The sky is"], free, lora=adapter)[0]
                                                         .outputs[0].text]
    so = StructuredOutputsParams(regex=r"[a-z]+( [a-z]+){3}\.")
    held = smollm2_llm.generate(["The sky is"], SamplingParams(max_tokens=30, temperature=0, structured_outputs=so),
                                lora=adapter)[0].outputs[0]
    assert re.fullmatch(r"[a-z]+( [a-z]+){3}\.", held.text) and held.finish_reason == "stop"
    cut = smollm2_llm.generate(["The sky is"], SamplingParams(max_tokens=30, temperature=0, structured_outputs=so,
                                                               stop=[" "]), lora=adapter)[0].outputs[0]
    assert re.fullmatch("[a-z]+", cut.text) and held.text.startswith(cut.text + " ") and cut.finish_reason == "stop"


def test_a_bare_executor_holds_outputs_with_the_engines_tokenizer(smollm2_llm) -> None:
    """No front end gave the executor a tokenizer: the sampler reads the engine's own."""
    from kiln.runtime.executor import Executor, ExecutorConfig, KvCacheConfig, OutputConfig, Request

    executor = Executor(smollm2_llm.engine_dir, ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=512)))
    try:
        prompt = smollm2_llm.tokenizer("The sky is")["input_ids"]
        params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["green", "blue"]))
        rid = executor.enqueue_request(Request(prompt, max_tokens=8, sampling_config=params,
                                               end_id=smollm2_llm.processor.end_id,
                                               output_config=OutputConfig(exclude_input_from_output=True)))
        (response,) = executor.await_responses(rid, timeout=120)
        while not response.result.is_final:
            (response,) = executor.await_responses(rid, timeout=120)
    finally:
        executor.shutdown()
    assert not response.has_error(), response.error_msg
    assert smollm2_llm.tokenizer.decode(response.result.output_token_ids[0], skip_special_tokens=True) in ("green",
                                                                                                         "blue")


def test_beam_search_is_refused() -> None:
    with pytest.raises(RequestError, match="structured_outputs must be used without beam search"):
        SamplingParams(use_beam_search=True, best_of=2, structured_outputs=StructuredOutputsParams(regex="a"))


# -- through the server, with the official openai client ----------------------------------------


def test_response_format_json_schema_validates_streamed_or_not(served) -> None:
    """Chat with OpenAI's response_format for 10 prompts (5 whole, 5 streamed): every reply
    parses and satisfies the schema."""
    client = served.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    prompts = [f"{p} (#{i})" for i in range(2) for p in PROMPTS]
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}]
        if i % 2:
            chunks = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=80, seed=i,
                                                    response_format=fmt, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=80, seed=i,
                                               response_format=fmt)
            text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)


def test_guided_fields_and_the_structured_outputs_object(served) -> None:
    client = served.client()
    # ASCII digits: a sampled \d may take any of Unicode's multi-token digits and run past max_tokens.
    r = client.completions.create(model="smollm2", prompt="Phone:", max_tokens=20,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Happy?"}],
                                       max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in {"yes", "no"}
    r = client.completions.create(model="smollm2", prompt="Say hi:", max_tokens=10,
                                  extra_body={"structured_outputs": {"grammar": 'start: "hi" "!"+'}})
    assert re.fullmatch(r"hi!+", r.choices[0].text)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
])
def test_what_cannot_be_held_is_a_400_naming_the_field(served, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, **fields)
    assert e.value.body["param"] == param, e.value.body
