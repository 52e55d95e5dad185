"""The two-level LoRA cache, and LoRA requests through the executor (reference 004)."""
from __future__ import annotations

import pytest

from kiln import SamplingParams
from kiln.bench.common import random_lora_modules
from kiln.checkpoint.lora import pack_lora_tensors
from kiln.errors import RequestError
from kiln.layers.lora import LoraAdapter
from kiln.models.lora_targets import lora_module_shapes
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.executor import Executor, ExecutorConfig, OutputConfig, Request
from kiln.runtime.lora_cache import LoraCache, LoraCacheConfig, LoraConfig
from tests.conftest import convert_and_build
from tests.utils.fakes import llama_config
from tests.utils.tiny_models import make_llama

MODEL = llama_config(hidden=4, heads=2, kv_heads=2, head=2, inter=8, layers=4)


def _tensors(config, rank: int, seed: int, modules=("attn_q", "attn_v", "mlp_4h_to_h")):
    """A random adapter (every layer, the given modules) as reference weights and config."""
    return pack_lora_tensors(random_lora_modules(config, rank, modules, seed, scale=0.3))


def _bytes(rank: int) -> int:  # float32 A and B of the three modules above, in all 4 layers
    return 4 * 4 * (rank * 4 + 4 * rank + rank * 4 + 4 * rank + rank * 8 + 4 * rank)


def test_put_get_and_an_unknown_task_id():
    cache = LoraCache(MODEL)
    cache.put(1, *_tensors(MODEL, 2, 0))
    assert isinstance(cache.get(1), LoraAdapter) and cache.host_bytes == _bytes(2)
    with pytest.raises(RequestError, match="task_id 5 is not in the LoRA cache"):
        cache.get(5)
    weights, config = _tensors(MODEL, 2, 0)
    config[0, 1] = 9
    with pytest.raises(RequestError, match=r"task_id 2\): LoRA config row 0 .*layer_idx 9"):
        cache.put(2, weights, config)
    with pytest.raises(RequestError, match="task_id must be an integer"):
        cache.get(-1)


def test_host_level_evicts_the_least_recently_used_within_its_bytes():
    cache = LoraCache(MODEL, LoraCacheConfig(host_cache_bytes=3 * _bytes(2), device_cache_slots=4))
    for task in (1, 2, 3):
        cache.put(task, *_tensors(MODEL, 2, task))
    cache.get(1)  # 2 is now the least recently used
    cache.put(4, *_tensors(MODEL, 2, 4))
    assert [t for t in (1, 2, 3, 4) if t in cache._host] == [1, 3, 4]
    assert cache.host_bytes <= 3 * _bytes(2) and cache.stats().evictions == 1
    with pytest.raises(RequestError, match="more than the whole host cache"):
        cache.put(9, *_tensors(MODEL, 8, 9))


def test_an_adapter_in_use_is_never_evicted():
    cache = LoraCache(MODEL, LoraCacheConfig(host_cache_bytes=2 * _bytes(2), device_cache_slots=2))
    cache.put(1, *_tensors(MODEL, 2, 1))
    cache.put(2, *_tensors(MODEL, 2, 2))
    assert cache.acquire(1) is not None and cache.acquire(2) is not None  # both running
    with pytest.raises(RequestError, match="full of adapters running requests use"):
        cache.put(3, *_tensors(MODEL, 2, 3))
    cache.release(2)
    cache.put(3, *_tensors(MODEL, 2, 3))  # evicts 2, the one no request holds
    assert 1 in cache._host and 2 not in cache._host and 3 in cache._host
    with pytest.raises(RequestError, match="running requests use this task id"):
        cache.put(1, *_tensors(MODEL, 2, 5))


def test_device_slots_bound_the_adapters_running_at_once():
    cache = LoraCache(MODEL, LoraCacheConfig(device_cache_slots=2))
    for task in (1, 2, 3):
        cache.put(task, *_tensors(MODEL, 2, task))
    assert cache.acquire(1) is not None and cache.acquire(2) is not None
    assert cache.acquire(3) is None  # both slots held: the request waits
    assert cache.acquire(1) is not None  # a second request of a resident adapter shares its slot
    cache.release(2)
    assert cache.acquire(3) is not None  # 2's slot, 2 still in the host level
    stats = cache.stats()
    assert (stats.device_adapters, stats.host_adapters, stats.device_slots) == (2, 3, 2)
    assert cache.get(2) is not None


