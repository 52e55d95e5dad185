"""Native CPU kernels, compiled on first use with the machine's C compiler.

* ``paged_decode_attention`` (paged_attention.c): one query token per sequence against its
  K/V read in place from the paged cache;
* ``rmsnorm``, ``silu_mul``, ``rotary_`` (elementwise.c): a layer's elementwise work, one
  pass each;
* ``gemv`` (gemv.c): one-row fp32/bf16 linears (batch-1 decode);
* ``decode_step`` (decode_step.c): every layer of a LLaMA-shaped stack for one token, in one
  call (batch-1 decode without per-layer Python).

The sources are plain C (no PyTorch headers), so a build takes a few seconds; the shared
library is cached under ``$KILN_CACHE_DIR/kernels/<key>/`` where the key covers the sources,
the compiler, its flags and the CPU's feature flags (the build uses ``-march=native``).
Calls go through ctypes with raw tensor pointers; ctypes releases the GIL during the call.

Without a compiler (or with ``KILN_NATIVE_KERNELS=0``) ``native_library()`` returns None
and callers use their PyTorch path.
"""
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

from kiln.engine_cache import default_cache_dir

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(p.name for p in Path(__file__).parent.glob("*.c")))  # what the cache key hashes
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-Wall"]
# Linked in a separate step without -ffast-math: linking with it adds crtfastmath.o, whose
# constructor turns on flush-to-zero for the whole process (torch's numerics included).
LINK_FLAGS = ["-shared", "-fopenmp"]

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_DECODE_ARGTYPES = [_PTR, _I64] + [_PTR] * 6 + [_I64] * 6 + [ctypes.c_float, ctypes.c_int]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, out: Path) -> None:
    here = Path(__file__).parent
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        objects = [str(Path(tmp) / f"{Path(s).stem}.o") for s in SOURCES]
        commands = [[compiler, *COMPILE_FLAGS, "-c", str(here / s), "-o", o] for s, o in zip(SOURCES, objects)]
        commands.append([compiler, *LINK_FLAGS, *objects, "-o", str(tmp_lib), "-lm"])
        for cmd in commands:
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr}")
        os.replace(tmp_lib, out)  # atomic: a concurrent build can only replace it with the same bytes


@lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel library, built if needed; None if native kernels are unavailable."""
    if os.environ.get("KILN_NATIVE_KERNELS", "1") == "0" or sys.platform != "linux":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: using the PyTorch paths")
        return None
    here = Path(__file__).parent
    key = hashlib.sha256()
    sources = [p.read_bytes() for p in sorted(here.glob("*.[ch]"))]
    for part in (*sources, compiler.encode(), " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(),
                 _cpu_flags().encode(), torch.__version__.encode()):
        key.update(part)
    lib_path = default_cache_dir() / "kernels" / key.hexdigest()[:16] / "libkiln_kernels.so"
    try:
        if not lib_path.exists():
            _build(compiler, lib_path)
        torch.get_num_threads()  # torch's libgomp is loaded first, so the kernels share its pool
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError) as e:
        log.warning("native kernels unavailable (%s): using the PyTorch paths", e)
        return None
    for name in ("kiln_paged_decode_attention_f32", "kiln_paged_decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = _DECODE_ARGTYPES
        fn.restype = ctypes.c_int
    for suffix in _SUFFIX.values():
        getattr(lib, f"kiln_rmsnorm_{suffix}").argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_float,
                                                            ctypes.c_int]
        getattr(lib, f"kiln_silu_mul_{suffix}").argtypes = [_PTR, _I64, _PTR, _I64, _I64, ctypes.c_int]
        getattr(lib, f"kiln_rotary_{suffix}").argtypes = [_PTR, _I64, _PTR, _PTR] + [_I64] * 4 + [ctypes.c_int]
        for kind in ("rmsnorm", "silu_mul", "rotary"):
            getattr(lib, f"kiln_{kind}_{suffix}").restype = None
    for suffix in _SUFFIX.values():
        getattr(lib, f"kiln_gemv_{suffix}").argtypes = [_PTR] * 4 + [_I64] * 2 + [ctypes.c_int]
        getattr(lib, f"kiln_gemv_{suffix}").restype = None
        getattr(lib, f"kiln_decode_step_{suffix}").argtypes = [
            _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, ctypes.c_int]
        getattr(lib, f"kiln_decode_step_{suffix}").restype = ctypes.c_int
    lib.kiln_decode_step_scratch.argtypes = [_PTR]
    lib.kiln_decode_step_scratch.restype = _I64
    return lib


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def elementwise_supported(x: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels take ``x``: a CPU fp32/bf16 tensor whose rows
    (last dim) are contiguous, with the native library built."""
    return (x.dtype in _SUFFIX and x.device.type == "cpu" and x.stride(-1) == 1 and x.dim() == 2
            and native_library() is not None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row of 2-D ``x`` (see ``elementwise_supported``)."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=x.dtype)
    getattr(native_library(), f"kiln_rmsnorm_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), weight.contiguous().data_ptr(), out.data_ptr(), rows, dim, eps,
        torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where each row of 2-D ``gate_up`` is ``[gate | up]``."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    getattr(native_library(), f"kiln_silu_mul_{_SUFFIX[gate_up.dtype]}")(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_size]`` in place (rotate_half pairing) by fp32
    ``cos``/``sin`` ``[tokens, rotary_dim]``; heads of a token must be contiguous."""
    tokens, heads, head_size = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_size or cos.dtype != torch.float32:
        raise ValueError("rotary_: x needs contiguous heads and cos/sin must be float32")
    cos, sin = cos.contiguous(), sin.contiguous()
    getattr(native_library(), f"kiln_rotary_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_size, rotary_dim,
        torch.get_num_threads())
    return x


_DECODE_KERNELS = {torch.float32: "kiln_paged_decode_attention_f32", torch.bfloat16: "kiln_paged_decode_attention_bf16"}


def supports_decode_attention(dtype: torch.dtype) -> bool:
    """Whether ``paged_decode_attention`` has a native kernel for this dtype here."""
    return dtype in _DECODE_KERNELS and native_library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, token_index: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                           scale: float, *, check: bool = True) -> None:
    """Attention of one query token per sequence over its paged K/V, written into ``out``.

    ``q``/``out``: ``[num_tokens, num_heads, head_size]`` (``q``'s tokens may be strided, e.g. a
    view into the fused qkv output); row ``token_index[i]`` belongs to
    sequence ``i``, whose cache holds ``seq_lens[i]`` tokens in blocks ``block_tables[i]``.
    ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]``.
    ``check=False`` skips the argument checks (the attention backend, on its hot path, builds
    every argument itself).
    """
    lib = native_library()
    if lib is None or q.dtype not in _DECODE_KERNELS:
        raise RuntimeError(f"no native decode attention kernel for {q.dtype}")
    if check:
        _check_decode_arguments(q, k_cache, v_cache, token_index, block_tables, seq_lens, out)
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_size = k_cache.shape
    rc = getattr(lib, _DECODE_KERNELS[q.dtype])(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), token_index.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), num_seqs, q.shape[1], num_kv_heads,
        head_size, block_size, block_tables.shape[1], scale, torch.get_num_threads())
    if rc == 1:
        raise ValueError(f"paged_decode_attention: {q.shape[1]} query heads do not group onto {num_kv_heads} KV heads")
    if rc == 2:
        raise MemoryError("paged_decode_attention: no memory for the context-split scratch buffer")


def _check_decode_arguments(q, k_cache, v_cache, token_index, block_tables, seq_lens, out) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.dtype != q.dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: expected a contiguous CPU {q.dtype} tensor")
    if q.device.type != "cpu" or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        raise ValueError("q: expected a CPU tensor whose heads are contiguous within a token")
    for name, t in (("token_index", token_index), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous int64 tensor")


def gemv_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``gemv`` takes these: one row of fp32/bf16 activations, a contiguous weight of
    the same dtype."""
    return (x.dtype in _SUFFIX and weight.dtype == x.dtype and x.dim() == 2 and x.shape[0] == 1
            and x.device.type == "cpu" and weight.is_contiguous()
            and (bias is None or (bias.is_contiguous() and bias.dtype == x.dtype)) and native_library() is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         check: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row ``x`` ``[1, k]`` and a ``weight`` ``[n, k]``,
    both fp32 or both bf16 (see ``gemv_supported``): batch-1 decode's matrix-vector products.
    ``check=False`` is for a caller that has just asked ``gemv_supported``."""
    if check and (not gemv_supported(x, weight, bias) or weight.shape[1] != x.shape[1]):
        raise ValueError(f"gemv: needs one fp32/bf16 row [1, k] and a contiguous weight [n, k] of its dtype; got "
                         f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    n = weight.shape[0]
    y = torch.empty(1, n, dtype=x.dtype)
    getattr(native_library(), f"kiln_gemv_{_SUFFIX[x.dtype]}")(
        x.contiguous().data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
        n, x.shape[1], torch.get_num_threads())
    return y


class DecoderLayerWeights(ctypes.Structure):
    """One layer's tensors for ``decode_step`` (raw pointers; a bias may be NULL)."""
    _fields_ = [(name, _PTR) for name in (
        "input_norm", "qkv", "qkv_bias", "dense", "dense_bias", "post_norm", "fused_fc", "fused_fc_bias",
        "proj", "proj_bias", "k_cache", "v_cache")]


class DecoderDims(ctypes.Structure):
    """The shapes ``decode_step`` needs (per rank; ``rot_dim`` 0 means no rotary)."""
    _fields_ = [(name, _I64) for name in (
        "hidden", "heads", "kv_heads", "head_size", "rot_dim", "inter", "block_size", "max_blocks")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def decode_step_scratch_size(dims: DecoderDims) -> int:
    """Elements of model dtype ``decode_step`` needs as scratch."""
    return native_library().kiln_decode_step_scratch(ctypes.byref(dims))


def decode_step(hidden: torch.Tensor, layers: ctypes.Array, dims: DecoderDims, cos: torch.Tensor, sin: torch.Tensor,
                slot: int, block_table: torch.Tensor, seq_len: int, scratch: torch.Tensor) -> None:
    """Run every layer of a LLaMA-shaped stack on one token's ``hidden`` ``[1, hidden]`` (in place).

    ``layers``: a ``DecoderLayerWeights`` array, each pointing at contiguous tensors of
    ``hidden``'s dtype, its KV cache ``[num_blocks, block_size, kv_heads, head_size]`` among
    them; the token's K/V go to cache ``slot`` and attention reads ``seq_len`` tokens through
    ``block_table`` (int64, ``dims.max_blocks`` entries). ``cos``/``sin``: float32
    ``[1, dims.rot_dim]``. The caller has checked every pointer (see
    ``kiln.models.native_decode``): nothing is checked here.
    """
    rc = getattr(native_library(), f"kiln_decode_step_{_SUFFIX[hidden.dtype]}")(
        hidden.data_ptr(), layers, len(layers), ctypes.byref(dims), cos.data_ptr(), sin.data_ptr(), slot,
        block_table.data_ptr(), seq_len, scratch.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode_step: attention kernel failed with code {rc}")
