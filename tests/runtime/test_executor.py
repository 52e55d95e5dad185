"""Executor (in-flight batching) on a tiny random Llama: batching, preemption and chunking leave
outputs unchanged; streaming, errors, cancellation, timeouts, shutdown, priority, asyncio,
iteration stats and block accounting behave as documented."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from kiln.errors import KilnError
from kiln.runtime import SamplingConfig
from kiln.runtime.engine import Engine
from kiln.runtime.executor import Executor, ExecutorConfig, KvCacheConfig, OutputConfig, Request
from kiln.runtime.sampling_params import SamplingParams
from tests.conftest import convert_and_build
from tests.utils.tiny_models import make_llama

BLOCK = 4
MAX_NUM_TOKENS = 64
VOCAB = 256
WAIT = 30.0  # seconds: a generous bound for anything to arrive; tests take far less


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Steps here are tiny: with 2 intra-op threads on a busy 2-core machine each one can take ~50x
    longer (threads waiting on each other), so this module runs torch single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, kiln Engine) of one tiny Llama."""
    d = tmp_path_factory.mktemp("executor")
    hf = make_llama(d / "hf")
    engine_dir = convert_and_build(d / "hf", d / "w", build_options=dict(
        tokens_per_block=BLOCK, max_num_tokens=MAX_NUM_TOKENS, max_batch_size=16))
    return hf, Engine(engine_dir)


@pytest.fixture
def make_executor(tiny):
    """Executor factory; every executor made is shut down after the test."""
    made = []

    def make(config: ExecutorConfig | None = None) -> Executor:
        ex = Executor(tiny[1], config)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.shutdown()


def req(prompt, max_tokens, **kw) -> Request:
    kw.setdefault("output_config", OutputConfig(exclude_input_from_output=True))
    return Request(input_token_ids=list(prompt), max_tokens=max_tokens, **kw)


def collect(ex: Executor, ids: list[int], timeout: float = WAIT) -> dict[int, list]:
    """Every response of ``ids`` until each has a final (or error) one, in arrival order."""
    got: dict[int, list] = {rid: [] for rid in ids}
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(done) < len(ids):
        assert time.monotonic() < deadline, f"requests {set(ids) - done} never finished"
        for r in ex.await_responses(ids, timeout=1.0):
            assert r.request_id not in done, "a response after the final one"
            got[r.request_id].append(r)
            if r.has_error() or r.result.is_final:
                done.add(r.request_id)
    return got


def final_tokens(responses) -> list[int]:
    last = responses[-1]
    assert not last.has_error(), last.error_msg
    assert last.result.is_final
    return last.result.output_token_ids[0]


def run_alone(ex: Executor, request: Request) -> list[int]:
    rid = ex.enqueue_request(request)
    return final_tokens(collect(ex, [rid])[rid])


def assert_pool_free(ex: Executor) -> None:
    assert ex.core.pool.num_free == ex.core.pool.num_blocks
    assert not ex.core.scheduler.running and not ex.core.scheduler.waiting


def spy_preemptions(ex: Executor) -> list:
    """Record every sequence the scheduler preempts (wraps the bound ``_preempt``)."""
    calls = []
    scheduler = ex.core.scheduler
    original = scheduler._preempt

    def spy(seq, out):
        calls.append(seq.seq_id)
        original(seq, out)

    scheduler._preempt = spy
    return calls


def mixed_requests(n: int, seed: int, sampled: bool) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        config = SamplingParams(temperature=0.8, top_k=20, seed=1000 + i) if sampled else None
        out.append(req([rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))], rng.randint(1, 24),
                       sampling_config=config))
    return out


# -- 1. in-flight batching ---------------------------------------------------------------------

@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_inflight_batching_matches_requests_run_alone(make_executor, sampled):
    ex = make_executor()
    requests = mixed_requests(50, seed=1 + sampled, sampled=sampled)
    alone = [run_alone(ex, r) for r in requests]
    assert [len(a) for a in alone] == [r.max_tokens for r in requests]

    rng = random.Random(7)
    ids = []
    for r in requests:  # arrive while others are mid-prefill or mid-decode
        ids.append(ex.enqueue_request(r))
        time.sleep(rng.random() * 0.004)
    got = collect(ex, ids)
    assert [final_tokens(got[rid]) for rid in ids] == alone
    for rid in ids:
        assert len(got[rid]) == 1 and got[rid][0].result.finish_reasons == ["length"]
    stats = ex.get_latest_iteration_stats()
    assert max(s.num_active_requests for s in stats) > 1, "the requests never overlapped"
    assert_pool_free(ex)


