"""No request can stop the server: hostile fields are 400s naming them, a request that fails
inside the engine fails alone (500 or an error event) while the others go on, a failed engine
says so on /health, and the lifecycle holds up (timeouts, draining, 64 streams with clients
hanging up, SIGTERM)."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.utils.server import MAX_SEQ_LEN, MODEL, LocalServer, free_port, serve_tiny, streams_with_hang_ups

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hello world, how are you?"}]
POISON = " kiln"  # a prompt holding it trips the injected fault (one token of the tiny vocabulary)


def _post(server: LocalServer, path: str, payload) -> tuple[int, dict | str, object]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, payload if isinstance(payload, str) else json.dumps(payload),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    try:
        return response.status, json.loads(text), response.headers
    except json.JSONDecodeError:
        return response.status, text, response.headers


def _get(server, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.url(path), timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _still_serves(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def _pool_idle(server) -> bool:
    pool = server.engine.executor.core.pool
    return pool.num_free == pool.num_blocks


# -- validation at the boundary -----------------------------------------------------------------

def test_a_seed_past_64_bits_is_400_and_the_next_request_succeeds(server, client):
    """The request that used to stop the executor (a seed >= 2**64 overflowed torch's generator
    inside the engine thread, and every later request got 500)."""
    status, body, _ = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                             "seed": 1208925819614629174706176})
    assert status == 400 and body["error"]["param"] == "seed" and "64-bit" in body["error"]["message"]
    _still_serves(client)
    # random.getrandbits(64) seeds are served (taken modulo 2**64); n > 1 wraps past the top
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, seed=2**64 - 1, n=2)
    assert len(r.choices) == 2
    assert _get(server, "/health") == (200, {"status": "ok"})


LONG = [f"s{i}" for i in range(17)]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_CHAT = [
    ({"n": 10000}, "n"), ({"n": 100}, "n"),  # OpenAI's bound 128; the server's batch (16) for 100
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),  # which call does it answer?
    ({"messages": [{"role": "function", "name": "f", "content": "42"}]}, "messages"),  # deprecated: use "tool"
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"temperature": 1e308}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # no schema to hold the output to
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ({"tools": [TOOL, TOOL]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"), ({"tools": [TOOL], "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"frobnicate": True}, "frobnicate"), ({"stop": LONG}, "stop"), ({"stop": "x" * 2000}, "stop"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"), ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"top_logprobs": 5}, "top_logprobs"), ({"seed": -2**63 - 1}, "seed"), ({"max_tokens": -1}, "max_tokens"),
]


@pytest.mark.parametrize("fields, param", BAD_CHAT, ids=[p + str(i) for i, (_, p) in enumerate(BAD_CHAT)])
def test_bad_or_unsupported_chat_fields_are_400_naming_them(server, fields, param):
    status, body, _ = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body


def test_too_many_completions_is_400_naming_the_prompt(server):
    limit = server.engine.executor.config.max_queue_size
    status, body, _ = _post(server, "/v1/completions", {"model": MODEL, "prompt": ["a"] * (limit // 2 + 1),
                                                        "n": 2, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt"


def test_ignored_null_and_trivial_fields_are_accepted(client):
    """The documented accept-and-ignore fields, nulls and [] for fields kiln lacks, a text
    response_format, and the developer role (OpenAI's newer system) all serve as without them."""
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"},
                                                                  *MESSAGES], max_tokens=5, temperature=0)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "be brief"}, *MESSAGES], max_tokens=5,
        temperature=0, user="u-1", metadata={"k": "v"}, store=False, response_format={"type": "text"},
        extra_body={"tools": None, "tool_choice": None, "service_tier": "auto"})
    assert r.choices[0].message.content == plain.choices[0].message.content


# -- a request failing inside the engine fails alone --------------------------------------------

@pytest.fixture
def poisoned(server, monkeypatch):
    """Sampling raises for any sequence whose prompt holds the POISON token, once it generated
    two tokens (so a stream has begun)."""
    from kiln.runtime import model_runner

    (poison,) = server.engine.tokenizer(POISON, add_special_tokens=False)["input_ids"]
    sample = model_runner.sample

    def poisoned_sample(logits, seqs):
        if any(poison in s.token_ids[:s.num_prompt_tokens] and s.num_output_tokens >= 2 for s in seqs):
            raise RuntimeError("injected fault")
        return sample(logits, seqs)

    monkeypatch.setattr(model_runner, "sample", poisoned_sample)


