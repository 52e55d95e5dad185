"""Scoring through ``/v1/completions`` on the tiny engine, with the official openai client: ``echo``
puts the prompt (text, tokens, log-probs) before the generated part, streamed or not, for every
choice of every prompt; ``max_tokens: 0`` scores without generating; vLLM's ``prompt_logprobs``;
prompt log-probs equal the LLM API's on the same engine; named 400s for what cannot be served.
The server here caches prefixes, so a prompt scored twice must not lose the logits of its cached
blocks."""
from __future__ import annotations

import openai
import pytest
import torch

from kiln import LLM
from kiln.runtime.executor import Result
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve.engine import Event, ServingEngine, _Choice
from tests.utils.server import MODEL, LocalServer

PROMPT = "the quick brown fox jumps over the lazy dog"
OTHER = "hello world"
TOL = 1e-5  # the same engine and the same float32 logits on both sides


@pytest.fixture(scope="module")
def server(engine_dir):
    """The tiny engine served with prefix caching on (the conftest's server has it off)."""
    from kiln.runtime.executor import ExecutorConfig, KvCacheConfig
    from kiln.serve import create_app

    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=4096, enable_block_reuse=True))
    s = LocalServer(create_app(engine_dir, executor_config=config, served_model_name=MODEL))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir, kv_cache_max_tokens=1024, progress=False)


def _reference(llm, prompt, k: int):
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k))
    return out.prompt_token_ids, out.prompt_logprobs


def _token(llm, token_id: int) -> str:
    return llm.tokenizer.decode([token_id])


def _check_prompt_part(llm, logprobs, ids, reference, k: int) -> None:
    """The first ``len(ids)`` entries of a choice's logprobs are the prompt's, as the LLM API scores it."""
    assert logprobs.tokens[:len(ids)] == [_token(llm, t) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0
    for i in range(1, len(ids)):
        assert logprobs.token_logprobs[i] == pytest.approx(reference[i][ids[i]], abs=TOL)
        top = logprobs.top_logprobs[i]
        assert _token(llm, ids[i]) in top and len(top) <= k + 1
        best = sorted(reference[i].items(), key=lambda kv: -kv[1])[:k]
        for t, value in best:
            assert top[_token(llm, t)] == pytest.approx(value, abs=TOL)


def test_echo_puts_the_scored_prompt_before_the_completion(client, llm):
    ids, reference = _reference(llm, PROMPT, 2)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    (choice,) = r.choices
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    _check_prompt_part(llm, lp, ids, reference, 2)
    generated = plain.choices[0].logprobs
    assert lp.tokens[len(ids):] == generated.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(generated.token_logprobs, abs=TOL)
    assert lp.text_offset[len(ids)] == len(PROMPT)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3


def test_echo_without_logprobs_and_a_cached_prompt_scored_again(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and r.choices[0].logprobs is None
    # The same prompt again: its blocks are cached now, yet every prompt token is scored.
    ids, reference = _reference(llm, PROMPT, 1)
    for _ in range(2):
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                          logprobs=1)
        _check_prompt_part(llm, again.choices[0].logprobs, ids, reference, 1)


def _streamed(client, **kw) -> dict[int, list]:
    chunks: dict[int, list] = {}
    for chunk in client.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            chunks.setdefault(c.index, []).append(c)
    return chunks


@pytest.mark.parametrize("as_ids", [False, True])
def test_streamed_echo_sends_each_choice_its_prompt_first(client, llm, as_ids):
    """Two prompts (as text or as token ids) x n=2: each choice's first chunk holds its prompt and
    the prompt's log-probs; the chunks join to the non-streamed answer."""
    ids_a, ref_a = _reference(llm, PROMPT, 1)
    ids_b, ref_b = _reference(llm, OTHER, 1)
    prompts = [ids_a, ids_b] if as_ids else [PROMPT, OTHER]
    kw = dict(prompt=prompts, max_tokens=4, temperature=0, logprobs=1, echo=True, n=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(model=MODEL, **kw)
    streamed = _streamed(client, **kw)
    assert sorted(streamed) == [0, 1, 2, 3] == [c.index for c in whole.choices]
    for index, chunks in streamed.items():
        ids, reference, text = (ids_a, ref_a, PROMPT) if index < 2 else (ids_b, ref_b, OTHER)
        if as_ids:
            text = llm.tokenizer.decode(ids)
        first = chunks[0]
        assert first.text.startswith(text)
        assert len(first.logprobs.tokens) >= len(ids)
        _check_prompt_part(llm, first.logprobs, ids, reference, 1)
        assert all(c.logprobs.token_logprobs[0] is not None for c in chunks[1:])  # the prompt came once
        joined = whole.choices[index]
        assert "".join(c.text for c in chunks) == joined.text
        assert sum((c.logprobs.tokens for c in chunks), []) == joined.logprobs.tokens
        assert [c.finish_reason for c in chunks][-1] == joined.finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_scores_the_prompt_without_generating(client, llm, stream):
    ids, reference = _reference(llm, PROMPT, 1)
    kw = dict(prompt=[PROMPT, PROMPT], max_tokens=0, echo=True, logprobs=1, n=2)
    if stream:
        chunks = _streamed(client, stream_options={"include_usage": True}, **kw)
        assert sorted(chunks) == [0, 1, 2, 3]
        choices = []
        for index, cs in chunks.items():
            assert len(cs) == 1  # the prompt and the finish reason, in one chunk
            choices.append(cs[0])
    else:
        r = client.completions.create(model=MODEL, **kw)
        choices = r.choices
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 2 * len(ids)
    for choice in choices:
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(ids)
        _check_prompt_part(llm, choice.logprobs, ids, reference, 1)


def test_streamed_usage_of_max_tokens_0_counts_no_completion_tokens(client):
    usage = [c.usage for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                                         stream=True, stream_options={"include_usage": True})
             if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == 0 and usage[0].total_tokens == usage[0].prompt_tokens


def test_prompt_logprobs_in_vllm_format(client, llm):
    ids, reference = _reference(llm, PROMPT, 3)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 3})
    for choice in r.choices:
        assert not choice.text.startswith(PROMPT) and choice.logprobs is None  # no echo asked
        entries = choice.model_extra["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for i in range(1, len(ids)):
            entry = entries[i]
            assert str(ids[i]) in entry and 3 <= len(entry) <= 4
            best = sorted(reference[i].items(), key=lambda kv: -kv[1])
            for rank, (t, value) in enumerate(best[:3], start=1):
                assert entry[str(t)] == {"logprob": pytest.approx(value, abs=TOL), "rank": rank,
                                         "decoded_token": _token(llm, t)}
            mine = entry[str(ids[i])]
            assert mine["logprob"] == pytest.approx(reference[i][ids[i]], abs=TOL) and mine["rank"] >= 1
            assert (mine["rank"] <= 3) == (ids[i] in dict(best[:3]))


def test_prompt_logprobs_0_and_echo_logprobs_are_cut_to_what_each_asks(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 0})
    (choice,) = r.choices
    assert all(len(e) == 1 for e in choice.model_extra["prompt_logprobs"][1:])
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs[1:])


