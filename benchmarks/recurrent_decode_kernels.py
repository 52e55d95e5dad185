"""The recurrent layers' decode kernels at real shapes: one call for a batch of one-token rows,
beside a plain copy of the same state bytes (what reading and writing each state once costs).

    python benchmarks/recurrent_decode_kernels.py [--rows 1 8 32] [--dtype bfloat16]

Mamba2 at Granite-4.0-H-Micro's layer (64 heads of 64, state 128, one group) and Gated DeltaNet at
Qwen3.5-9B's (16 key and 32 value heads of 128), each row's state read from one slot and the next
written to another, as a step does. A state this size per row (2 MB and 8 MB a layer) does not stay
in the caches across a model's layers, but a single layer called again may partly: these figures
compare kernel versions, not a whole step (``moe_scale.py`` measures that). Prints milliseconds a
call and the state bytes moved per second.
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from kiln import kernels
from kiln.dtypes import torch_dtype


def _group(rows: int):
    return SimpleNamespace(read=torch.arange(rows), write=torch.arange(rows, 2 * rows),
                           fresh=torch.zeros(rows, dtype=torch.bool), count=rows)


def _timed(fn, calls: int = 20) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def mamba2(rows: int, dtype: torch.dtype) -> tuple[float, int]:
    heads, head_dim, state, groups, kernel = 64, 64, 128, 1, 4
    inner = heads * head_dim
    channels = inner + 2 * groups * state
    projected = torch.randn(rows, inner + channels + heads).to(dtype)
    conv_w, conv_state = torch.randn(channels, kernel).to(dtype) * 0.1, torch.zeros(2 * rows, kernel - 1, channels,
                                                                                     dtype=dtype)
    ssm = torch.randn(2 * rows, heads, head_dim, state) * 0.1
    a_log, dt_bias, d = (torch.randn(heads).to(dtype) for _ in range(3))
    y, group = torch.empty(rows, inner), _group(rows)
    seconds = _timed(lambda: kernels.mamba2_decode(projected, conv_w, None, conv_state, ssm, a_log, dt_bias, d, group,
                                                   y, groups=groups, head_dim=head_dim, state_size=state,
                                                   time_step_limit=(0.0, float("inf"))))
    return seconds, rows * heads * head_dim * state * 4


def gated_delta(rows: int, dtype: torch.dtype) -> tuple[float, int]:
    key_heads, value_heads, dim, kernel = 16, 32, 128, 4
    channels = 2 * key_heads * dim + value_heads * dim
    mixed, z = torch.randn(rows, channels).to(dtype), torch.randn(rows, value_heads * dim).to(dtype)
    b, a = torch.randn(rows, value_heads).to(dtype), torch.randn(rows, value_heads).to(dtype)
    conv_w, conv_state = torch.randn(channels, kernel).to(dtype) * 0.1, torch.zeros(2 * rows, kernel - 1, channels,
                                                                                     dtype=dtype)
    delta = torch.randn(2 * rows, value_heads, dim, dim) * 0.01
    a_log, dt_bias, norm = torch.zeros(value_heads).to(dtype), torch.zeros(value_heads).to(dtype), torch.ones(dim).to(dtype)
    out, group = torch.empty(rows, value_heads * dim, dtype=dtype), _group(rows)
    seconds = _timed(lambda: kernels.gated_delta_decode(mixed, z, b, a, conv_w, conv_state, delta, a_log, dt_bias, norm,
                                                        1e-6, group, out, key_heads=key_heads, key_dim=dim,
                                                        value_dim=dim, tiled=False))
    return seconds, rows * value_heads * dim * dim * 4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32], help="rows a call (default 1 8 32)")
    p.add_argument("--dtype", default="bfloat16", help="the model dtype (default bfloat16)")
    args = p.parse_args(argv)
    dtype = torch_dtype(args.dtype)
    print(f"{torch.get_num_threads()} threads, {args.dtype}")
    for name, kernel in (("mamba2 (Granite-4.0-H-Micro)", mamba2), ("gated delta (Qwen3.5-9B)", gated_delta)):
        for rows in args.rows:
            seconds, state_bytes = kernel(rows, dtype)
            copy = torch.empty(state_bytes // 4), torch.empty(state_bytes // 4)
            copy_s = _timed(lambda: copy[1].copy_(copy[0]))
            print(f"  {name}, {rows} rows: {seconds * 1e3:.2f} ms ({2 * state_bytes / seconds / 1e9:.1f} GB/s of "
                  f"state read and written); a copy of the state: {copy_s * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
