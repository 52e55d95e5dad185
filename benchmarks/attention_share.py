"""Attention's share of a decode step at long contexts (native backend vs the PyTorch reference).

For each context length and batch size, ``batch`` random prompts of ``context - 8`` tokens
are prefilled, then decode steps are timed. The reference backend's attention is timed by
wrapping its decode method; the native backend's runs inside the native decode step (one C
call for all layers), which times it itself (its profile; mean per step). Reports the step
time, the attention time and its share.

    python benchmarks/attention_share.py ENGINE_DIR [--contexts 512 2048] [--batches 1 16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.bench.common import random_prompts
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams


def measure(engine: Engine, backend: str, context: int, batch: int, steps: int) -> tuple[float, float]:
    core = EngineCore(engine, max_num_seqs=batch, attention_backend=backend)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for prompt in random_prompts(batch, context - 8, engine.config.vocab_size):
        core.add_request(prompt, params, None)
    while any(len(s.output_token_ids) < 2 for r in core._requests.values() for s in r.seqs):
        core.step()  # prefill (in chunks) until every sequence decodes
    backend_obj = core.runner.backend
    if backend == "native":
        return _native_step(core, steps)
    spent = []
    original = backend_obj._decode

    def timed(*args, **kwargs):
        started = time.perf_counter()
        original(*args, **kwargs)
        spent[-1] += time.perf_counter() - started

    backend_obj._decode = timed
    step_times = []
    for _ in range(steps):
        spent.append(0.0)
        started = time.perf_counter()
        core.step()
        step_times.append(time.perf_counter() - started)
    return statistics.median(step_times), statistics.median(spent)


def _native_step(core: EngineCore, steps: int) -> tuple[float, float]:
    native = core.runner.model._native_decode
    native.profile = torch.zeros(3, dtype=torch.float64)  # linears / attention / rest, from inside the step
    step_times = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()
        step_times.append(time.perf_counter() - started)
    attention = native.profile[1].item() / steps
    native.profile = None
    return statistics.median(step_times), attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine_dir", help="an engine with max_seq_len >= the longest context")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="context lengths (tokens)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="sequences decoding together")
    p.add_argument("--backends", nargs="+", default=["native", "torch"], help="attention backends")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(args.engine_dir)
    print(f"{engine.config.dtype}, {args.threads} threads; median of {args.steps} decode steps")
    print(f"{'backend':>8} {'context':>8} {'batch':>6} {'step ms':>9} {'attention ms':>13} {'share':>6}")
    for context in args.contexts:
        for batch in args.batches:
            for backend in args.backends:
                step, attention = measure(engine, backend, context, batch, args.steps)
                print(f"{backend:>8} {context:>8} {batch:>6} {1000 * step:9.1f} {1000 * attention:13.1f} "
                      f"{attention / step:6.0%}", flush=True)


if __name__ == "__main__":
    main()
