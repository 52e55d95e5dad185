"""Building and loading the native kernel library: compile the C sources with the machine's
compiler (cached by sources, compiler, flags and CPU), load it with ctypes and declare every
function's argument types."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from kiln import env

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(p.name for p in Path(__file__).parent.glob("*.c")))  # what the cache key hashes
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-Wall"]
# Linked in a separate step without -ffast-math: linking with it adds crtfastmath.o, whose
# constructor turns on flush-to-zero for the whole process (torch's numerics included).
LINK_FLAGS = ["-shared", "-fopenmp"]

C_INT64 = ctypes.c_int64
C_PTR = ctypes.c_void_p
_DECODE_ARGTYPES = ([C_PTR, C_INT64] + [C_PTR] * 6 + [C_INT64] * 6 + [ctypes.c_float, C_INT64, C_PTR]
                    + [ctypes.c_float, C_PTR] + [ctypes.c_float] * 2 + [ctypes.c_int])


DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the C functions' name suffix per dtype
DECODE_KERNELS = {torch.float32: "kiln_paged_decode_attention_f32", torch.bfloat16: "kiln_paged_decode_attention_bf16"}
# Variants over a quantized K/V cache, by the cache's then the query's dtype: int8 codes (INT8
# KV cache) and float8 e4m3 codes (FP8 KV cache).
DECODE_KERNELS_QUANTIZED_KV = {
    torch.int8: {torch.float32: "kiln_paged_decode_attention_f32_i8",
                 torch.bfloat16: "kiln_paged_decode_attention_bf16_i8"},
    torch.float8_e4m3fn: {torch.float32: "kiln_paged_decode_attention_f32_f8",
                          torch.bfloat16: "kiln_paged_decode_attention_bf16_f8"},
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return frozenset()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, out: Path) -> None:
    here = Path(__file__).parent
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        objects = [str(Path(tmp) / f"{Path(s).stem}.o") for s in SOURCES]
        compiles = [[compiler, *COMPILE_FLAGS, "-c", str(here / s), "-o", o] for s, o in zip(SOURCES, objects)]
        # The sources compile side by side (the build is on the first call's critical path).
        running = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                   for cmd in compiles]
        for cmd, proc in running:
            _, errors = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{errors}")
        link = [compiler, *LINK_FLAGS, *objects, "-o", str(tmp_lib), "-lm"]
        linked = subprocess.run(link, capture_output=True, text=True)
        if linked.returncode != 0:
            raise RuntimeError(f"{' '.join(link)} failed:\n{linked.stderr}")
        os.replace(tmp_lib, out)  # atomic: a concurrent build can only replace it with the same bytes


@lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel library, built if needed; None if native kernels are unavailable."""
    if not env.native_kernels_enabled() or sys.platform != "linux":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: using the PyTorch paths")
        return None
    here = Path(__file__).parent
    key = hashlib.sha256()
    sources = [p.read_bytes() for p in sorted(here.glob("*.[ch]"))]
    for part in (*sources, compiler.encode(), " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(),
                 " ".join([os.uname().machine, *sorted(cpu_flags())]).encode(), torch.__version__.encode()):
        key.update(part)
    lib_path = env.cache_dir() / "kernels" / key.hexdigest()[:16] / "libkiln_kernels.so"
    try:
        if not lib_path.exists():
            _build(compiler, lib_path)
        torch.get_num_threads()  # torch's libgomp is loaded first, so the kernels share its pool
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError) as e:
        log.warning("native kernels unavailable (%s): using the PyTorch paths", e)
        return None
    _declare_decode_kernels(lib)
    _declare_other_kernels(lib)
    return lib


def _declare_decode_kernels(lib: ctypes.CDLL) -> None:
    """Argument and result types of the attention, elementwise and decode-step functions."""
    for name in (*DECODE_KERNELS.values(), *(n for by_q in DECODE_KERNELS_QUANTIZED_KV.values()
                                               for n in by_q.values())):
        fn = getattr(lib, name)
        fn.argtypes = _DECODE_ARGTYPES
        fn.restype = ctypes.c_int
    lib.kiln_argmax_rows_f32.argtypes = [C_PTR, C_INT64, C_INT64, C_PTR, ctypes.c_int]
    lib.kiln_argmax_rows_f32.restype = None
    for suffix in DTYPE_SUFFIX.values():
        getattr(lib, f"kiln_rmsnorm_{suffix}").argtypes = [C_PTR, C_INT64, C_PTR, C_PTR, C_INT64, C_INT64, ctypes.c_float,
                                                            ctypes.c_int]
        getattr(lib, f"kiln_silu_mul_{suffix}").argtypes = [C_PTR, C_INT64, C_PTR, C_INT64, C_INT64, ctypes.c_int]
        getattr(lib, f"kiln_rotary_{suffix}").argtypes = [C_PTR, C_INT64, C_PTR, C_PTR] + [C_INT64] * 4 + [ctypes.c_int]
        for kind in ("rmsnorm", "silu_mul", "rotary"):
            getattr(lib, f"kiln_{kind}_{suffix}").restype = None
        getattr(lib, f"kiln_skinny_gemm_{suffix}").argtypes = [C_PTR] * 4 + [C_INT64] * 3 + [ctypes.c_int]
        getattr(lib, f"kiln_skinny_gemm_{suffix}").restype = None
        getattr(lib, f"kiln_head_gemm_{suffix}").argtypes = ([C_PTR, C_INT64, C_INT64, C_PTR, C_PTR] + [C_INT64] * 6
                                                             + [ctypes.c_int])
        getattr(lib, f"kiln_head_gemm_{suffix}").restype = None
        getattr(lib, f"kiln_decode_step_{suffix}").argtypes = [
            C_PTR, C_INT64, C_PTR, C_INT64, C_PTR, C_PTR, C_PTR, C_PTR, C_PTR, C_PTR, C_PTR, C_PTR, C_PTR, C_PTR, C_PTR, ctypes.c_int,
            C_PTR]
        getattr(lib, f"kiln_decode_step_{suffix}").restype = ctypes.c_int


