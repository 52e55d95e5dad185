"""``kiln bench latency|throughput``: kiln's speed beside Hugging Face transformers, one run."""
from __future__ import annotations

import json
import sys

import torch

from kiln.bench.common import append_record
from kiln.bench.latency import format_latency, run_latency
from kiln.bench.throughput import format_throughput, run_throughput
from kiln.cli.world import add_world_flags, rank_zero
from kiln.config.engine_args import EngineArgs
from kiln.engine_cache import engine_for
from kiln.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speed beside Hugging Face transformers",
                       description="Measure an engine's speed. With --hf_gguf or --hf_dir, Hugging Face "
                                   "transformers runs the same model, dtype, prompts and lengths in the same "
                                   "process and the ratios are printed. The machine's read bandwidth and "
                                   "matmul peak are measured in the same run.")
    modes = p.add_subparsers(dest="mode", required=True)
    lat = modes.add_parser("latency", help="one request at a time: load, TTFT, prefill and batch-1 decode",
                           description="Batch-1 figures: engine load and load-to-first-token, prefill tok/s, "
                                       "time to first token, decode tok/s, host overhead per step, achieved "
                                       "bandwidth, peak RSS.")
    thr = modes.add_parser("throughput", help="batches of requests: output and decode tok/s per batch size",
                           description="For each batch size, that many prompts generate the same number of "
                                       "tokens: kiln's LLM.generate against one HF static generate batch.")
    for q in (lat, thr):
        q.add_argument("--engine_dir", required=True, help="kiln engine to measure (or a checkpoint, HF dir or GGUF "
                                                            "file, built into the engine cache first)")
        EngineArgs.add_cli_args(q, "bench")
        q.add_argument("--hf_gguf", help="GGUF file that Hugging Face loads as the peer")
        q.add_argument("--hf_dir", help="Hugging Face model directory as the peer (instead of --hf_gguf)")
        q.add_argument("--threads", type=int, help="torch threads for both (default: torch's, the core count)")
        q.add_argument("--prompt_len", type=int, default=32, help="prompt tokens (default 32)")
        q.add_argument("--new_tokens", type=int, default=128, help="greedy tokens per request (default 128)")
        q.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens (default 0)")
        q.add_argument("--output_json", help="append the figures as one JSON line to this file")
        q.add_argument("--json", action="store_true", help="print the record as JSON instead of a table")
        add_world_flags(q)
        q.set_defaults(handler=run)
    lat.add_argument("--prefill_len", type=int, default=512, help="prompt tokens for prefill tok/s (default 512)")
    lat.add_argument("--rounds", type=int, default=3, help="rounds alternating kiln and HF; medians (default 3)")
    thr.add_argument("--batch_sizes", type=int, nargs="+", default=[8, 32, 64],
                     help="batch sizes to measure (default 8 32 64)")
    thr.add_argument("--rounds", type=int, default=1, help="rounds per batch size; medians (default 1)")


def run(args) -> int:
    if args.hf_gguf and args.hf_dir:
        raise ConfigError("give --hf_gguf or --hf_dir, not both")
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(hf_gguf=args.hf_gguf, hf_dir=args.hf_dir, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                  rounds=args.rounds, seed=args.seed)
    engine_args = EngineArgs.from_cli_args(args, model=args.engine_dir)
    engine_dir = engine_for(engine_args, tp_size=args.tp_size, pp_size=args.pp_size)
    engine_args = engine_args.for_engine(engine_dir)
    with rank_zero(engine_dir, args.tp_size, args.pp_size):  # the other ranks of a split engine follow
        record, text = _measure(args, engine_args, common)
    record["command"] = " ".join(["kiln", *sys.argv[1:]])
    print(json.dumps(record, indent=2) if args.json else text)
    if args.output_json:
        append_record(args.output_json, record)
    return 0


def _measure(args, engine_args: EngineArgs, common: dict) -> tuple[dict, str]:
    if args.mode == "latency":
        record = run_latency(engine_args, prefill_len=args.prefill_len, **common)
        text = format_latency(record)
    else:
        try:
            record = run_throughput(engine_args, batch_sizes=tuple(args.batch_sizes), **common)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        text = format_throughput(record)
    return record, text