@pytest.mark.parametrize("fields, param", [
    (dict(max_tokens=0), "max_tokens"),  # nothing to answer without echo (as vLLM)
    (dict(max_tokens=0, echo=True, extra_body={"min_tokens": 1}), "min_tokens"),
    (dict(max_tokens=1, extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(max_tokens=1, extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
    (dict(max_tokens=1, echo=True, logprobs=21), "logprobs"),
    (dict(max_tokens=1, echo=True, extra_body={"prompt_logprobs": "all"}), "prompt_logprobs"),
])
def test_what_cannot_be_scored_is_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, **fields)
    assert e.value.param == param, e.value.body
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True).choices[0].text == PROMPT


def test_a_sibling_waits_for_its_prompt_to_be_scored():
    """n=2: the second choice's output, arriving before the first choice's context logits, is held
    and then sent after them, its first event carrying the prompt's log-probs (and only that one)."""
    params = SamplingParams(n=2, max_tokens=2, prompt_logprobs=1)
    prompts = [[1, 2, 3]]
    choices = [_Choice(i, 10 + i, None, waits=True) for i in range(2)]
    release = ServingEngine._release
    early = [Event(1, "a", [5]), Event(1, "b", [6], finish_reason="length")]
    for event in early:
        assert release(choices[1], event, Result([[event.token_ids[0]]], False, [None]), prompts, params, choices) == []
    logits = torch.randn(3, 8)
    scoring = Result([[7]], False, [None], context_logits=logits)
    first = Event(0, "c", [7])
    ready = release(choices[0], first, scoring, prompts, params, choices)
    assert ready == [first, *early] and scoring.context_logits is None
    assert first.prompt_logprobs is early[0].prompt_logprobs and early[1].prompt_logprobs is None
    assert first.prompt_logprobs.entries[0] is None and set(first.prompt_logprobs.entries[2]) >= {3}
    later = Event(0, "d", [8], finish_reason="length")
    assert release(choices[0], later, Result([[8]], True, ["length"]), prompts, params, choices) == [later]
    assert later.prompt_logprobs is None