def test_an_internal_error_fails_that_request_only(server, client, poisoned):
    results = {}

    def good(i):
        results[i] = client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=good, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    with pytest.raises(openai.InternalServerError) as e:
        # ignore_eos: a sampled end token before the second output token would finish it cleanly
        client.completions.create(model=MODEL, prompt=f"{PROMPT} {POISON}", max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert e.value.status_code == 500 and "injected fault" in e.value.message
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": POISON}], stream=True,
                                            max_tokens=12, extra_body={"ignore_eos": True})
    received = []
    with pytest.raises(openai.APIError, match="injected fault"):  # an error event ends the stream
        for chunk in stream:
            received.append(chunk)
    assert len(received) >= 2  # the role, then the first token
    for t in threads:
        t.join(60)
    assert all(r.usage.completion_tokens == 12 for r in results.values()) and len(results) == 4
    assert server.engine.failure is None and _get(server, "/health")[0] == 200
    _still_serves(client)
    assert _pool_idle(server)


def test_a_failed_engine_says_so(engine_dir, monkeypatch):
    """An engine failing every request stops; /health and /health/ready turn 503 (an orchestrator
    restarts it) and new requests get 503, not a silent dead server."""
    s = serve_tiny(engine_dir)
    try:
        def broken(step):
            raise RuntimeError("the model is broken")

        monkeypatch.setattr(s.engine.executor.core.runner, "run_step", broken)
        client = s.client()
        # Three prompts in one request reach the engine together: one step holds all three,
        # and each fails alone too, so the engine (not a request) is at fault.
        status, body, _ = _post(s, "/v1/completions", {"model": MODEL, "prompt": [PROMPT, "hello", "a cat"],
                                                       "max_tokens": 4})
        assert status == 500 and "broken" in body["error"]["message"]
        assert s.engine.failure is not None
        status, body = _get(s, "/health")
        assert status == 503 and body["status"] == "failed" and "broken" in body["error"]
        assert _get(s, "/health/ready")[0] == 503
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503
    finally:
        s.stop()


# -- lifecycle ------------------------------------------------------------------------------------

@pytest.fixture
def slow_steps(server):
    """Each engine step takes 20 ms longer (a generation of ~100 tokens then takes ~2 s)."""
    core = server.engine.executor.core
    step = core.step
    core.step = lambda: (time.sleep(0.02), step())[1]
    yield
    core.step = step


def test_request_timeout_ends_a_request(server, client, slow_steps):
    engine = server.engine
    engine.request_timeout = 0.3
    try:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_SEQ_LEN - 16,
                                      extra_body={"ignore_eos": True})
    finally:
        engine.request_timeout = None
    assert r.choices[0].finish_reason == "abort" and r.usage.completion_tokens < MAX_SEQ_LEN - 16
    assert _pool_idle(server)


def test_health_separates_liveness_and_readiness(server):
    assert _get(server, "/health") == (200, {"status": "ok"})
    assert _get(server, "/health/ready") == (200, {"status": "ready"})


@pytest.mark.parametrize("grace, reason", [(30.0, "length"), (0.3, "abort")], ids=["finishes", "cancelled"])
def test_draining_refuses_new_requests_and_ends_those_in_flight(server, client, slow_steps, grace, reason):
    engine = server.engine
    chunks = []
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, stream=True, temperature=0,
                                       extra_body={"ignore_eos": True})
    chunks.append(next(iter(stream)))
    drained = asyncio.run_coroutine_threadsafe(engine.drain(grace), engine.loop)
    try:
        status, body, headers = _post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert status == 503 and "shutting down" in body["error"]["message"]
        assert _get(server, "/health/ready") == (503, {"status": "draining"})
        assert _get(server, "/health") == (200, {"status": "draining"})
        chunks += list(stream)
        drained.result(30)
    finally:
        engine.draining = False
    assert chunks[-1].choices[0].finish_reason == reason
    assert _pool_idle(server)
    _still_serves(client)


