"""Prefix caching: full KV blocks reused across sequences by chained content hash."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.runtime.block_pool import BlockPool
from kiln.runtime.executor import Executor, ExecutorConfig, KvCacheConfig, Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence
from tests.utils.fakes import FakeRunner
from tests.utils.tiny_models import make_llama


def seq(seq_id: int, tokens: list[int], max_tokens: int = 3) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0), None, 100_000)


def run_all(scheduler: Scheduler, runner: FakeRunner) -> None:
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out))


def test_shared_prefix_blocks_are_taken_not_recomputed():
    """A second prompt sharing two full blocks starts computing after them, on the same blocks."""
    pool = BlockPool(32, enable_caching=True)
    scheduler = Scheduler(pool, 4, max_num_seqs=4, max_num_tokens=64)
    runner = FakeRunner()
    first = seq(0, list(range(10)))
    scheduler.add(first)
    run_all(scheduler, runner)
    second = seq(1, list(range(8)) + [50, 51, 52])
    scheduler.add(second)
    out = scheduler.schedule()
    (chunk,) = out.chunks
    assert second.num_computed_tokens == 8 and chunk.num_tokens == 3  # blocks [0..3], [4..7] reused
    assert pool.num_hit_blocks == 2
    scheduler.update(out, runner.execute(out))
    run_all(scheduler, runner)
    assert pool.num_free == pool.num_blocks


def test_a_fully_cached_prompt_still_computes_its_last_token():
    pool = BlockPool(16, enable_caching=True)
    scheduler = Scheduler(pool, 4, max_num_seqs=4, max_num_tokens=64)
    runner = FakeRunner()
    scheduler.add(seq(0, list(range(8))))
    run_all(scheduler, runner)
    again = seq(1, list(range(8)))
    scheduler.add(again)
    out = scheduler.schedule()
    assert out.chunks[0].num_tokens == 4 and again.num_computed_tokens == 4  # the last block is recomputed
    scheduler.update(out, runner.execute(out))


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, 1, (1,))
    pool.register(b, 2, (2,))
    pool.free([a])
    pool.free([b])
    assert pool.num_cached == 2
    (c,) = pool.allocate(1)  # the two never-used blocks go first
    (d,) = pool.allocate(1)
    assert {c, d}.isdisjoint({a, b}) and pool.num_cached == 2
    (e,) = pool.allocate(1)
    assert e == a and pool.num_cached == 1  # then the least recently freed cached block


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.integers(0, 3), min_size=2, max_size=8), block_size=st.sampled_from([1, 2, 4]),
       extra=st.integers(0, 20), max_num_tokens=st.integers(1, 64))
def test_random_shared_prefixes_keep_every_invariant(prompts, block_size, extra, max_num_tokens):
    """Prompts drawn from 4 families with shared prefixes: outputs equal a cache-free run, no leak."""
    families = [[f * 10 + i % 7 for i in range(30)] for f in range(4)]

    def outputs(caching: bool) -> list[list[int]]:
        pool = BlockPool(64 + extra, enable_caching=caching)
        scheduler = Scheduler(pool, block_size, max_num_seqs=3, max_num_tokens=max_num_tokens)
        seqs = [seq(i, families[f][: 5 + 3 * i % 20]) for i, f in enumerate(prompts)]
        for s in seqs:
            scheduler.add(s)
        run_all(scheduler, FakeRunner())
        assert pool.num_free == pool.num_blocks
        return [s.output_token_ids for s in seqs]

    assert outputs(True) == outputs(False)


def test_executor_reuses_a_shared_prefix_with_identical_output(tmp_path):
    """Through the model: the second request hits the cache (stats) and greedy output is unchanged."""
    from tests.conftest import convert_and_build

    make_llama(tmp_path / "hf")
    engine = convert_and_build(tmp_path / "hf", tmp_path / "work", build_options=dict(tokens_per_block=4))
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(40)]
    prompts = [system + [rng.randrange(256) for _ in range(n)] for n in (5, 9, 3)]

    def run(reuse: bool) -> tuple[list[list[int]], float]:
        executor = Executor(engine, ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=512,
                                                                                enable_block_reuse=reuse)))
        try:
            outs = []
            for p in prompts:  # one after another, so later ones can hit what earlier ones cached
                rid = executor.enqueue_request(Request(input_token_ids=p, max_tokens=12))
                (response,) = executor.await_responses(rid, timeout=60)
                outs.append(response.result.output_token_ids[0])
            stats = executor.get_latest_iteration_stats()
            pool = executor.core.pool
            assert pool.num_free == pool.num_blocks
            return outs, stats[-1].prefix_cache_hit_rate
        finally:
            executor.shutdown()

    cached, hit_rate = run(True)
    plain, no_hits = run(False)
    assert hit_rate > 0.5 and no_hits == 0.0
    assert cached == plain
