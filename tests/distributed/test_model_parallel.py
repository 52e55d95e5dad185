"""Tensor and pipeline parallelism over processes (gloo): an engine split over tp_size 2,
pp_size 2, or both, run by that many spawned workers, gives the logits and tokens of the same
model in one process."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import SamplingParams
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from tests.conftest import convert_and_build
from tests.utils.tiny_models import make_gpt2, make_llama
from tests.utils.tiny_moe_models import make_mixtral, make_qwen2_moe

PROMPTS = [[5, 17, 42, 99, 3, 64, 8, 120, 33], [7, 7, 200, 1, 90], [249, 11, 12, 13, 14, 15, 16]]
NEW_TOKENS = 6
BUILD = {"tokens_per_block": 4, "max_beam_width": 2}

# name: (model maker and options, convert options). Llama with GQA (a KV head per rank) and
# with one KV head (replicated on both ranks); embeddings whole, split by vocabulary (sharding
# dim 0, out-of-range ids masked) or by hidden (dim 1, gathered); a table shared with the LM
# head (tied: with tp_size 2 the vocab-split head is the same split table; with pp_size 2 the
# last stage holds its own copy); GPT-2 (learned positions, biases, tied); Mixtral and Qwen2-MoE.
CASES = {
    "llama-gqa": ((make_llama, dict(num_heads=4, num_kv_heads=2)), {}),
    "llama-gqa-vocab-split": ((make_llama, dict(num_heads=4, num_kv_heads=2, vocab=250)),
                              dict(use_parallel_embedding=True, embedding_sharding_dim=0)),
    "llama-gqa-hidden-split": ((make_llama, dict(num_heads=4, num_kv_heads=2)),
                               dict(use_parallel_embedding=True, embedding_sharding_dim=1)),
    "llama-mqa-tied-shared": ((make_llama, dict(num_heads=4, num_kv_heads=1, tie=True)),
                              dict(use_parallel_embedding=True, embedding_sharding_dim=0)),
    "llama-tied-hidden-split": ((make_llama, dict(num_heads=4, num_kv_heads=2, tie=True)),
                                dict(use_parallel_embedding=True, embedding_sharding_dim=1)),
    "gpt2-vocab-split": ((make_gpt2, {}), dict(use_parallel_embedding=True, embedding_sharding_dim=0)),
    "gpt2-hidden-split": ((make_gpt2, {}), dict(use_parallel_embedding=True, embedding_sharding_dim=1)),
    # Mixture of experts: every expert's MLP split like a dense one, the router replicated.
    "mixtral": ((make_mixtral, {}), {}),
    "qwen2-moe-shared-expert": ((make_qwen2_moe, {}), {}),
}
WORLDS = {"tp2": (2, 1), "pp2": (1, 2), "tp2-pp2": (2, 2)}  # name: (tp_size, pp_size)

# Beyond greedy decoding: seeded sampling under penalties, top-p decay and log-probs (the last
# stage samples from a copy of the sequence and its random generator), and a beam search.
SAMPLED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.9, top_p_decay=0.9, seed=7,
                         repetition_penalty=1.3, presence_penalty=0.4, logprobs=2, ignore_eos=True)
BEAMS = SamplingParams(max_tokens=NEW_TOKENS, use_beam_search=True, best_of=2, temperature=0, ignore_eos=True)


def generate(engine: Engine, adapters: list | None = None) -> dict:
    """Every prompt's greedy tokens and generation logits, all in one batch with a sampled
    request and a beam search; with ``adapters`` (reference (weights, config) pairs or None, one
    per prompt) the greedy ones under those LoRA adapters. ``in_flight``: the most micro-batches
    the engine core had in flight at once."""
    from kiln.runtime.lora_cache import parse_adapter

    loras = [None if a is None else parse_adapter(*a, engine.config, engine.lora_config, "lora")
             for a in adapters or [None] * len(PROMPTS)]
    core = EngineCore(engine, max_num_seqs=8, num_blocks=64)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    requests = [core.add_request(p, params, end_id=None, return_generation_logits=True, lora=lora)
                for p, lora in zip(PROMPTS, loras)]
    sampled = core.add_request(PROMPTS[0], SAMPLED, end_id=None)
    beams = core.add_request(PROMPTS[1], BEAMS, end_id=None)
    while core.has_unfinished:
        core.step()
    core.close()
    return {"greedy": [(r.seqs[0].output_token_ids, torch.stack([g[0] for g in r.generation_logits]))
                       for r in requests],
            "sampled": (sampled.seqs[0].output_token_ids, torch.tensor(sampled.seqs[0].logprobs)),
            "beams": [h.token_ids for h in beams.hypotheses], "in_flight": core.stats.max_in_flight}


def world_worker(tp_size: int, pp_size: int, jobs: list[tuple[str, str, str | None]]) -> None:
    """One rank of a tp_size x pp_size world, for each engine: rank 0 schedules (under the
    adapters saved in the job's file, if any) and saves the results; the others follow."""
    from kiln.distributed import init_world, shutdown_world, world
    from kiln.runtime.worker import follow

    init_world(tp_size=tp_size, pp_size=pp_size)
    try:
        for engine_dir, out, adapters in jobs:
            engine = Engine(engine_dir)
            assert engine.config.mapping.rank == world().mapping.rank
            if world().mapping.rank == 0:
                torch.save(generate(engine, torch.load(adapters) if adapters else None), out)
            else:
                follow(engine)
    finally:
        shutdown_world()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{(world, case): (single-process results, the world's results)}."""
    from kiln.distributed.launch import spawn_workers

    root = tmp_path_factory.mktemp("parallel")
    jobs: dict[str, list] = {name: [] for name in WORLDS}
    single = {}
    for name, ((make, options), convert) in CASES.items():
        make(root / name / "hf", **options)
        one = convert_and_build(root / name / "hf", root / name / "one", BUILD, dtype="float32")
        single[name] = generate(Engine(one))
        if name == "llama-gqa":  # LoRA: a plain adapter, a DoRA one and none, sharded per rank
            torch.save(_adapters(Engine(one).config), root / "adapters.pt")
            single["llama-gqa-lora"] = generate(Engine(one), torch.load(root / "adapters.pt"))
        for world_name, (tp, pp) in WORLDS.items():
            split = convert_and_build(root / name / "hf", root / name / world_name, BUILD, dtype="float32",
                                      tp_size=tp, pp_size=pp, **convert)
            jobs[world_name].append((str(split), str(root / name / f"{world_name}.pt"), None))
            if name == "llama-gqa":
                jobs[world_name].append((str(split), str(root / f"lora-{world_name}.pt"), str(root / "adapters.pt")))
    for world_name, (tp, pp) in WORLDS.items():
        spawn_workers(world_worker, tp * pp, tp, pp, jobs[world_name])
    out = {}
    for world_name in WORLDS:
        for name in CASES:
            out[world_name, name] = (single[name], torch.load(root / name / f"{world_name}.pt"))
        out[world_name, "llama-gqa-lora"] = (single["llama-gqa-lora"], torch.load(root / f"lora-{world_name}.pt"))
    return out


def _adapters(config) -> list:
    from kiln.bench.common import random_lora_modules
    from kiln.checkpoint.lora import pack_lora_tensors

    every = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h")
    plain = random_lora_modules(config, 4, every, seed=0, scale=0.2)
    dora = random_lora_modules(config, 2, ("attn_qkv", "attn_dense", "mlp_gate_up", "mlp_4h_to_h"), seed=1,
                               scale=0.2)
    for row in dora:
        row.magnitude = 1 + 0.2 * torch.randn(row.b.shape[0], generator=torch.Generator().manual_seed(row.layer))
    return [pack_lora_tensors(plain), pack_lora_tensors(dora), None]


@pytest.mark.parametrize("world_name", sorted(WORLDS))
@pytest.mark.parametrize("case", sorted(CASES) + ["llama-gqa-lora"])
def test_a_split_engine_equals_one_process(results, world_name, case):
    single, split = results[world_name, case]
    for (tokens, logits), (split_tokens, split_logits) in zip(single["greedy"], split["greedy"]):
        assert split_tokens == tokens
        torch.testing.assert_close(split_logits, logits, atol=1e-4, rtol=1e-4)
    assert split["sampled"][0] == single["sampled"][0]
    torch.testing.assert_close(split["sampled"][1], single["sampled"][1], atol=1e-4, rtol=1e-4)
    assert split["beams"] == single["beams"]
    # Pipeline stages had two micro-batches in flight: stage 0 computed one while stage 1 the other.
    assert split["in_flight"] == WORLDS[world_name][1]


def test_a_multi_rank_engine_needs_its_world(tmp_path):
    from kiln.errors import ConfigError

    make_llama(tmp_path / "hf", num_heads=4, num_kv_heads=2)
    engine_dir = convert_and_build(tmp_path / "hf", tmp_path / "tp2", {"tokens_per_block": 4}, tp_size=2)
    with pytest.raises(ConfigError, match="built for tp_size 2 x pp_size 1 ranks; run it in that many processes"):
        Engine(engine_dir)
    assert Engine(engine_dir, rank=1).config.mapping.tp_rank == 1  # one rank's weights, to inspect
    assert Path(engine_dir, "rank1.safetensors").is_file()


def dying_worker(tp_size: int, pp_size: int, engine_dir: str, report: str) -> None:
    """Rank 1 (the other tensor-parallel rank, or the last pipeline stage, which samples) dies on
    its third step; rank 0 records what its engine core raised, and when."""
    import os
    import time

    from kiln.distributed import init_world
    from kiln.runtime.model_runner import ModelRunner
    from kiln.runtime.worker import follow

    rank = init_world(tp_size=tp_size, pp_size=pp_size, timeout_s=20).mapping.rank
    engine = Engine(engine_dir)
    if rank == 1:
        run_step, steps = ModelRunner.run_step, []

        def run_then_die(self, step):
            steps.append(1)
            if len(steps) == 3:
                os._exit(1)
            return run_step(self, step)

        ModelRunner.run_step = run_then_die
        follow(engine)
        return
    core = EngineCore(engine, max_num_seqs=1, num_blocks=32)
    core.add_request(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), end_id=None)
    started = time.monotonic()
    try:
        while core.has_unfinished:
            core.step()
        outcome = "finished"
    except Exception as e:  # noqa: BLE001 - the test wants whatever surfaced
        outcome = f"{type(e).__name__}: {e}"
    Path(report).write_text(f"{time.monotonic() - started:.1f}\n{outcome}")


@pytest.mark.parametrize("tp_size, pp_size", [(2, 1), (1, 2)])
def test_a_dead_rank_ends_the_leader_with_an_error(tmp_path, tp_size, pp_size):
    from kiln.distributed.launch import free_port, start_workers

    make_llama(tmp_path / "hf", num_heads=4, num_kv_heads=2)
    engine_dir = convert_and_build(tmp_path / "hf", tmp_path / "split", {"tokens_per_block": 4}, tp_size=tp_size,
                                   pp_size=pp_size)
    ranks = start_workers(dying_worker, range(2), 2, free_port(), tp_size, pp_size, str(engine_dir),
                          str(tmp_path / "report"))
    for process in ranks:
        process.join(timeout=120)
    assert all(p.exitcode is not None for p in ranks), "a rank hung"
    seconds, outcome = (tmp_path / "report").read_text().split("\n", 1)
    assert outcome.startswith("WorldError: ") and "a rank of the world died or stopped answering" in outcome
    assert float(seconds) < 30
