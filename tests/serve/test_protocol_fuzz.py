"""Property tests over the server's request models: any JSON body either fails validation
(pydantic, a 400 naming the field) or becomes SamplingParams that validate or fail with a
RequestError (a 400 naming the field) -- never another exception, which would be a 500."""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kiln.errors import RequestError
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve.completions import sampling_kwargs
from kiln.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest

# What json.loads can produce, NaN and Infinity included (Python's parser takes them).
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from([2**63, 2**64, -2**64, 2**80]),
                    st.floats(), st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)


numbers = st.one_of(st.floats(-3, 3), st.floats(), st.integers(-2, 300), st.sampled_from([2**63, 2**64, 2**80]))
# Values of the right type (often in range), so that many bodies get past pydantic.
typed = {
    "temperature": numbers, "top_p": numbers, "presence_penalty": numbers, "frequency_penalty": numbers,
    "repetition_penalty": numbers, "seed": numbers, "n": st.integers(-1, 200), "top_k": numbers,
    "min_tokens": st.integers(-1, 40), "max_tokens": st.integers(-1, 40), "max_completion_tokens": st.integers(-1, 40),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)), "top_logprobs": st.integers(-1, 25),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20)),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 2**70).map(str), st.text(max_size=3)), numbers,
                                  max_size=5),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(), "stream": st.booleans(),
}


def body_for(model) -> st.SearchStrategy[dict]:
    keys = st.lists(st.sampled_from([*model.model_fields, "frobnicate", "tools", "functions"]), unique=True,
                    max_size=6)
    return keys.flatmap(lambda names: st.fixed_dictionaries(
        {name: st.one_of(typed[name], typed[name], json_values) if name in typed else json_values
         for name in names})).map(lambda d: {**d, "model": "m"})


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"]),
                                           "content": st.one_of(st.text(max_size=5), st.text(max_size=5),
                                                                json_values)}),
                    min_size=1, max_size=3)


def _convert(model, data: dict) -> None:
    try:
        body = model.model_validate(data)
    except ValidationError:
        return
    try:
        kwargs = sampling_kwargs(body)
    except ApiError as e:
        assert e.status == 400 and e.param
        return
    max_tokens = getattr(body, "max_tokens", None)
    try:
        params = SamplingParams(max_tokens=16 if max_tokens is None else max_tokens, **kwargs)
    except RequestError as e:
        assert " must be " in str(e)
        return
    assert params.temperature <= 2 and params.n <= 128 and len(params.stop) <= 16
    assert all(math.isfinite(v) for v in params.logit_bias.values())


@given(data=body_for(ChatCompletionRequest), msgs=messages)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
def test_any_chat_body_is_valid_or_a_named_400(data, msgs):
    _convert(ChatCompletionRequest, {**data, "messages": msgs})


@given(data=body_for(CompletionRequest), prompt=st.one_of(st.text(max_size=5), st.text(max_size=5), json_values))
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
def test_any_completion_body_is_valid_or_a_named_400(data, prompt):
    _convert(CompletionRequest, {**data, "prompt": prompt})
