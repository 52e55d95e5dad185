"""A model whose every layer attends to a sliding window gives the KV blocks behind the
window back to the pool: a sequence holds about a window and a step of cache however long it
grows, and its tokens stay HF's (Mistral with an 8-token window, 4-token blocks)."""
from __future__ import annotations

import pytest

from kiln.errors import CapacityError
from kiln.runtime.block_pool import RELEASED, BlockPool
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.kv_blocks import common_window
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence
from tests.conftest import convert_and_build
from tests.models.zoo import random_prompt
from tests.utils.compare import hf_greedy
from tests.utils.tiny_attention_models import make_gemma2, make_mistral_windowed

PROMPT_LENS, NEW_TOKENS = (20, 5), 40
BACKENDS = ["torch", "native"]  # the native kernels build here (tests/runtime/test_native_attention.py)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("window-release")
    hf = make_mistral_windowed(root / "hf", window=8)
    engine = convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4, "max_beam_width": 2},
                               dtype="float32")
    prompts = [random_prompt(n, 256, seed=n) for n in PROMPT_LENS]
    return Engine(engine), prompts, hf_greedy(hf, prompts, NEW_TOKENS)


def generate(core: EngineCore, prompts: list[list[int]], **params) -> tuple[list[list[int]], int]:
    """Greedy outputs of ``prompts`` decoded together, and the most blocks in use at once."""
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **params)
    requests = [core.add_request(p, sampling, end_id=None) for p in prompts]
    peak = 0
    while core.has_unfinished:
        core.step()
        peak = max(peak, core.pool.num_blocks - core.pool.num_free)
    return [[h.token_ids for h in r.hypotheses] if r.hypotheses else r.seqs[0].output_token_ids
            for r in requests], peak


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_generation_in_a_cache_smaller_than_the_sequences(mistral, backend: str) -> None:
    """Two sequences of 60 and 45 tokens (26 blocks without release) run in 12 blocks, chunked
    8 tokens a step, and give HF's greedy tokens."""
    engine, prompts, expected = mistral
    core = EngineCore(engine, max_num_seqs=2, max_num_tokens=8, num_blocks=12, attention_backend=backend)
    assert core.scheduler.window == 8 and core.scheduler.peak_blocks(Sequence(0, [1] * 20, SamplingParams(
        max_tokens=NEW_TOKENS), None, 64)) == 5
    outputs, peak = generate(core, prompts)
    assert outputs == expected
    assert peak <= 10 and core.pool.num_free == 12


def test_prefix_cache_and_release_together(mistral) -> None:
    """With prefix caching the released blocks stay findable: a second run of the same prompts
    reuses their first blocks and still matches HF."""
    engine, prompts, expected = mistral
    core = EngineCore(engine, max_num_seqs=2, max_num_tokens=8, num_blocks=64, enable_prefix_caching=True)
    assert generate(core, prompts)[0] == expected
    hits = core.pool.num_hit_blocks
    assert generate(core, prompts)[0] == expected
    assert core.pool.num_hit_blocks > hits


def test_beam_search_with_released_blocks_equals_a_roomy_cache(mistral) -> None:
    """Beams fork tables that hold released entries; their results equal those of a cache
    that releases nothing."""
    engine, prompts, _ = mistral
    tight = EngineCore(engine, max_num_seqs=4, max_num_tokens=8, num_blocks=24)
    roomy = EngineCore(engine, max_num_seqs=4, max_num_tokens=8, num_blocks=64)
    roomy.scheduler.window = None  # keeps every block
    params = dict(use_beam_search=True, n=2)
    ours, peak = generate(tight, prompts[1:], **params)
    theirs, roomy_peak = generate(roomy, prompts[1:], **params)
    assert ours == theirs and len(ours[0]) == 2
    assert peak < roomy_peak // 2 and tight.pool.num_free == 24


def test_release_frees_whole_blocks_behind_the_window() -> None:
    """After computing 30 tokens with a window of 8 (blocks of 4), the next token reads from
    position 23 on: blocks 0-4 (positions 0-19) go back (position 22 is kept for a beam's
    recompute), blocks 5-7 stay; freeing the sequence passes over the released entries."""
    pool = BlockPool(10)
    scheduler = Scheduler(pool, 4, max_num_seqs=1, max_num_tokens=8, window=8)
    seq = Sequence(0, list(range(30)), SamplingParams(max_tokens=1), None, 64)
    seq.block_ids = pool.allocate(8)
    seq.num_computed_tokens = 30
    scheduler._release_out_of_window(seq)
    assert seq.block_ids[:5] == [RELEASED] * 5 and RELEASED not in seq.block_ids[5:]
    assert pool.num_free == 2 + 5
    scheduler.running.append(seq)
    scheduler.finish(seq)
    assert pool.num_free == 10


def test_only_models_windowed_everywhere_release(tmp_path, mistral) -> None:
    """Gemma 2 alternates windowed and full layers: no block is ever behind every layer's
    window, so nothing is released and a sequence needs blocks for all its tokens."""
    hf_dir = tmp_path / "gemma2"
    make_gemma2(hf_dir)
    gemma2 = Engine(convert_and_build(hf_dir, tmp_path / "kiln", {"tokens_per_block": 4}, dtype="float32"))
    assert common_window(gemma2.model) is None and common_window(mistral[0].model) == 8
    core = EngineCore(gemma2, max_num_seqs=1, max_num_tokens=8, num_blocks=8)
    with pytest.raises(CapacityError, match="KV cache holds 8 blocks"):
        core.add_request(list(range(20)), SamplingParams(max_tokens=NEW_TOKENS), end_id=None)