# -- through the executor -------------------------------------------------------------------------

PROMPT = [5, 17, 42, 99, 3, 64, 8]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-exec")
    make_llama(root / "hf", hidden=64, layers=2, num_heads=4, num_kv_heads=2, intermediate=96)
    return Engine(convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4}, dtype="float32"))


def _alone(engine: Engine, weights, config) -> list[int]:
    """Greedy tokens of PROMPT with the adapter, straight through the engine core."""
    from kiln.checkpoint.lora import parse_lora_tensors

    adapter = LoraAdapter(parse_lora_tensors(weights, config, lora_module_shapes(engine.config), 2))
    core = EngineCore(engine, max_num_seqs=1, num_blocks=32)
    request = core.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), None,
                               lora=adapter)
    while core.has_unfinished:
        core.step()
    return request.seqs[0].output_token_ids


def _final(executor: Executor, rid: int):
    while True:
        for response in executor.await_responses(rid, timeout=60):
            if response.has_error() or response.result.is_final:
                return response


def test_requests_load_reuse_and_name_unknown_adapters(engine):
    weights, config = _tensors(engine.config, 4, 0)
    expected = _alone(engine, weights, config)
    executor = Executor(engine, ExecutorConfig(max_batch_size=4))
    try:
        def request(lora):
            return Request(PROMPT, max_tokens=6, lora_config=lora,
                           output_config=OutputConfig(exclude_input_from_output=True))

        first = _final(executor, executor.enqueue_request(request(LoraConfig(7, weights.numpy(), config.numpy()))))
        assert first.result.output_token_ids == [expected]
        again, unknown, plain = executor.enqueue_requests([request(LoraConfig(7)), request(LoraConfig(99)),
                                                           request(None)])
        assert _final(executor, again).result.output_token_ids == [expected]
        error = _final(executor, unknown)
        assert error.has_error() and "task_id 99 is not in the LoRA cache" in error.error_msg
        assert not _final(executor, plain).has_error()
        half = _final(executor, executor.enqueue_request(request(LoraConfig(8, weights.numpy(), None))))
        assert half.has_error() and "weights and config come together" in half.error_msg
        stats = executor.get_latest_iteration_stats()[-1].lora_cache
        assert stats.host_adapters == 1 and stats.hits >= 1 and stats.misses >= 2
    finally:
        executor.shutdown()


def test_requests_wait_for_a_device_slot(engine):
    adapters = [_tensors(engine.config, 2, seed) for seed in (1, 2, 3)]
    expected = [_alone(engine, w, c) for w, c in adapters]
    executor = Executor(engine, ExecutorConfig(max_batch_size=4,
                                               lora_cache_config=LoraCacheConfig(device_cache_slots=1)))
    try:
        ids = executor.enqueue_requests([Request(PROMPT, max_tokens=6, lora_config=LoraConfig(i, w.numpy(), c.numpy()),
                                                 output_config=OutputConfig(exclude_input_from_output=True))
                                         for i, (w, c) in enumerate(adapters)])
        outputs = [_final(executor, rid).result.output_token_ids[0] for rid in ids]
        assert outputs == expected
        assert max(s.num_waiting_for_lora for s in executor.get_latest_iteration_stats()) >= 1
    finally:
        executor.shutdown()


def test_registered_adapters_come_back_after_eviction():
    cache = LoraCache(MODEL, LoraCacheConfig(host_cache_bytes=_bytes(2), device_cache_slots=2))
    cache.register(1, *_tensors(MODEL, 2, 1))
    assert cache.get(1) is not None  # loaded on first use
    cache.put(2, *_tensors(MODEL, 2, 2))  # evicts 1 (the host level holds one adapter)
    assert 1 not in cache._host
    assert cache.get(1) is not None and 2 not in cache._host  # back, evicting 2, which was not registered
    with pytest.raises(RequestError, match="task_id 2 is not in the LoRA cache"):
        cache.get(2)
    weights, config = _tensors(MODEL, 2, 3)
    config[0, 0] = 30
    with pytest.raises(RequestError, match="unknown module_id 30"):
        cache.register(3, weights, config)
