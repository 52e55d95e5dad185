"""Bindings of recurrent.c: the decode steps of hybrid models' recurrent layers (Gated DeltaNet,
LFM2's short convolution, Mamba2), one token for each of a group of sequences, reading each state from its
read slot and writing the next to its write slot in one pass."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kiln.kernels.library import DTYPE_SUFFIX, native_library

C_INT64, C_PTR = ctypes.c_int64, ctypes.c_void_p


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The native library with recurrent.c's functions declared (None without it)."""
    lib = native_library()
    if lib is None:
        return None
    for suffix in DTYPE_SUFFIX.values():
        fn = getattr(lib, f"kiln_gated_delta_decode_{suffix}")
        fn.argtypes = ([C_PTR, C_INT64] * 4 + [C_PTR] * 6 + [ctypes.c_float] + [C_PTR] * 4 + [C_INT64] * 7
                       + [ctypes.c_int])
        fn.restype = ctypes.c_int
        fn = getattr(lib, f"kiln_short_conv_decode_{suffix}")
        fn.argtypes = [C_PTR, C_INT64] + [C_PTR] * 7 + [C_INT64] * 3 + [ctypes.c_int]
        fn.restype = None
        fn = getattr(lib, f"kiln_mamba2_decode_{suffix}")
        fn.argtypes = ([C_PTR, C_INT64] + [C_PTR] * 11 + [C_INT64] * 6 + [ctypes.c_float] * 2 + [ctypes.c_int])
        fn.restype = ctypes.c_int
    return lib


def recurrent_decode_supported(x: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether the decode kernels take projections ``x`` (a CPU float32 / bfloat16 tensor with
    contiguous rows) and a convolution state of the same dtype, with the native library built."""
    return (x.dtype in DTYPE_SUFFIX and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1
            and state.dtype == x.dtype and _library() is not None)


def _slots(group) -> tuple[int, int, int]:
    return group.read.data_ptr(), group.write.data_ptr(), group.fresh.data_ptr()


def gated_delta_decode(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                       conv_state: torch.Tensor, delta_state: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, group, out: torch.Tensor, *, key_heads: int,
                       key_dim: int, value_dim: int, tiled: bool) -> None:
    """Gated DeltaNet for a group of one-token sequences: its projections' rows (``mixed`` the
    q/k/v channels, ``z`` the output gate, ``b`` and ``a``), states updated from the group's read to
    its write slots, the gated-normed output written to ``out`` ``[count, value heads * value_dim]``
    (contiguous)."""
    value_heads = b.shape[1]
    for t in (mixed, z, b, a):
        if t.stride(-1) != 1 or t.dtype != mixed.dtype:
            raise ValueError("gated_delta_decode: projections need contiguous rows of one dtype")
    weights = [w.contiguous() for w in (conv_weight, a_log, dt_bias, norm_weight)]
    read, write, fresh = _slots(group)
    rc = getattr(_library(), f"kiln_gated_delta_decode_{DTYPE_SUFFIX[mixed.dtype]}")(
        mixed.data_ptr(), mixed.stride(0), z.data_ptr(), z.stride(0), b.data_ptr(), b.stride(0), a.data_ptr(),
        a.stride(0), weights[0].data_ptr(), conv_state.data_ptr(), delta_state.data_ptr(), weights[1].data_ptr(),
        weights[2].data_ptr(), weights[3].data_ptr(), eps, read, write, fresh, out.data_ptr(), group.count,
        key_heads, value_heads, key_dim, value_dim, conv_weight.shape[1], int(tiled), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("gated_delta_decode: out of memory for its scratch")


def short_conv_decode(bcx: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                      conv_state: torch.Tensor, group, out: torch.Tensor) -> None:
    """LFM2's short-convolution block for a group of one-token sequences: from in_proj's rows
    ``bcx`` ``[count, 3 hidden]`` (b | c | x) to ``c * conv(b * x)`` in ``out`` ``[count, hidden]``
    (contiguous), the convolution's state updated from the group's read to its write slots."""
    hidden = bcx.shape[1] // 3
    weight = conv_weight.contiguous()
    bias = None if conv_bias is None else conv_bias.contiguous()
    read, write, fresh = _slots(group)
    getattr(_library(), f"kiln_short_conv_decode_{DTYPE_SUFFIX[bcx.dtype]}")(
        bcx.data_ptr(), bcx.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        conv_state.data_ptr(), read, write, fresh, out.data_ptr(), group.count, hidden, conv_weight.shape[1],
        torch.get_num_threads())


def mamba2_decode(projected: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                  conv_state: torch.Tensor, ssm_state: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                  d_skip: torch.Tensor, group, y: torch.Tensor, *, groups: int, head_dim: int, state_size: int,
                  time_step_limit: tuple[float, float]) -> None:
    """Mamba2 for a group of one-token sequences: from in_proj's rows ``projected`` ``[count, inner
    | conv channels | heads]`` to the SSM output (D skip included) in ``y`` (float32 ``[count,
    inner]``, contiguous), the convolution and SSM states updated from the group's read to its
    write slots."""
    heads = a_log.shape[0]
    if y.dtype != torch.float32 or not y.is_contiguous() or ssm_state.dtype != torch.float32:
        raise ValueError("mamba2_decode: y and the SSM state must be contiguous float32")
    weights = [None if w is None else w.contiguous() for w in (conv_weight, conv_bias, a_log, dt_bias, d_skip)]
    pointers = [None if w is None else w.data_ptr() for w in weights]
    read, write, fresh = _slots(group)
    rc = getattr(_library(), f"kiln_mamba2_decode_{DTYPE_SUFFIX[projected.dtype]}")(
        projected.data_ptr(), projected.stride(0), pointers[0], pointers[1], conv_state.data_ptr(),
        ssm_state.data_ptr(), *pointers[2:], read, write, fresh, y.data_ptr(), group.count, heads, head_dim,
        state_size, groups, conv_weight.shape[1], time_step_limit[0], time_step_limit[1], torch.get_num_threads())
    if rc != 0:
        raise MemoryError("mamba2_decode: out of memory for its scratch")
