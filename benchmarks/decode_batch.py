"""Batch decode through the executor, one run per attention backend, alternating.

64 random prompts of 50-300 tokens, 64 greedy tokens each, every request enqueued at once;
reports output tokens/s and the median full-batch decode step (from iteration stats) per
backend, and the ratio against the first backend named.

    python benchmarks/decode_batch.py ENGINE_DIR [--backends native torch] [--rounds 2]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kiln.runtime.executor import Executor, ExecutorConfig, Request
from kiln.runtime.sampling_params import SamplingParams


def run_once(engine_dir: str, backend: str, batch: int, new_tokens: int) -> tuple[float, float]:
    ex = Executor(engine_dir, ExecutorConfig(max_batch_size=batch, attention_backend=backend))
    try:
        rng = random.Random(0)
        requests = [Request(input_token_ids=[rng.randrange(1000, 40000) for _ in range(rng.randrange(50, 300))],
                            max_tokens=new_tokens, sampling_config=SamplingParams(temperature=0, ignore_eos=True))
                    for _ in range(batch)]
        ids = ex.enqueue_requests(requests)
        done, start = 0, time.perf_counter()
        while done < len(ids):
            done += sum(1 for r in ex.await_responses(ids, timeout=120) if r.result.is_final)
        elapsed = time.perf_counter() - start
        steps = [s.step_ms for s in ex.get_latest_iteration_stats() if s.num_scheduled_tokens == batch]
        return batch * new_tokens / elapsed, statistics.median(steps)
    finally:
        ex.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine_dir", help="an engine built with --max_batch_size >= --batch")
    p.add_argument("--backends", nargs="+", default=["native", "torch"], help="attention backends to compare")
    p.add_argument("--batch", type=int, default=64, help="concurrent requests")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per backend (medians reported)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, list[tuple[float, float]]] = {b: [] for b in args.backends}
    for _ in range(args.rounds):
        for backend in args.backends:
            results[backend].append(run_once(args.engine_dir, backend, args.batch, args.new_tokens))
    base = statistics.median(r[0] for r in results[args.backends[0]])
    for backend, runs in results.items():
        tps = statistics.median(r[0] for r in runs)
        step = statistics.median(r[1] for r in runs)
        print(f"{backend:>8}: {tps:6.1f} out tok/s, decode step {step:5.0f} ms  "
              f"({args.backends[0]} / {backend}: {base / tps:.2f}x)")


if __name__ == "__main__":
    main()