def test_native_and_reference_attention_agree(make_executor):
    """The native decode kernel and the PyTorch reference give the same greedy tokens."""
    requests = mixed_requests(12, seed=5, sampled=False)
    native, reference = (make_executor(ExecutorConfig(attention_backend=b)) for b in ("native", "torch"))
    assert type(native.core.runner.backend).__name__ == "NativePagedAttention"
    ids = [native.enqueue_request(r) for r in requests]
    got = collect(native, ids)
    assert [final_tokens(got[rid]) for rid in ids] == [run_alone(reference, r) for r in requests]


# -- 2. preemption -----------------------------------------------------------------------------

def _preemption_requests() -> list[Request]:
    rng = random.Random(3)
    out = []
    for i in range(8):  # 20 + 20 tokens: 10 blocks each
        config = SamplingParams(temperature=0.8, top_k=20, seed=i) if i % 2 else None
        out.append(req([rng.randrange(VOCAB) for _ in range(20)], 20, sampling_config=config))
    return out


@pytest.mark.parametrize("policy", ["MAX_UTILIZATION", "GUARANTEED_NO_EVICT"])
def test_small_kv_cache_completes_every_request(make_executor, policy):
    # 80 tokens = 20 blocks: two requests at full length, never all eight at once.
    ex = make_executor(ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=80), capacity_policy=policy))
    assert ex.core.pool.num_blocks == 80 // BLOCK
    requests = _preemption_requests()
    alone = [run_alone(ex, r) for r in requests]
    preempted = spy_preemptions(ex)
    ids = ex.enqueue_requests(requests)
    got = collect(ex, ids)
    assert [final_tokens(got[rid]) for rid in ids] == alone
    stats = ex.get_latest_iteration_stats()
    assert all(s.kv_blocks_used <= s.kv_blocks_total == 20 for s in stats)
    if policy == "MAX_UTILIZATION":
        assert preempted, "the cache was meant to be too small: nothing was preempted"
    else:
        assert preempted == []
    assert_pool_free(ex)


# -- 3. chunked context ------------------------------------------------------------------------

def test_prompt_longer_than_step_budget_matches_hf_generate(make_executor, tiny):
    hf, _ = tiny
    ex = make_executor()
    prompt = [random.Random(11).randrange(3, VOCAB) for _ in range(150)]
    ours = run_alone(ex, req(prompt, 12, end_id=2))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert ours == ref[0, len(prompt):].tolist()
    stats = ex.get_latest_iteration_stats()
    # 150 prompt tokens under a 64-token budget: 64 + 64 + 22 (with the first sampled token).
    assert [s.num_scheduled_tokens for s in stats[:3]] == [64, 64, 22]


# -- 4. streaming ------------------------------------------------------------------------------

def test_streaming_sends_only_new_tokens(make_executor):
    ex = make_executor()
    prompt = [5, 17, 99, 3, 42, 7, 250, 1, 8, 9]
    whole = run_alone(ex, req(prompt, 9))
    for exclude in (True, False):  # streaming never repeats the prompt
        rid = ex.enqueue_request(req(prompt, 9, streaming=True, output_config=OutputConfig(exclude)))
        responses = collect(ex, [rid])[rid]
        assert len(responses) == 9
        assert all(len(r.result.output_token_ids[0]) == 1 for r in responses)
        assert [t for r in responses for t in r.result.output_token_ids[0]] == whole
        assert [r.result.is_final for r in responses] == [False] * 8 + [True]
        assert [r.result.finish_reasons for r in responses] == [[None]] * 8 + [["length"]]
    with_prompt = run_alone(ex, req(prompt, 9, output_config=OutputConfig(exclude_input_from_output=False)))
    assert with_prompt == prompt + whole


# -- 5. bad requests ---------------------------------------------------------------------------

