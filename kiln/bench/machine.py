"""What this machine can do, measured in the same run as the figures it explains."""
from __future__ import annotations

import platform
import resource
import statistics
import time

import torch

from kiln import host_memory


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page in, spin up threads
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth: a float32 sum over a buffer far larger than the caches, on huge
    pages as kiln's weights are (4 KiB pages read ~13% slower here)."""
    x = host_memory.empty((megabytes * (1 << 20) // 4,), torch.float32).fill_(1)
    return x.numel() * 4 / _median_seconds(lambda: x.sum(), repeats) / 1e9


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """Square ``n``-sized matmul throughput in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / _median_seconds(lambda: a @ b, repeats) / 1e9


def median_matmul_gflops(dtype: torch.dtype, rounds: int = 3) -> float:
    """``matmul_gflops`` over several rounds, median (other tenants make single runs jumpy)."""
    return statistics.median(matmul_gflops(dtype) for _ in range(rounds))


def peak_rss_mb() -> float:
    """The process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the machine type where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def machine_facts() -> dict:
    """CPU, threads, read bandwidth and matmul rates; the bf16 rate is None where the CPU has
    no bf16 arithmetic (torch emulates it near 1 GFLOP/s: a minute of measuring for nothing)."""
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "read_gbs": round(read_bandwidth_gbs(), 1),
            "matmul_gflops_fp32": round(matmul_gflops(torch.float32)),
            "matmul_gflops_bf16": round(matmul_gflops(torch.bfloat16)) if native_bf16 else None}
