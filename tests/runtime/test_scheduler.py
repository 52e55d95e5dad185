"""Scheduler properties, driven by a fake runner (no model): budgets, blocks, preemption, chunking."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.errors import CapacityError
from kiln.runtime.block_pool import BlockPool
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import FinishReason, Sequence
from tests.utils.fakes import FakeRunner, fake_token


def make_seq(seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Sequence(seq_id, [(seq_id + i) % 97 for i in range(prompt_len)], params, end_id=None,
                    max_seq_len=100_000)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def check_blocks(scheduler: Scheduler, pool: BlockPool, block_size: int) -> None:
    """Running sequences own disjoint blocks covering their K/V; waiting ones own none."""
    owned = [b for s in scheduler.running for b in s.block_ids]
    assert len(owned) == len(set(owned)), "a block is owned by two running sequences"
    assert all(pool.ref_count(b) == 1 for b in owned)
    assert pool.num_free + len(owned) == pool.num_blocks, "blocks leaked or double counted"
    for s in scheduler.running:
        assert len(s.block_ids) >= blocks_for(s.num_computed_tokens, block_size)
    assert all(not s.block_ids and s.num_computed_tokens == 0 for s in scheduler.waiting)


requests = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=6)
# Half the pools are as tight as allowed: just the largest request fits.


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests, block_size=st.sampled_from([1, 4, 16]), roominess=st.one_of(st.just(0.0), st.floats(0, 1)),
       max_num_tokens=st.integers(1, 512), max_num_seqs=st.integers(1, 8))
def test_random_request_mixes_run_to_completion(requests, block_size, roominess, max_num_tokens, max_num_seqs):
    """Any mix finishes with the right tokens while every budget and block invariant holds each step.

    The pool ranges from just enough for the largest request (forcing preemption) to enough
    for all of them at once.
    """
    needs = [blocks_for(p + m, block_size) for p, m in requests]
    num_blocks = max(needs) + round(roominess * (sum(needs) - max(needs)))
    pool = BlockPool(num_blocks)
    scheduler = Scheduler(pool, block_size, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens)
    seqs = [make_seq(i, p, m) for i, (p, m) in enumerate(requests)]
    for s in seqs:
        scheduler.add(s)
    runner = FakeRunner()
    next_start = {s.seq_id: 0 for s in seqs}  # where the next chunk of each sequence must begin
    total_work = sum(p + m for p, m in requests)

    for _ in range(50 * total_work):
        if not scheduler.has_unfinished:
            break
        out = scheduler.schedule()
        assert out.chunks, "a step scheduled nothing although work is queued"
        assert out.num_tokens <= max_num_tokens
        assert len(out.chunks) <= max_num_seqs and len(scheduler.running) <= max_num_seqs
        assert len({c.seq.seq_id for c in out.chunks}) == len(out.chunks)
        for s in out.preempted:
            next_start[s.seq_id] = 0
        for c in out.chunks:
            s = c.seq
            assert c.num_tokens >= 1
            assert s.num_computed_tokens == next_start[s.seq_id], "chunks of a sequence are not contiguous"
            assert s.num_computed_tokens + c.num_tokens <= s.num_tokens
            assert len(s.block_ids) >= blocks_for(s.num_computed_tokens + c.num_tokens, block_size)
            next_start[s.seq_id] += c.num_tokens
        check_blocks(scheduler, pool, block_size)
        scheduler.update(out, runner.execute(out))
        check_blocks(scheduler, pool, block_size)
        for c in out.chunks:
            # A sequence that caught up sampled a token; the next chunk starts after what was computed.
            assert next_start[c.seq.seq_id] == c.seq.num_computed_tokens
    else:
        pytest.fail("the requests did not finish")

    assert pool.num_free == pool.num_blocks
    for s, (prompt_len, max_tokens) in zip(seqs, requests):
        assert s.finish_reason is FinishReason.LENGTH
        # Each output token is the one sampled when the sequence held prompt_len + k tokens:
        # recomputation after preemption neither loses nor repeats tokens.
        assert s.output_token_ids == [fake_token(s.seq_id, prompt_len + k) for k in range(max_tokens)]


def test_request_larger_than_the_whole_pool_is_rejected_at_add():
    """A request that could never fit raises CapacityError at add and is not queued."""
    scheduler = Scheduler(BlockPool(4), block_size=4, max_num_seqs=2, max_num_tokens=64)
    with pytest.raises(CapacityError, match="5 KV blocks"):
        scheduler.add(make_seq(0, prompt_len=10, max_tokens=10))  # 20 tokens -> 5 blocks of 4
    assert not scheduler.has_unfinished
    scheduler.add(make_seq(1, prompt_len=10, max_tokens=6))  # exactly 4 blocks is fine
    assert scheduler.has_unfinished


def test_long_prompt_is_prefilled_in_chunks():
    """A 100-token prompt under a 16-token budget takes 6 full chunks and a last one of 4; then it samples."""
    scheduler = Scheduler(BlockPool(64), block_size=4, max_num_seqs=4, max_num_tokens=16)
    seq = make_seq(0, prompt_len=100, max_tokens=2)
    scheduler.add(seq)
    runner = FakeRunner()
    for _ in range(7):
        scheduler.update(out := scheduler.schedule(), runner.execute(out))
    assert runner.calls == [[(0, start, 16)] for start in range(0, 96, 16)] + [[(0, 96, 4)]]
    assert seq.output_token_ids == [fake_token(0, 100)]
    assert len(seq.block_ids) == blocks_for(100, 4)


def test_mixed_step_holds_a_prompt_chunk_and_decode_tokens():
    """Running sequences decode one token each while a new prompt is chunked into the leftover budget."""
    scheduler = Scheduler(BlockPool(64), block_size=4, max_num_seqs=4, max_num_tokens=8)
    a, b = make_seq(0, prompt_len=3, max_tokens=10), make_seq(1, prompt_len=2, max_tokens=10)
    scheduler.add(a)
    scheduler.add(b)
    runner = FakeRunner()
    scheduler.update(out := scheduler.schedule(), runner.execute(out))  # both prompts whole
    assert a.num_output_tokens == b.num_output_tokens == 1
    c = make_seq(2, prompt_len=50, max_tokens=3)
    scheduler.add(c)
    scheduler.update(out := scheduler.schedule(), runner.execute(out))
    assert runner.calls[-1] == [(0, 3, 1), (1, 2, 1), (2, 0, 6)]
    assert [s.num_output_tokens for s in (a, b, c)] == [2, 2, 0]


def test_preemption_frees_the_newest_sequence_and_recomputes_it():
    """When blocks run out, the most recently admitted sequence is preempted and later recomputed."""
    scheduler = Scheduler(BlockPool(3), block_size=2, max_num_seqs=2, max_num_tokens=64)
    a, b = make_seq(0, prompt_len=2, max_tokens=4), make_seq(1, prompt_len=2, max_tokens=2)
    scheduler.add(a)
    scheduler.add(b)
    runner = FakeRunner()
    scheduler.update(out := scheduler.schedule(), runner.execute(out))  # a: 1 block, b: 1 block
    out = scheduler.schedule()  # a needs a 2nd block (takes the last free one); b needs one too
    assert out.preempted == [b] and b.block_ids == [] and b.num_computed_tokens == 0
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(0, 1)]
    scheduler.update(out, runner.execute(out))
    while scheduler.has_unfinished:
        scheduler.update(out := scheduler.schedule(), runner.execute(out))
    assert (1, 0, 3) in [call for step in runner.calls for call in step]  # b recomputed prompt + its token
    assert b.output_token_ids == [fake_token(1, 2), fake_token(1, 3)]
    assert scheduler.pool.num_free == 3
