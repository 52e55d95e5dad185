"""A hybrid model (LFM2: short-convolution layers beside attention) behind the server: 64 streaming
clients, a quarter hanging up, leave no KV block and no recurrent-state slot behind, and /metrics
reports the state cache."""
from __future__ import annotations

import time
import urllib.request

import pytest

from tests.conftest import convert_and_build
from tests.utils.fakes import make_tiny_tokenizer
from tests.utils.server import BUILD_OPTIONS, serve_tiny, streams_with_hang_ups
from tests.utils.tiny_hybrid_models import make_lfm2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid-serve")
    tokenizer = make_tiny_tokenizer()
    make_lfm2(d / "hf", vocab=len(tokenizer))
    tokenizer.save_pretrained(d / "hf")
    s = serve_tiny(convert_and_build(d / "hf", d / "w", build_options=BUILD_OPTIONS))
    yield s
    s.stop()


def _idle(server) -> bool:
    core = server.engine.executor.core
    states = core.scheduler.states
    return core.pool.num_free == core.pool.num_blocks and states.num_free == states.num_slots


def _gauge(server, name: str) -> float:
    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as r:
        text = r.read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"{name} ")))


def test_64_streams_with_a_quarter_hanging_up_leak_no_block_or_state_slot(server):
    client = server.client()
    results, errors, hung_up = streams_with_hang_ups(server, client, "the quick brown fox")
    assert not errors, errors
    assert len(hung_up) == 16 and len(results) == 48
    assert all(reason == "length" and events == 24 for events, reason in results.values())
    deadline = time.monotonic() + 10
    while not _idle(server):
        assert time.monotonic() < deadline, "KV blocks or state slots leaked"
        time.sleep(0.05)
    states = server.engine.executor.core.scheduler.states
    assert _gauge(server, "kiln_state_cache_slots_used") == 0
    assert _gauge(server, "kiln_state_cache_slots_total") == states.num_slots
    assert _gauge(server, "kiln_state_cache_bytes") == states.num_slots * server.engine.executor.core.runner.state_slot_bytes > 0