def test_64_streams_with_a_quarter_hanging_up_leak_no_block(server, client):
    """64 streaming clients at once (4x the engine's batch: most wait in the queue); every
    fourth reads two events and hangs up. The others get every token; the KV block pool is back
    to its idle size after."""
    results, errors, hung_up = streams_with_hang_ups(server, client, PROMPT)
    assert not errors, errors
    assert len(hung_up) == 16 and len(results) == 48
    assert all(reason == "length" for _, reason in results.values())
    deadline = time.monotonic() + 10
    while not _pool_idle(server):
        assert time.monotonic() < deadline, "KV blocks leaked"
        time.sleep(0.05)
    assert not server.engine.executor.core.scheduler.running and server.engine.metrics.in_flight == 0
    assert _get(server, "/health")[0] == 200


def test_sigterm_drains_and_exits_0(engine_dir):
    """``kiln serve`` on SIGTERM: the stream in flight finishes, a new request gets 503, exit 0."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", str(engine_dir), "--port", str(port),
                             "--served_model_name", MODEL, "--kv_cache_max_tokens", "2048",
                             "--graceful_shutdown_timeout", "60"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.2)
        streams = [client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=MAX_SEQ_LEN - 16,
                                             stream=True, temperature=0, extra_body={"ignore_eos": True})
                   for i in range(4)]
        firsts = [next(iter(stream)) for stream in streams]  # all four are generating
        proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 30
        while refused is None and time.monotonic() < deadline:
            try:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
                time.sleep(0.01)  # not draining yet
            except openai.InternalServerError as e:
                refused = e.status_code
        assert refused == 503
        for first, stream in zip(firsts, streams):  # each runs to its end: one event per token, none cut
            rest = list(stream)
            assert rest[-1].choices[0].finish_reason == "length"
            assert len(rest) + 1 == MAX_SEQ_LEN - 16 and first.choices[0].text is not None
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the server's own OpenAPI schema, fuzzed ----------------------------------------------------

def test_openapi_fuzz_finds_no_server_error_and_the_server_goes_on(server, client):
    """Schemathesis over every documented operation (a bounded run; benchmarks/fuzz_server.py
    runs thousands): no 5xx, no hang, every response as documented, a normal request succeeds
    after every case, and nothing sent leaves KV blocks behind."""
    from tests.utils.fuzz import fuzz_openapi

    report = fuzz_openapi(server.url("/openapi.json"), max_examples=25, model=MODEL,
                          after_each=lambda: _still_serves(client))
    assert report.cases >= 60 and report.server_errors == 0 and not report.failures, report.failures[:3]
    assert report.by_status.get(400, 0) > 0 and report.by_status.get(200, 0) > 0  # it reached both sides
    assert _pool_idle(server)


def test_oversized_bodies_odd_paths_and_unreadable_adapters_are_client_errors(server):
    from kiln.serve.app import MAX_BODY_BYTES

    status, _, _ = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * MAX_BODY_BYTES})
    assert status == 413
    status, body, _ = _post(server, "/v1/nothing-here", {})
    assert status == 404 and "message" in body["error"]
    status, body, _ = _post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "ä" * 300})
    assert status == 400 and body["error"]["param"] == "lora_path"  # a name too long for the filesystem


def test_tokenize_and_detokenize_round_trip(server):
    """/tokenize gives the ids the completion endpoints take (a prompt, or chat messages as the
    chat endpoint renders them); /detokenize gives their text back; bad input is a named 400."""
    tokenizer = server.engine.tokenizer
    status, body, _ = _post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert status == 200 and body["tokens"] == tokenizer(PROMPT)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.build.max_seq_len
    status, chat, _ = _post(server, "/tokenize", {"messages": MESSAGES})
    assert status == 200 and chat["tokens"] == tokenizer(tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    status, back, _ = _post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == tokenizer.decode(body["tokens"])
    for path, payload, param in (("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
                                 ("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
                                 ("/detokenize", {"tokens": [1], "model": "nope"}, "model")):
        status, err, _ = _post(server, path, payload)
        assert status in (400, 404) and err["error"]["param"] == param, err