def test_bad_requests_get_errors_and_good_ones_complete(make_executor):
    ex = make_executor()
    good = [req([1, 2, 3, i], 6) for i in range(4)]
    alone = [run_alone(ex, r) for r in good]
    bad = [req([1, VOCAB + 5], 4), req([1, 2], 0), req([1, 2], 4, sampling_config=SamplingConfig(top_p=2.0))]
    mixed = [good[0], bad[0], good[1], bad[1], good[2], bad[2], good[3]]
    ids = ex.enqueue_requests(mixed)
    got = collect(ex, ids)
    errors = [got[rid] for rid in ids[1::2]]
    for responses, needle in zip(errors, ["outside the vocabulary", "max_tokens", "top_p"]):
        assert len(responses) == 1 and responses[0].has_error() and responses[0].result is None
        assert needle in responses[0].error_msg
    assert [final_tokens(got[rid]) for rid in ids[0::2]] == alone
    assert_pool_free(ex)


# -- 6. cancellation, timeouts, shutdown -------------------------------------------------------

def test_cancel_mid_stream_frees_every_block(make_executor):
    ex = make_executor()
    other = ex.enqueue_request(req(range(1, 30), 200))
    rid = ex.enqueue_request(req(range(40, 60), 200, streaming=True))
    first = ex.await_responses(rid, timeout=WAIT)
    assert first and not first[0].result.is_final
    ex.cancel_request(rid)
    ex.cancel_request(other)
    got = collect(ex, [rid, other])
    last = got[rid][-1]
    assert last.result.is_final and last.result.finish_reasons == ["cancelled"]
    streamed = [t for r in first + got[rid] for t in r.result.output_token_ids[0]]
    assert 1 <= len(streamed) < 200
    assert got[other][-1].result.finish_reasons == ["cancelled"]
    assert len(final_tokens(got[other])) < 200
    assert_pool_free(ex)
    ex.cancel_request(rid)  # cancelling a finished request is harmless
    assert ex.await_responses(rid, timeout=0.2) == []


def test_allotted_time_ends_with_timeout(make_executor):
    ex = make_executor()
    rid = ex.enqueue_request(req(range(1, 20), 200, allotted_time_ms=1))
    (response,) = collect(ex, [rid])[rid]
    assert response.result.is_final and response.result.finish_reasons == ["timeout"]
    assert len(response.result.output_token_ids[0]) < 200
    assert_pool_free(ex)


def test_shutdown_cancels_requests_in_flight(make_executor):
    ex = make_executor()
    ids = [ex.enqueue_request(req(range(i, i + 30), 200, streaming=True)) for i in range(1, 5)]
    assert ex.await_responses(ids, timeout=WAIT), "nothing started"
    ids += ex.enqueue_requests([req(range(i, i + 10), 200) for i in range(3)])  # maybe not yet admitted
    started = time.monotonic()
    ex.shutdown()
    assert time.monotonic() - started < 2.0
    got = collect(ex, ids, timeout=1.0)
    for rid in ids:
        last = got[rid][-1]
        assert not last.has_error() and last.result.is_final and last.result.finish_reasons == ["cancelled"]
    with pytest.raises(KilnError, match="shut down"):
        ex.enqueue_request(req([1, 2, 3], 4))
    with pytest.raises(KilnError, match="shut down"):
        ex.await_responses(ids, timeout=0.1)
    ex.shutdown()  # twice is fine


# -- 7. priority -------------------------------------------------------------------------------

def test_high_priority_request_overtakes_earlier_low_priority_ones(make_executor):
    ex = make_executor(ExecutorConfig(max_batch_size=1))
    requests = [req([10 + i, 20, 30], 8, priority=0.2) for i in range(4)] + [req([99, 98], 8, priority=0.9)]
    ids = ex.enqueue_requests(requests)
    order = []
    deadline = time.monotonic() + WAIT
    while len(order) < len(ids) and time.monotonic() < deadline:
        for r in ex.await_responses(ids, timeout=1.0):
            assert not r.has_error(), r.error_msg
            if r.result.is_final:
                order.append(r.request_id)
    assert order == [ids[4]] + ids[:4]  # the high one first, then FCFS


