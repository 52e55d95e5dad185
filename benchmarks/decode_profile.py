"""Where a decode step's time goes, measured inside the native decode step.

For each batch size, that many random prompts of ``--context`` tokens are prefilled, then
``--steps`` decode steps run with the native step's profile on: it adds the seconds spent in
the linear layers, in attention and in the rest (norms, rotary, KV writes, SiLU, residuals)
from inside the C step. Reported per step: the whole step (scheduling and sampling included),
those three parts, what runs outside them, and the linear layers' GFLOP/s against the bf16
matmul peak measured in the same run. The LM head counts among the linears where the native
step computes the logits too (column "head": "in"), else it runs outside.

    python benchmarks/decode_profile.py ENGINE_DIR [--batches 1 8 64] [--context 128] [--steps 16]
"""
from __future__ import annotations

import argparse
import time

import torch


def profile_batch(engine, batch: int, context: int, steps: int) -> dict:
    from kiln.bench.common import random_prompts
    from kiln.runtime.engine_core import EngineCore
    from kiln.runtime.sampling_params import SamplingParams

    core = EngineCore(engine, max_num_seqs=batch)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for prompt in random_prompts(batch, context, engine.config.vocab_size):
        core.add_request(prompt, params, None)
    while any(len(s.output_token_ids) < 2 for r in core._requests.values() for s in r.seqs):
        core.step()  # prefill (in chunks) until every sequence decodes
    native = getattr(engine.model, "_native_decode", None)
    if not native:
        raise SystemExit(f"{engine.engine_dir}: decode steps do not take the native step here")
    native.profile = torch.zeros(3, dtype=torch.float64)
    started = time.perf_counter()
    for _ in range(steps):
        core.step()
    total = time.perf_counter() - started
    linear, attention, other = (native.profile / steps).tolist()
    native.profile = None
    return {"step": total / steps, "linear": linear, "attention": attention, "other": other,
            "head_in_step": native.computes_logits(batch)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine_dir", help="a kiln engine of a model the native decode step runs")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="sequences decoding together")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps (default 128)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed (default 16)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from kiln.bench.common import decoder_linears
    from kiln.bench.machine import median_matmul_gflops
    from kiln.runtime.engine import Engine

    engine = Engine(args.engine_dir)
    linears, flops_per_token = decoder_linears(engine.model)
    peak = median_matmul_gflops(torch.bfloat16)
    name = engine.config.quantization.quant_algo or engine.config.dtype
    print(f"{name}, {args.threads} threads, {args.context}-token contexts, {args.steps} steps; "
          f"bf16 matmul peak {peak:.0f} GFLOP/s; ms per step")
    print(f"{'batch':>6} {'head':>5} {'step':>8} {'linears':>8} {'attention':>10} {'rest':>7} {'outside':>8} "
          f"{'linear GFLOP/s':>15} {'of peak':>8}")
    head = engine.model.lm_head
    for batch in args.batches:
        r = profile_batch(engine, batch, args.context, args.steps)
        outside = r["step"] - r["linear"] - r["attention"] - r["other"]
        flops = flops_per_token + (2 * head.in_features * head.out_features if r["head_in_step"] else 0)
        gflops = flops * batch / r["linear"] / 1e9
        print(f"{batch:>6} {'in' if r['head_in_step'] else 'out':>5} {1000 * r['step']:8.2f} "
              f"{1000 * r['linear']:8.2f} {1000 * r['attention']:10.2f} {1000 * r['other']:7.2f} "
              f"{1000 * outside:8.2f} {gflops:15.0f} {gflops / peak:8.0%}", flush=True)


if __name__ == "__main__":
    main()
