"""Decode speed with LoRA adapters against the same engine without, in one run.

For each batch size: random prompts of ``--prompt_len`` tokens generate ``--new_tokens``
greedy tokens each, all together, (a) with no adapter, (b) every sequence with one adapter,
(c) sequences spread over ``--adapters`` adapters (round robin). Adapters are random, rank
``--rank``, on every attention and MLP projection of every layer (q, k, v, dense, gate, up,
down), applied by the runtime as a request's ``LoraAdapter``. Rounds alternate the cases;
medians; decode tok/s and the ratio to (a).

    python benchmarks/lora_overhead.py ENGINE_DIR [--batches 1 8 32] [--rank 8] [--adapters 3] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

MODULES = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h")


def random_adapter(config, rank: int, seed: int):
    from kiln.bench.common import random_lora_modules
    from kiln.layers.lora import LoraAdapter

    return LoraAdapter(random_lora_modules(config, rank, MODULES, seed))


def decode_tok_s(core, prompts: list[list[int]], adapters: list, new_tokens: int) -> float:
    """Decode tok/s of the steps after every prompt's first token."""
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    requests = [core.add_request(p, params, None, lora=a) for p, a in zip(prompts, adapters)]
    core.step()  # the prompts (every one fits in the first step)
    started = time.perf_counter()
    while core.has_unfinished:
        core.step()
    elapsed = time.perf_counter() - started
    assert all(len(r.seqs[0].output_token_ids) == new_tokens for r in requests)
    return len(prompts) * (new_tokens - 1) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine_dir", help="a kiln engine (LoRA needs nothing from the build yet)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="sequences decoding together")
    p.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    p.add_argument("--adapters", type=int, default=3, help="adapters in the mixed case (default 3)")
    p.add_argument("--prompt_len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens per sequence (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds alternating the cases; medians (default 3)")
    args = p.parse_args()

    from kiln.bench.common import random_prompts
    from kiln.runtime.engine import Engine
    from kiln.runtime.engine_core import EngineCore

    engine = Engine(args.engine_dir)
    adapters = [random_adapter(engine.config, args.rank, seed) for seed in range(args.adapters)]
    print(f"{engine.config.architecture} {engine.config.dtype}, rank {args.rank} on {len(MODULES)} modules x "
          f"{engine.config.num_hidden_layers} layers, {args.prompt_len}-token prompts, {args.new_tokens} tokens, "
          f"{torch.get_num_threads()} threads; decode tok/s, medians of {args.rounds}")
    print("| batch | no adapter | one adapter | vs none | "
          f"{args.adapters} adapters mixed | vs none |\n|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        core = EngineCore(engine, max_num_seqs=batch, max_num_tokens=max(batch * args.prompt_len, 256))
        cases = {"none": [None] * batch, "one": [adapters[0]] * batch,
                 "mixed": [adapters[i % len(adapters)] for i in range(batch)]}
        decode_tok_s(core, random_prompts(batch, args.prompt_len, engine.config.vocab_size, 99), cases["none"], 4)
        runs = {name: [] for name in cases}
        for r in tqdm(range(args.rounds), desc=f"batch {batch}", leave=False):
            prompts = random_prompts(batch, args.prompt_len, engine.config.vocab_size, r)
            for name, assigned in cases.items():
                runs[name].append(decode_tok_s(core, prompts, assigned, args.new_tokens))
        med = {name: statistics.median(v) for name, v in runs.items()}
        print(f"| {batch} | {med['none']:.1f} | {med['one']:.1f} | {med['one'] / med['none']:.2f}x | "
              f"{med['mixed']:.1f} | {med['mixed'] / med['none']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