# -- 8. asyncio --------------------------------------------------------------------------------

def test_generate_async_streams_and_ends_with_a_final_response(make_executor):
    ex = make_executor()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    whole = run_alone(ex, req(prompt, 7))

    async def run(request):
        return [r async for r in ex.generate_async(request)]

    streamed = asyncio.run(run(req(prompt, 7, streaming=True)))
    assert [r.result.is_final for r in streamed] == [False] * 6 + [True]
    assert streamed[-1].result.finish_reasons == ["length"]
    assert [t for r in streamed for t in r.result.output_token_ids[0]] == whole
    (single,) = asyncio.run(run(req(prompt, 7)))
    assert single.result.is_final and single.result.output_token_ids == [whole]
    (error,) = asyncio.run(run(req([VOCAB], 3)))
    assert error.has_error()
    assert_pool_free(ex)


# -- 9. iteration stats ------------------------------------------------------------------------

def test_iteration_stats_add_up(make_executor):
    ex = make_executor(ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=400)))
    rng = random.Random(5)
    requests = [req([rng.randrange(VOCAB) for _ in range(rng.randint(1, 150))], rng.randint(1, 10))
                for _ in range(12)]
    ids = ex.enqueue_requests(requests)
    collect(ex, ids)
    stats = ex.get_latest_iteration_stats()
    assert stats, "no iteration recorded"
    assert [s.iteration for s in stats] == list(range(stats[0].iteration, stats[0].iteration + len(stats)))
    for s in stats:
        assert s.kv_blocks_total == ex.core.pool.num_blocks == 100
        assert s.kv_blocks_used + s.kv_blocks_free == s.kv_blocks_total
        assert 0 <= s.kv_blocks_used <= s.kv_blocks_total
        assert 1 <= s.num_scheduled_tokens <= MAX_NUM_TOKENS
        assert s.step_ms >= 0 and s.num_active_requests <= len(requests)
    assert max(s.num_scheduled_tokens for s in stats) == MAX_NUM_TOKENS  # the budget got used fully
    assert stats[-1].num_active_requests == 0 and stats[-1].kv_blocks_used == 0
    assert ex.get_latest_iteration_stats() == []  # each call returns only what is new


# -- 10. no block leak -------------------------------------------------------------------------

def test_many_short_requests_leave_the_pool_free(make_executor):
    ex = make_executor(ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=160)))
    rng = random.Random(9)
    requests = [req([rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))], rng.randint(1, 6),
                    streaming=rng.random() < 0.3) for _ in range(200)]
    ids = []
    for i in range(0, 200, 25):
        ids += ex.enqueue_requests(requests[i:i + 25])
        ex.cancel_request(ids[-3])  # some cancelled whenever they happen to be
    got = collect(ex, ids)
    reasons = [got[rid][-1].result.finish_reasons[0] for rid in ids]
    assert set(reasons) <= {"length", "cancelled"} and reasons.count("length") >= 190
    for rid, r in zip(ids, requests):
        if got[rid][-1].result.finish_reasons == ["length"]:
            tokens = [t for x in got[rid] for t in x.result.output_token_ids[0]] if r.streaming \
                else final_tokens(got[rid])
            assert len(tokens) == r.max_tokens
    assert_pool_free(ex)


# -- 7. fault isolation --------------------------------------------------------------------------

POISON = VOCAB - 1  # a prompt starting with it trips the injected fault


def _poisoned(seqs) -> bool:
    return any(s.token_ids[0] == POISON for s in seqs)


def _inject(monkeypatch, ex: Executor, phase: str) -> None:
    """Make ``phase`` raise for (only) the sequences whose prompt starts with POISON."""
    from kiln.runtime import model_runner
    from kiln.runtime.sequence import Sequence

    def fault(*_):
        raise RuntimeError(f"injected {phase} fault")

    if phase == "admission":
        add = ex.core.add_request
        monkeypatch.setattr(ex.core, "add_request",
                            lambda ids, *a, **kw: fault() if ids[0] == POISON else add(ids, *a, **kw))
    elif phase == "forward":
        run = ex.core.runner.run_step
        monkeypatch.setattr(ex.core.runner, "run_step",
                            lambda step: fault() if POISON in step.input_ids else run(step))
    elif phase == "sampling":
        sample = model_runner.sample
        monkeypatch.setattr(model_runner, "sample", lambda logits, seqs: fault() if _poisoned(seqs)
                            else sample(logits, seqs))
    elif phase == "update":
        append = Sequence.append_token
        monkeypatch.setattr(Sequence, "append_token", lambda seq, *a: fault() if _poisoned([seq])
                            else append(seq, *a))
    elif phase == "output":
        result = ex._result
        monkeypatch.setattr(ex, "_result", lambda tracked, final: fault()
                            if tracked.request.input_token_ids[0] == POISON else result(tracked, final))


