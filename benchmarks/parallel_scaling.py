"""Decode speed of one model split over ranks: tensor parallelism 1/2, pipeline parallelism 1/2.

For each world shape (``--worlds``, TPxPP) the model is converted and built with that split
(cached under ``--work_dir``), its ranks run as spawned processes on this machine (cores
shared: ``kiln.distributed.launch.threads_per_rank``), and rank 0 generates ``--new_tokens``
greedy tokens for each batch of ``--batches`` random ``--prompt_len``-token prompts. Figures,
after every prompt has its first token: decode tok/s, and the inter-token latency (the time
for every sequence of the batch to advance one token).

Communication is timed on rank 0 by wrapping torch.distributed's blocking calls
(all-reduce, all-gather, recv; kiln's all-reduce on gloo is swaps of partial sums, recvs on the
tensor-parallel group, counted as all-reduce): ``in comm`` is the share of rank 0's decode time spent inside
them (it includes waiting for a slower peer: with pipeline stages, for the other stage's
compute), and ``wire`` is the share the collectives alone would take: their count per step
times the cost of one, measured in the same world back to back at the step's tensor size.
``1x1 layers`` is one process on the layer-by-layer path that split ranks take (the native
one-call decode step is single-rank), so the world rows compare against it.

    python benchmarks/parallel_scaling.py MODEL (HF dir or GGUF) [--worlds 1x1 2x1 1x2 2x2]
        [--batches 1 8 32] [--new_tokens 64] [--dtype bfloat16] [--work_dir DIR]
    python benchmarks/parallel_scaling.py --make_random_llama DIR  # SmolLM2's shapes, 8 heads / 4 KV heads
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm


def make_random_llama(out: Path) -> None:
    """A random Llama with SmolLM2-135M's sizes but 8 query / 4 KV heads (SmolLM2's 9 / 3 do not
    split over 2 ranks): the same weight bytes and FLOPs per token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048,
                         tie_word_embeddings=True, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


def build(source: str, work: Path, tp: int, pp: int, dtype: str) -> Path:
    from kiln.build import build_engine, resolve_build_config
    from kiln.checkpoint.format import read_config
    from kiln.convert import convert_checkpoint

    engine = work / f"tp{tp}-pp{pp}" / "engine"
    if not (engine / "config.json").is_file():
        checkpoint = convert_checkpoint(source, work / f"tp{tp}-pp{pp}" / "checkpoint", dtype=dtype, tp_size=tp,
                                        pp_size=pp, progress=False)
        config = resolve_build_config(read_config(checkpoint), max_batch_size=64, max_input_len=256,
                                      max_seq_len=512, max_num_tokens=4096)
        build_engine(checkpoint, engine, config, progress=False)
    return engine


class CommTimer:
    """Seconds and calls inside torch.distributed's blocking calls, by kind."""

    KINDS = ("all_reduce", "all_gather", "recv")

    def __init__(self):
        self.seconds = dict.fromkeys(self.KINDS, 0.0)
        self.calls = dict.fromkeys(self.KINDS, 0)
        for kind in self.KINDS:
            setattr(torch.distributed, kind, self._timed(kind, getattr(torch.distributed, kind)))

    def _timed(self, kind, fn):
        from kiln.distributed import world

        def timed(*args, **kwargs):
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            # kiln's all-reduce on gloo is point-to-point swaps within the tensor-parallel group
            counted = "all_reduce" if kind == "recv" and kwargs.get("group") is world().tp_group is not None else kind
            self.seconds[counted] += time.perf_counter() - started
            self.calls[counted] += 1
            return out
        return timed

    def reset(self) -> None:
        for kind in self.KINDS:
            self.seconds[kind], self.calls[kind] = 0.0, 0

    def snapshot(self) -> dict:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls)}


