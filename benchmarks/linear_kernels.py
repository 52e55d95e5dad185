"""The linear layers of a decode step alone: kiln's kernels against oneDNN, and the bf16 peak.

For each row count (sequences decoding together), every linear layer of the engine's decoder
(not the LM head) multiplies random activations, as one decode step would: through the kernel
the native decode step calls for it (the skinny GEMM for one row, the AMX tile kernel, or the
quantized kernels, on the engine's prepacked weights, into preallocated outputs as in the
step; called from Python here, a few us a call the step does not pay) and, for bf16 engines,
through oneDNN on a weight packed once (``mkldnn._reorder_linear_weight``; it allocates each
output), which kiln used before its own AMX kernel.
Reports ms per step, GFLOP/s, and the share of the bf16 matmul peak (a 2048^3 matmul)
measured in the same run. Rounds alternate the paths; medians.

    python benchmarks/linear_kernels.py ENGINE_DIR [--rows 1 8 16 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine_dir", help="a kiln engine")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64], help="rows (tokens) per matmul")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (median)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from kiln.bench.common import decoder_linears
    from kiln.bench.machine import median_matmul_gflops
    from kiln.runtime.engine import Engine

    engine = Engine(args.engine_dir)
    linears, flops_per_token = decoder_linears(engine.model)
    bf16 = all(m.weight.dtype == torch.bfloat16 for m in linears)
    from kiln import kernels

    outputs = {}

    def kiln_kernel(lin, x):
        shape = (x.shape[0], lin.out_features)
        out = outputs.setdefault(shape, torch.empty(shape, dtype=x.dtype))
        if lin.quant_bits:
            return kernels.quant_linear(x, lin.weight, lin.weights_scaling_factor, getattr(lin, "weights_offset", None),
                                        lin.quant_bits, lin.group_size, None, lin.out_features, out=out)
        if x.shape[0] > 1 and lin.packed_weight() is not None:
            return kernels.packed_linear(x, lin.packed_weight(), None, lin.out_features, out=out)
        return kernels.skinny_linear(x, lin.weight, None, out=out)

    paths = {"kiln": kiln_kernel}
    if bf16:
        packed = {id(m): torch.ops.mkldnn._reorder_linear_weight(m.weight.detach()) for m in linears}
        paths["oneDNN"] = lambda lin, x: torch.ops.mkldnn._linear_pointwise(x, packed[id(lin)], None, "none",
                                                                           [None], "")
    dtype = torch.bfloat16 if bf16 or any(m.quant_bits for m in linears) else torch.float32
    peak = median_matmul_gflops(torch.bfloat16)
    print(f"{engine.config.quantization.quant_algo or engine.config.dtype}: {len(linears)} matmuls a step, "
          f"{args.threads} threads; bf16 matmul peak {peak:.0f} GFLOP/s")
    for rows in args.rows:
        xs = {m.in_features: torch.randn(rows, m.in_features).to(dtype) for m in linears}
        times = {name: [] for name in paths}
        for name, fn in paths.items():  # warm-up
            for m in linears:
                fn(m, xs[m.in_features])
        for _ in range(args.rounds):
            for name, fn in paths.items():
                started = time.perf_counter()
                for m in linears:
                    fn(m, xs[m.in_features])
                times[name].append(time.perf_counter() - started)
        line = []
        for name, runs in times.items():
            seconds = statistics.median(runs)
            gflops = flops_per_token * rows / seconds / 1e9
            line.append(f"{name} {1000 * seconds:6.2f} ms {gflops:6.0f} GFLOP/s ({gflops / peak:4.0%} of peak)")
        print(f"  rows {rows:4d}: " + "   ".join(line))


if __name__ == "__main__":
    main()