def _declare_other_kernels(lib: ctypes.CDLL) -> None:
    """Argument and result types of the linears' and the rest of the library's functions."""
    lib.kiln_kv_quantize.argtypes = [C_PTR, C_INT64, ctypes.c_float, C_INT64, C_PTR]
    lib.kiln_kv_quantize.restype = None
    lib.kiln_fp8_to_f32.argtypes = [C_PTR, C_INT64, C_PTR]
    lib.kiln_fp8_to_f32.restype = None
    lib.kiln_decode_step_scratch.argtypes = [C_PTR, C_INT64]
    lib.kiln_decode_step_scratch.restype = C_INT64
    lib.kiln_amx_available.argtypes = []
    lib.kiln_amx_available.restype = ctypes.c_int
    lib.kiln_set_amx.argtypes = [ctypes.c_int]
    lib.kiln_set_amx.restype = None
    lib.kiln_set_amx(int(env.amx_enabled()))
    lib.kiln_vector_panels_available.argtypes = []
    lib.kiln_vector_panels_available.restype = ctypes.c_int
    lib.kiln_quant_batch_invariant_rows.argtypes = []
    lib.kiln_quant_batch_invariant_rows.restype = C_INT64
    for name in ("kiln_packed_linear_bf16", "kiln_portable_linear_bf16"):
        getattr(lib, name).argtypes = [C_PTR] * 4 + [C_INT64] * 3 + [ctypes.c_int]
        getattr(lib, name).restype = None
    lib.kiln_quant_pack.argtypes = [C_PTR, C_PTR, C_INT64, C_INT64, C_INT64, ctypes.c_int]
    lib.kiln_fit_offset_groups.argtypes = [C_PTR, C_PTR] + [C_INT64] * 3 + [C_PTR, C_INT64, C_PTR, C_PTR, ctypes.c_int]
    lib.kiln_fit_offset_groups.restype = None
    lib.kiln_quant_pack.restype = None
    lib.kiln_quant_linear_bf16.argtypes = [C_PTR] * 4 + [C_INT64] * 2 + [C_PTR] * 2 + [C_INT64] * 3 + [ctypes.c_int]
    lib.kiln_quant_linear_bf16.restype = None
    lib.kiln_fp8_linear_bf16.argtypes = [C_PTR, C_PTR, C_PTR, ctypes.c_float] + [C_PTR] * 3 + [C_INT64] * 3 + [ctypes.c_int]
    lib.kiln_fp8_linear_bf16.restype = None
    lib.kiln_fp8_quantize_rows.argtypes = [C_PTR, C_INT64, C_INT64, C_PTR, ctypes.c_float, C_PTR, ctypes.c_int]
    lib.kiln_fp8_quantize_rows.restype = None
    lib.kiln_fp8_to_bf16.argtypes = [C_PTR, C_INT64, C_PTR]
    lib.kiln_fp8_to_bf16.restype = None
    lib.kiln_moe_route.argtypes = [C_PTR] + [C_INT64] * 5 + [C_PTR, C_PTR]
    lib.kiln_moe_route.restype = None
    lib.kiln_moe_experts_supported.argtypes = []
    lib.kiln_moe_experts_supported.restype = ctypes.c_int
    lib.kiln_moe_experts_bf16.argtypes = [C_PTR, C_INT64, C_INT64, C_PTR, C_PTR, C_INT64] + [C_PTR] * 5 + [
        C_INT64, ctypes.c_float, ctypes.c_float, C_PTR, ctypes.c_int]
    lib.kiln_moe_experts_bf16.restype = ctypes.c_int
    lib.kiln_w8a8_supported.argtypes = [C_INT64, C_INT64]
    lib.kiln_w8a8_supported.restype = ctypes.c_int
    lib.kiln_w8a8_linear_bf16.argtypes = [C_PTR] * 6 + [C_INT64] * 3 + [ctypes.c_int]
    lib.kiln_w8a8_linear_bf16.restype = None


def output(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (checked: a contiguous ``[rows, cols]`` tensor of ``dtype``) or a new one."""
    if out is None:
        return torch.empty(rows, cols, dtype=dtype)
    if tuple(out.shape) != (rows, cols) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {dtype} [{rows}, {cols}], got {out.dtype} {list(out.shape)}")
    return out
