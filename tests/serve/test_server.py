"""The OpenAI-compatible server on a tiny Llama, driven by the official ``openai`` client:
greedy outputs equal the LLM API's, streaming concatenates to the same text, sampling fields,
errors with OpenAI error JSON, auth, health/metrics, disconnect cancellation, queue-full 503s."""
from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.request

import openai
import pytest

from kiln import LLM
from kiln.errors import ConfigError
from kiln.examples import smollm2_gguf_path
from kiln.runtime.executor import ExecutorConfig, KvCacheConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve.engine import ServingEngine
from tests.utils.server import MAX_INPUT_LEN, MAX_SEQ_LEN, MODEL, serve_tiny

KEY = "secret-key"
PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hello world, how are you?"}]


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir, kv_cache_max_tokens=1024, progress=False)


def _greedy(llm, prompt, max_tokens, **kw):
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **kw))
    return out


# -- outputs ----------------------------------------------------------------------------------


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_matches_llm_greedy(client, llm):
    ref = _greedy(llm, PROMPT, 12)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # token-id prompts and a batch of prompts
    ids = list(ref.prompt_token_ids)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == ref.outputs[0].text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "hello world"], max_tokens=12, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == ref.outputs[0].text
    assert batch.choices[1].text == _greedy(llm, "hello world", 12).outputs[0].text


def test_chat_matches_llm_greedy(client, llm):
    (ref,) = llm.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    r2 = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    assert r2.choices[0].message.content == ref.outputs[0].text


def test_streaming_completion_concatenates(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 20 == full.usage.completion_tokens


def test_streaming_chat_concatenates(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=15, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=15, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason is not None


def test_n_with_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 16
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=3, n=2)
    assert len(chat.choices) == 2


def test_stop_cuts_text(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    r = client.completions.create(stop=[stop, "zzzzzz"], **kw)
    assert r.choices[0].text == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == text[: text.find(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, llm):
    ref = _greedy(llm, PROMPT, 6, logprobs=2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    expected = [entry[t] for t, entry in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)


def test_extras_and_penalties_accepted(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, top_p=0.9, seed=1,
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": -100},
                                  extra_body={"top_k": 5, "min_tokens": 6, "repetition_penalty": 1.2,
                                              "ignore_eos": False})
    assert r.usage.completion_tokens == 6  # min_tokens == max_tokens


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 2), ("n", 0), ("presence_penalty", 5),
                                         ("max_tokens", 0), ("logprobs", 50)])
def test_bad_field_is_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, **{field: value})
    assert e.value.status_code == 400
    assert e.value.param == field
    assert e.value.type == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("best_of", 3), ("suffix", "}")])
def test_unsupported_completion_field_is_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **{field: value})
    assert e.value.param == field and "not supported" in e.value.message
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, best_of=2).usage


def test_wrong_type_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens="many")
    assert e.value.param == "max_tokens"


def test_bad_chat_field_streaming_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1, stream=True)
    assert e.value.param == "temperature"


def test_oversized_prompt_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * (MAX_INPUT_LEN + 1), max_tokens=4)
    assert e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the cat " * 40}],
                                       stream=True)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2)


def test_api_key(engine_dir):
    s = serve_tiny(engine_dir, api_key=KEY)
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client("wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.client(KEY).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
        with urllib.request.urlopen(s.url("/health")) as r:  # health needs no key
            assert r.status == 200
    finally:
        s.stop()


def test_a_gguf_file_serves_as_the_tokenizer(smollm2_llm, smollm2_engine_without_tokenizer):
    """--tokenizer_dir a GGUF file: an engine without a tokenizer serves text and chat through the
    GGUF's tokenizer, exactly as the engine built with that tokenizer answers."""
    s = serve_tiny(smollm2_engine_without_tokenizer, tokenizer_dir=smollm2_gguf_path())
    try:
        ref = _greedy(smollm2_llm, "The capital of France is", 8)
        r = s.client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert (r.choices[0].text, r.usage.prompt_tokens) == (ref.outputs[0].text, len(ref.prompt_token_ids))
        [chat_ref] = smollm2_llm.chat(MESSAGES, SamplingParams(max_tokens=8, temperature=0))
        chat = s.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == chat_ref.outputs[0].text
        assert chat.usage.prompt_tokens == len(chat_ref.prompt_token_ids)
    finally:
        s.stop()


def test_a_bad_tokenizer_path_is_a_config_error_naming_the_flag(engine_dir, tmp_path):
    for path, reason in ((tmp_path / "missing", "no such file or directory"),
                         (engine_dir / "config.json", "neither a directory nor a GGUF file")):
        with pytest.raises(ConfigError, match=f"--tokenizer_dir {re.escape(str(path))}: {reason}"):
            ServingEngine(engine_dir, tokenizer_dir=path,
                          executor_config=ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=256)))


