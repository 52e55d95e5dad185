"""The decode attention kernel's K/V read rate at long context (batch 1, bf16 cache).

    python benchmarks/attention_kernel.py [--contexts 2048 8192] [--threads 2]

One query token attends over a paged bf16 cache of real shapes (SmolLM2-1.7B: 32 KV heads of
64; Llama-3 8B: 8 KV heads of 128, 32 query heads). As many layers' caches as fill ~768 MB are
cycled, as a decode step walks its layers, so every read comes from DRAM rather than a cache
the previous call left warm. Reports ms per layer and the K/V bytes read per second (compare
the machine's read bandwidth, `kiln bench latency` prints it).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from kiln import host_memory, kernels
from kiln.step.kv_cache import cache_shape

SHAPES = {"smollm2-1.7b": (32, 32, 64), "llama-3.1-8b": (32, 8, 128)}  # query heads, KV heads, head size
BLOCK = 64


def measure(heads: int, kv_heads: int, head_size: int, context: int, total_mb: int = 768) -> tuple[float, float]:
    """(seconds per layer, K/V GB/s) of one decode query over ``context`` cached tokens."""
    blocks = context // BLOCK + 1
    per_cache = blocks * BLOCK * kv_heads * head_size * 2
    layers = max(2, total_mb * 2**20 // (2 * per_cache))
    caches = []
    for _ in range(layers):
        k, v = (host_memory.huge_page_bytes(per_cache).view(torch.bfloat16).view(cache_shape(blocks, BLOCK, kv_heads, head_size))
                for _ in range(2))
        k.normal_(), v.normal_()
        caches.append((k, v))
    q = torch.randn(1, heads, head_size).bfloat16()
    out = torch.empty_like(q)
    token_index, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([context])
    table = torch.randperm(blocks)[None, :].contiguous()  # blocks scattered, as a long-running cache has them
    scale = head_size ** -0.5
    for k, v in caches:
        kernels.paged_decode_attention(q, k, v, token_index, table, lens, out, scale, check=False)
    reps = max(1, 200 // layers)
    start = time.perf_counter()
    for _ in range(reps):
        for k, v in caches:
            kernels.paged_decode_attention(q, k, v, token_index, table, lens, out, scale, check=False)
    seconds = (time.perf_counter() - start) / (reps * layers)
    return seconds, 2 * context * kv_heads * head_size * 2 / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", nargs="+", type=int, default=[2048, 8192], help="cached tokens (default 2048 8192)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads (default: torch's)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for shape, (heads, kv_heads, head_size) in SHAPES.items():
        for context in args.contexts:
            seconds, rate = measure(heads, kv_heads, head_size, context)
            print(f"{shape:13} {kv_heads:2} KV heads of {head_size:3}, {context:5} tokens: "
                  f"{seconds * 1e3:.3f} ms a layer, K/V read at {rate:.1f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