def decode(core, prompts: list[list[int]], new_tokens: int, comm: CommTimer | None) -> dict:
    """Greedy decode of ``prompts`` together; figures from the moment all have a first token."""
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    requests = [core.add_request(p, params, end_id=None) for p in prompts]
    while not all(r.seqs[0].num_output_tokens for r in requests):
        core.step()
    if comm is not None:
        comm.reset()
    done = sum(r.seqs[0].num_output_tokens for r in requests)
    started = time.perf_counter()
    while core.has_unfinished:
        core.step()
    seconds = time.perf_counter() - started
    tokens = len(prompts) * new_tokens - done
    return {"decode_tok_s": tokens / seconds, "token_step_ms": 1000 * seconds * len(prompts) / tokens,
            "seconds": seconds, "comm": comm.snapshot() if comm is not None else None}


def wire_cost(engine, batch: int, rounds: int = 200) -> dict:
    """Seconds of one all-reduce of a decode step's hidden states (tensor parallelism) and one
    stage-to-stage hand-over (pipeline), back to back, every rank ready."""
    from kiln.distributed import all_reduce, world
    from kiln.dtypes import torch_dtype

    mapping, config = world().mapping, engine.config
    x = torch.zeros(batch, config.hidden_size, dtype=torch_dtype(config.dtype))
    cost = {}
    torch.distributed.barrier()
    if mapping.tp_size > 1:
        started = time.perf_counter()
        for _ in range(rounds):
            all_reduce(x, mapping.tp_size)
        cost["all_reduce"] = (time.perf_counter() - started) / rounds
    if mapping.pp_size > 1:  # a ping-pong between the stages' first ranks; half a round trip each way
        peer = (mapping.pp_size - 1) * mapping.tp_size
        torch.distributed.barrier()
        started = time.perf_counter()
        for _ in range(rounds):
            if mapping.rank == 0:
                torch.distributed.send(x, peer)
                torch.distributed.recv(x, peer)
            elif mapping.rank == peer:
                torch.distributed.recv(x, 0)
                torch.distributed.send(x, 0)
        cost["hand_over"] = (time.perf_counter() - started) / rounds / 2
    torch.distributed.barrier()
    return cost


def world_worker(engine_dir: str, batches: list[int], prompt_len: int, new_tokens: int, rounds: int,
                 out: str) -> None:
    from kiln.bench.common import random_prompts
    from kiln.distributed import init_world, shutdown_world, world
    from kiln.runtime.engine import Engine
    from kiln.runtime.engine_core import EngineCore
    from kiln.runtime.worker import follow

    init_world(*_shape(engine_dir))
    try:
        engine = Engine(engine_dir)
        mapping = world().mapping
        costs = {batch: wire_cost(engine, batch) for batch in batches}
        if mapping.rank != 0:
            follow(engine)
            return
        comm = CommTimer()  # rank 0's figures (after the wire measurement, which times itself)
        core = EngineCore(engine, max_num_seqs=max(batches), num_blocks=max(batches) * 8 + 8)
        decode(core, random_prompts(2, prompt_len, engine.config.vocab_size, 1), 4, comm)  # warm-up
        results = []
        for batch in batches:
            prompts = random_prompts(batch, prompt_len, engine.config.vocab_size, 0)
            runs = [decode(core, prompts, new_tokens, comm) for _ in range(rounds)]
            best = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]  # the median run
            results.append({"batch": batch, **best, "wire": costs[batch]})
        core.close()
        Path(out).write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}))
    finally:
        shutdown_world()


def single_process(engine_dir: str, batches: list[int], prompt_len: int, new_tokens: int, rounds: int,
                   native: bool) -> dict:
    from kiln.bench.common import random_prompts
    from kiln.runtime.engine import Engine
    from kiln.runtime.engine_core import EngineCore

    engine = Engine(engine_dir)
    if not native:
        engine.model._native_decode = False  # the layer-by-layer path split ranks take
    core = EngineCore(engine, max_num_seqs=max(batches), num_blocks=max(batches) * 8 + 8)
    decode(core, random_prompts(2, prompt_len, engine.config.vocab_size, 1), 4, None)
    results = []
    for batch in batches:
        prompts = random_prompts(batch, prompt_len, engine.config.vocab_size, 0)
        runs = [decode(core, prompts, new_tokens, None) for _ in range(rounds)]
        results.append({"batch": batch, **sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]})
    return {"threads": torch.get_num_threads(), "results": results}


