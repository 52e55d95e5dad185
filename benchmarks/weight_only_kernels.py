"""kiln's weight-only quantized linears against PyTorch's packed CPU kernels.

Every linear of a SmolLM2-135M decode step (30 layers of qkv 960x576, dense 576x576, fused
gate/up 3072x576, down 576x1536; 106 MB of weights in bf16, more than the caches hold, so
each step streams them from memory) multiplied by random bf16 activations of ``--rows``
rows, with random codes in each kernel's own packed layout:

* int8 per output channel: kiln (``kernels.quant_linear``, tile-ordered codes) vs
  ``torch._weight_int8pack_mm`` (row-major int8, bf16 scales);
* 4-bit, a scale and zero point per 64 inputs: kiln (chunk-ordered codes, float16 scales,
  the zero points as float16 offsets) vs ``torch._weight_int4pack_mm_for_cpu`` (its
  ``_convert_weight_to_int4pack_for_cpu`` layout, bf16 scales and zeros);
* bf16 through kiln's kernels (the skinny GEMV for one row, the packed panel kernel for more)
  as the unquantized reference.

Reports ms per step and the weight bytes streamed per second; rounds alternate the paths,
medians. Timing only: the kernels' numbers are tested in tests/quantization.

    python benchmarks/weight_only_kernels.py [--rows 1 4 32] [--rounds 5] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, dense, fused fc, proj
LAYERS = 30
GROUP = 64


def make_layers(seed: int = 0):
    """Per path, the 30 x 4 weights in that path's layout and a function running one of them."""
    from kiln import kernels

    g = torch.Generator().manual_seed(seed)
    paths = {name: [] for name in ("bf16", "kiln int8", "torch int8", "kiln int4", "torch int4")}
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g).bfloat16()
            paths["bf16"].append((w, kernels.pack_bf16(w) if kernels.packed_supported(w) else None, n))
            codes8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            scales8 = torch.rand(n, generator=g) / 127
            paths["kiln int8"].append((kernels.quant_pack(codes8, 8), *kernels.quant_pack_scales(scales8), n))
            paths["torch int8"].append((codes8, scales8.bfloat16()))
            codes4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            scales4 = (torch.rand(n, k // GROUP, generator=g) / 8).half().float()
            zeros4 = torch.randint(0, 16, (n, k // GROUP), generator=g).float()
            pairs = codes4[:, 0::2] | (codes4[:, 1::2] << 4)
            paths["kiln int4"].append((kernels.quant_pack(pairs, 4), *kernels.quant_pack_scales(scales4, zeros4), n))
            # torch's zeros are the float offset of code 8 (w = (q - 8) * scale + zero).
            scale_zero = torch.stack([scales4.t(), ((8 - zeros4) * scales4).t()], dim=-1).bfloat16().contiguous()
            paths["torch int4"].append((torch._convert_weight_to_int4pack_for_cpu(codes4.int(), 1), scale_zero))
    return paths


def run_step(name: str, layers: list, xs: dict) -> None:
    from kiln import kernels

    for entry in layers:
        if name == "bf16":
            w, packed, n = entry
            x = xs[w.shape[1]]
            if x.shape[0] == 1 or packed is None:
                kernels.skinny_linear(x, w, None, check=False)
            else:
                kernels.packed_linear(x, packed, None, n)
        elif name.startswith("kiln"):
            codes, scales, offsets, n = entry
            bits = 8 if name == "kiln int8" else 4
            k = codes.shape[1] if bits == 8 else 2 * codes.shape[1]
            kernels.quant_linear(xs[k], codes, scales, offsets, bits, GROUP, None, n)
        elif name == "torch int8":
            codes, scales = entry
            torch._weight_int8pack_mm(xs[codes.shape[1]], codes, scales)
        else:
            packed, scale_zero = entry
            torch._weight_int4pack_mm_for_cpu(xs[2 * packed.shape[1]], packed, GROUP, scale_zero)


def weight_bytes(name: str, layers: list) -> int:
    return sum(e[0].numel() * e[0].element_size() for e in layers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32], help="activation rows (sequences) per step")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per row count (median)")
    p.add_argument("--steps", type=int, default=5, help="steps timed per round")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch and kernel threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = make_layers()
    print(f"{args.threads} thread(s); weights per step: "
          + ", ".join(f"{name} {weight_bytes(name, layers) / 1e6:.0f} MB" for name, layers in paths.items()))
    print("| rows | path | ms / step | weight GB/s | vs bf16 |")
    print("|---:|---|---:|---:|---:|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
        times = {name: [] for name in paths}
        for name, layers in paths.items():  # warm-up
            run_step(name, layers, xs)
        for _ in tqdm(range(args.rounds), desc=f"{rows} rows", leave=False):
            for name, layers in paths.items():
                started = time.perf_counter()
                for _ in range(args.steps):
                    run_step(name, layers, xs)
                times[name].append((time.perf_counter() - started) / args.steps)
        bf16 = statistics.median(times["bf16"])
        for name, layers in paths.items():
            t = statistics.median(times[name])
            print(f"| {rows} | {name} | {1e3 * t:.2f} | {weight_bytes(name, layers) / t / 1e9:.1f} | {bf16 / t:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