# -- operations -------------------------------------------------------------------------------


def _get(server, path):
    with urllib.request.urlopen(server.url(path), timeout=10) as r:
        return r.status, r.read().decode()


def test_health_and_metrics(server, client):
    status, body = _get(server, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    status, text = _get(server, "/metrics")
    assert status == 200
    for name in ("kiln_num_requests_running", "kiln_num_requests_waiting", "kiln_prompt_tokens_total",
                 "kiln_generation_tokens_total", "kiln_kv_cache_blocks_used", "kiln_kv_cache_blocks_total",
                 "kiln_prefix_cache_hit_rate", "kiln_time_to_first_token_seconds_bucket",
                 "kiln_inter_token_latency_seconds_bucket"):
        assert f"\n{name}" in text, name
    generated = [line for line in text.splitlines() if line.startswith("kiln_generation_tokens_total ")]
    assert float(generated[0].split()[1]) > 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels(server, stream):
    engine = server.app.state.engine
    pool = engine.executor.core.pool
    cancelled = []
    original = engine.executor.cancel_request
    engine.executor.cancel_request = lambda rid: (cancelled.append(rid), original(rid))[1]
    core, step = engine.executor.core, engine.executor.core.step
    core.step = lambda: (time.sleep(0.02), step())[1]  # ~2.2 s for the whole generation: it must be cut short
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_SEQ_LEN - 16, "temperature": 0,
                           "ignore_eos": True, "stream": stream})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        if stream:
            response = conn.getresponse()
            assert response.status == 200
            assert response.readline().startswith(b"data: ")
        else:  # hang up while the whole answer is still being generated
            deadline = time.monotonic() + 10
            while pool.num_free == pool.num_blocks:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.01)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.monotonic() + 10
        while not (cancelled and pool.num_free == pool.num_blocks):
            assert time.monotonic() < deadline, (cancelled, pool.num_free, pool.num_blocks)
            time.sleep(0.02)
        assert time.monotonic() < deadline - 8  # freed well before the generation could have finished
    finally:
        engine.executor.cancel_request = original
        core.step = step
    assert _get(server, "/health")[0] == 200


def _post_with_headers(server, path, payload):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode(), response.headers  # case-insensitive


def _post(server, path, payload):
    status, text, _ = _post_with_headers(server, path, payload)
    return status, text


def test_raw_sse_and_error_json(server):
    status, text = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                                          "temperature": 0, "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])
    status, text = _post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_p": 2})
    assert status == 400
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "top_p" and error["code"] is None
    assert "top_p" in error["message"]


def test_queue_full_is_503_with_retry_after(server, client):
    """With the engine busy and the queue at its bound, a request gets 503 + Retry-After; the
    queued ones are served once the engine moves again, and so is the next request."""
    ex = server.app.state.engine.executor
    go = threading.Event()
    step = ex.core.step
    ex.core.step = lambda: (go.wait(30), step())[1]
    before, ex.config.max_queue_size = ex.config.max_queue_size, 2
    answers = []
    ask = lambda: answers.append(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2))  # noqa: E731
    threads = []
    try:
        for _ in range(2):  # one admitted and stuck behind the stalled step, one in the executor's inbox
            threads.append(threading.Thread(target=ask))
            threads[-1].start()
        deadline = time.monotonic() + 10
        while len(ex._incoming) + len(ex.core.scheduler.waiting) < 2:
            assert time.monotonic() < deadline, "the requests never queued"
            time.sleep(0.01)
        status, text, headers = _post_with_headers(server, "/v1/completions",
                                                   {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert status == 503 and headers["Retry-After"] == "1"
        assert json.loads(text)["error"]["type"] == "overloaded_error"
    finally:
        ex.config.max_queue_size = before
        go.set()
        ex.core.step = step
        for t in threads:
            t.join(30)
    assert len(answers) == 2
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].finish_reason