def _shape(engine_dir: str) -> tuple[int, int]:
    mapping = json.loads(Path(engine_dir, "config.json").read_text())["mapping"]
    return mapping["tp_size"], mapping["pp_size"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="Hugging Face model directory or GGUF file")
    p.add_argument("--make_random_llama", help="write a random SmolLM2-sized Llama with 8/4 heads here and exit")
    p.add_argument("--worlds", nargs="+", default=["1x1", "2x1", "1x2", "2x2"], help="TPxPP shapes (default all four)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default 1 8 32)")
    p.add_argument("--prompt_len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens per sequence (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="runs per batch; the median (default 3)")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype (default bfloat16)")
    p.add_argument("--work_dir", default="/tmp/kiln-parallel-scaling", help="engines are cached here")
    args = p.parse_args()
    if args.make_random_llama:
        make_random_llama(Path(args.make_random_llama))
        return
    if not args.model:
        p.error("give a model (or --make_random_llama DIR)")
    from kiln.distributed.launch import spawn_workers

    work = Path(args.work_dir)
    rows = []
    for shape in tqdm(args.worlds, desc="worlds"):
        tp, pp = map(int, shape.split("x"))
        engine = build(args.model, work, tp, pp, args.dtype)
        if tp * pp == 1:
            for native in (True, False):
                record = single_process(str(engine), args.batches, args.prompt_len, args.new_tokens, args.rounds,
                                        native)
                rows.append(("1x1" if native else "1x1 layers", record))
            continue
        out = work / f"tp{tp}-pp{pp}.json"
        spawn_workers(world_worker, tp * pp, str(engine), args.batches, args.prompt_len, args.new_tokens,
                      args.rounds, str(out))
        rows.append((shape, json.loads(out.read_text())))
    layers = {r["batch"]: r for name, rec in rows if name == "1x1 layers" for r in rec["results"]}
    print(f"{args.model}: {args.dtype}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
          f"median of {args.rounds}; ranks share {torch.get_num_threads()} cores")
    print(f"{'TPxPP':>10} {'threads':>7} {'batch':>5} {'decode tok/s':>12} {'ms/token step':>13} "
          f"{'vs layers':>9} {'in comm':>8} {'wire':>6}  rank 0's blocking calls per token step")
    for name, record in rows:
        for r in record["results"]:
            base = layers.get(r["batch"])
            speed = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
            comm, share, wire, calls = r.get("comm"), "-", "-", ""
            if comm:
                steps = r["seconds"] * 1000 / r["token_step_ms"]
                per_step = {kind: calls / steps for kind, calls in comm["calls"].items()}
                share = f"{sum(comm['seconds'].values()) / r['seconds']:.0%}"
                wire_s = (per_step["all_reduce"] * r["wire"].get("all_reduce", 0)
                          + per_step["recv"] * r["wire"].get("hand_over", 0))
                wire = f"{wire_s * steps / r['seconds']:.0%}"
                calls = ", ".join(f"{n:.0f} {kind}" for kind, n in per_step.items() if n)
            print(f"{name:>10} {record['threads']:>7} {r['batch']:>5} {r['decode_tok_s']:>12.1f} "
                  f"{r['token_step_ms']:>13.2f} {speed:>9} {share:>8} {wire:>6}  {calls}")
        if any(r.get("wire") for r in record["results"]):
            print(f"{'':>10} one all-reduce / hand-over at batch " + ", ".join(
                f"{r['batch']}: " + " / ".join(f"{1e6 * v:.0f} us" for v in r["wire"].values())
                for r in record["results"]))


if __name__ == "__main__":
    main()
