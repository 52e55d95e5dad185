"""Prefix caching on hybrid models: recurrent states kept at block boundaries let a sequence start
after a cached prefix (kiln.runtime.state_prefix_cache), and give the tokens an engine without
prefix caching gives."""
from __future__ import annotations

import pytest

from kiln.runtime.block_pool import BlockPool
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence
from kiln.runtime.state_prefix_cache import StatePrefixCache
from tests.models.zoo import built_fixture
from tests.utils import tiny_hybrid_models as tiny

CASES = {
    "lfm2": (tiny.make_lfm2, {}, {"tokens_per_block": 4}),
    "qwen3.5": (tiny.make_qwen3_5, {}, {"tokens_per_block": 4}),
    "granite-hybrid": (tiny.make_granite_hybrid, {}, {"tokens_per_block": 4}),
}
built = built_fixture(CASES)

PROMPT = [5, 17, 42, 99, 3, 64, 8, 120, 33, 71, 12, 200, 9]  # 13 tokens: 3 full blocks of 4 and one more


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    requests = [core.add_request(p, params, end_id=None) for p in prompts]
    while core.has_unfinished:
        core.step()
    return [r.seqs[0].output_token_ids for r in requests]


def assert_all_returned(core: EngineCore) -> None:
    states = core.scheduler.states
    assert core.pool.num_free == core.pool.num_blocks and states.num_free_pairs * 2 == states.num_slots


@pytest.mark.parametrize("name", list(CASES))
def test_a_follow_up_starts_after_its_cached_prefix(built, name: str) -> None:
    """A conversation's next turn (the first prompt, its answer, a new message) takes the blocks
    up to the last boundary the first sequence's state was saved at and computes the rest; the
    same prompt again takes all but its last block; both give what no prefix caching gives."""
    engine = Engine(built(name).engine_dir)
    cached = EngineCore(engine, max_num_seqs=4, num_blocks=64, enable_prefix_caching=True)
    plain = EngineCore(engine, max_num_seqs=4, num_blocks=64)
    (answer,) = run(cached, [PROMPT], greedy(10))
    assert [answer] == run(plain, [PROMPT], greedy(10))
    # 22 tokens computed (13 prompt, 9 generated): states kept at 12 (the prompt's chunk is cut
    # there) and 20 (the one at 16 replaced by it)
    assert cached.scheduler.state_cache.num_cached == 2
    hits = cached.pool.num_hit_blocks
    assert run(cached, [PROMPT], greedy(10)) == [answer]
    assert cached.pool.num_hit_blocks - hits == 3
    follow_up = PROMPT + answer + [7, 77, 150, 31, 4]
    hits = cached.pool.num_hit_blocks
    assert run(cached, [follow_up], greedy(8)) == run(plain, [follow_up], greedy(8))
    assert cached.pool.num_hit_blocks - hits == 5  # 20 of 28 tokens taken from the cache
    assert_all_returned(cached)


def test_speculative_decoding_with_prefix_caching_is_plain_greedy(built) -> None:
    """n-gram proposals verified on a hybrid model with prefix caching on (a verifying chunk is
    never cut at a block boundary): plain greedy's tokens, a second run starting from the cache."""
    engine = Engine(built("lfm2").engine_dir)
    repetitive = [5, 17, 42, 99, 3] * 4
    expected = run(EngineCore(engine, max_num_seqs=2, num_blocks=64), [repetitive], greedy(24))
    spec = EngineCore(engine, max_num_seqs=2, num_blocks=64, enable_prefix_caching=True,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert run(spec, [repetitive], greedy(24)) == expected
    assert run(spec, [repetitive], greedy(24)) == expected and spec.pool.num_hit_blocks > 0
    assert spec.stats.spec.num_drafts > 0
    assert_all_returned(spec)


def test_chunk_ends_save_states_and_evicted_ones_are_not_used(built) -> None:
    """A long prompt prefilled in chunks of 8 saves a state at each chunk's end (each replacing
    the last) and where its last chunk is cut at its last full block; with two checkpoint slots,
    later sequences push the oldest out, and a prompt sharing a prefix then starts only as far
    as a state is left, still giving the plain engine's tokens."""
    engine = Engine(built("qwen3.5").engine_dir)
    cached = EngineCore(engine, max_num_seqs=4, max_num_tokens=8, num_blocks=64, enable_prefix_caching=True)
    plain = EngineCore(engine, max_num_seqs=4, max_num_tokens=8, num_blocks=64)
    long = [(7 * i + 3) % 250 + 1 for i in range(30)]
    shares = long[:26] + [9, 9, 9]
    assert run(cached, [long], greedy(2)) == run(plain, [long], greedy(2))
    assert cached.scheduler.state_cache.num_cached == 2  # at 24 (after 8 and 16) and 28
    hits = cached.pool.num_hit_blocks
    assert run(cached, [shares], greedy(4)) == run(plain, [shares], greedy(4))
    assert cached.pool.num_hit_blocks - hits == 6  # 24 tokens: the last state kept within 26 shared
    for seed in range(3):  # other prompts take every checkpoint slot
        other = [(11 * i + seed) % 250 + 1 for i in range(17)]
        assert run(cached, [other, other[::-1]], greedy(5)) == run(plain, [other, other[::-1]], greedy(5))
    hits = cached.pool.num_hit_blocks
    assert run(cached, [shares], greedy(4)) == run(plain, [shares], greedy(4))
    assert cached.pool.num_hit_blocks == hits  # its blocks are still cached, its states are not
    assert_all_returned(cached)


def test_a_saved_state_is_findable_only_after_the_step_that_copies_it() -> None:
    """The copy runs at the start of the next step; a sequence scheduled before that must not
    start from the checkpoint, which does not hold the state yet."""
    pool = BlockPool(8, enable_caching=True)
    cache = StatePrefixCache(range(4, 6), block_size=4)
    seq = Sequence(0, list(range(10)), greedy(1), end_id=None, max_seq_len=64)
    seq.block_ids, seq.num_computed_tokens, seq.state_slots = pool.allocate(2), 8, [0, 1]
    pool.register_full_blocks(seq, 4)
    copies: list[tuple[int, int]] = []
    cache.after_compute(seq, copies)
    assert copies == [(0, 4)]  # the sequence's current slot into the lowest checkpoint
    later = Sequence(1, list(range(12)), greedy(1), end_id=None, max_seq_len=64)

    def found() -> int:
        blocks, hashes = pool.take_cached_prefix(later.token_ids, 4, 2)
        kept, _ = cache.take_prefix(later, blocks, hashes, pool)
        pool.free(kept)
        return len(kept)

    assert found() == 0
    cache.scheduled(runs=True)  # the step that copies it is scheduled
    assert found() == 0
    cache.scheduled(runs=True)  # ... and has run
    assert found() == 2 and later.state_restore == 4