@pytest.mark.parametrize("phase", ["admission", "forward", "sampling", "update", "output"])
@pytest.mark.parametrize("streaming", [False, True], ids=["final", "streaming"])
def test_a_request_failing_inside_the_engine_fails_alone(make_executor, monkeypatch, phase, streaming):
    """An exception while admitting, computing, sampling, advancing or answering one request
    gives that request an internal error; the requests batched with it get what they get alone,
    every KV block comes back, and the executor goes on serving."""
    ex = make_executor()
    config = SamplingParams(temperature=0.8, top_k=20, seed=5)
    good = [req([3, 4, 5, i], 8, sampling_config=config, streaming=streaming) for i in range(3)]
    alone = [run_alone(ex, req(r.input_token_ids, 8, sampling_config=config)) for r in good]
    _inject(monkeypatch, ex, phase)
    ids = ex.enqueue_requests([good[0], req([POISON, 1, 2], 8, streaming=streaming), good[1], good[2]])
    got = collect(ex, ids)
    error = got[ids[1]][-1]
    assert error.has_error() and error.internal_error and f"injected {phase} fault" in error.error_msg
    tokens = [[t for r in got[rid] for t in r.result.output_token_ids[0]] if streaming else final_tokens(got[rid])
              for rid in (ids[0], ids[2], ids[3])]
    assert tokens == alone
    assert ex.failure is None
    assert_pool_free(ex)
    assert run_alone(ex, req(good[0].input_token_ids, 8, sampling_config=config)) == alone[0]


def test_an_invalid_request_found_mid_step_is_a_request_error(make_executor):
    """Bans that leave no token to draw fail that request (not the engine) with a client error."""
    ex = make_executor()
    everything = SamplingParams(temperature=0, bad_words_ids=[[t] for t in range(VOCAB)])
    ids = ex.enqueue_requests([req([1, 2, 3], 4, sampling_config=everything), req([1, 2, 3], 4)])
    got = collect(ex, ids)
    assert got[ids[0]][-1].has_error() and not got[ids[0]][-1].internal_error
    assert "every token is banned" in got[ids[0]][-1].error_msg
    assert len(final_tokens(got[ids[1]])) == 4
    assert ex.failure is None
    assert_pool_free(ex)


def test_an_engine_failing_every_request_stops_and_says_so(make_executor, monkeypatch):
    """When every request of a step fails alone too, the engine is at fault: the executor stops
    with that error (so a server's health check reports it) instead of failing requests forever."""
    ex = make_executor()

    def broken(step):
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(ex.core.runner, "run_step", broken)
    ids = ex.enqueue_requests([req([1, 2, 3], 4), req([4, 5, 6], 4)])
    got = collect(ex, ids)
    assert all(got[rid][-1].has_error() for rid in ids)
    assert isinstance(ex.failure, RuntimeError) and "broken" in str(ex.failure)
    with pytest.raises(KilnError, match="stopped after an internal error"):
        ex.enqueue_request(req([1, 2], 2))


def test_full_64_bit_seeds_are_served(make_executor):
    """Seeds anywhere in [-2**63, 2**64) sample; the samples of one request wrap past 2**64 - 1."""
    ex = make_executor()
    ids = ex.enqueue_requests([req([1, 2, 3], 4, sampling_config=SamplingParams(temperature=1.0, seed=seed, n=2))
                               for seed in (2**64 - 1, -2**63)])
    got = collect(ex, ids)
    assert all(len(final_tokens(got[rid])) == 4 for rid in ids)
