"""Native CPU kernels, compiled on first use with the machine's C compiler.

* ``paged_decode_attention`` (paged_attention.c): one query token per sequence against its
  K/V read in place from the paged cache (of the query's dtype, or int8 / float8 e4m3 codes);
* ``rmsnorm``, ``silu_mul``, ``rotary_`` (elementwise.c): a layer's elementwise work, one
  pass each;
* ``skinny_linear`` (skinny_gemm.c): fp32/bf16 linears of a few rows (decode steps), and
  ``head_linear``, the same with a weight per head;
* ``packed_linear`` (panel_linear.c, amx_linear.c): bf16 linears on a weight packed once
  into tiles, multiplied on AMX or with AVX512-BF16 dot products;
* ``quant_linear`` (quant_linear.c): weight-only int8 / 4-bit linears;
* ``fp8_linear`` (fp8_linear.c): FP8 e4m3 weights and activations, emulated exactly;
* ``moe_experts`` (moe_experts.c): a mixture-of-experts block's chosen experts for a few
  tokens, in one call;
* ``decode_step`` (decode_step.c): every layer of a LLaMA-shaped stack for a decode step's
  tokens, in one call (no per-layer Python);
* ``gated_delta_decode``, ``short_conv_decode``, ``mamba2_decode`` (recurrent.c): a hybrid
  model's recurrent layer for a decode step's tokens, each state read and written once.

The sources are plain C (no PyTorch headers), so a build takes a few seconds; the shared
library is cached under ``$KILN_CACHE_DIR/kernels/<key>/`` where the key covers the sources,
the compiler, its flags and the CPU's feature flags (the build uses ``-march=native``).
Calls go through ctypes with raw tensor pointers; ctypes releases the GIL during the call.

Without a compiler (or with ``KILN_NATIVE_KERNELS=0``) ``native_library()`` returns None
and callers use their PyTorch path. ``kiln.kernels.library`` builds and loads the library,
``kiln.kernels.decode_step`` holds the decode step's structures; this module is the face.
"""
from __future__ import annotations

import torch

from kiln.kernels.decode_step import (LORA_SLOTS, DecoderDims, DecoderHead, DecoderLayerWeights,
                                      LatentAttentionWeights, LinearWeights, LoraLinear, LoraStepWeights,
                                      MoeBlockWeights, decode_step, decode_step_scratch_size, moe_block_weights)
from kiln.kernels.moe_experts import (MOE_MAX_ROWS, SHARED_MAX_ROWS, ExpertWeights, expert_weights, moe_experts,
                                      moe_experts_supported, moe_route)
from kiln.kernels.library import DECODE_KERNELS, DECODE_KERNELS_QUANTIZED_KV, DTYPE_SUFFIX, native_library, output
from kiln.kernels.quant_weights import (CODEBOOKS, CODES_E2M1, SUPER_K, fit_offset_groups, quant_batch_invariant_rows,
                                        quant_bits_arg, quant_kernel_group, quant_linear, quant_pack,
                                        quant_pack_scales, quant_shape_tiles, super_bytes)
from kiln.kernels.recurrent import gated_delta_decode, mamba2_decode, recurrent_decode_supported, short_conv_decode
from kiln.kernels.packed_linear import (amx_available, pack_bf16, packed_linear, packed_linear_available,
                                        packed_supported, tile_packable, unpack_bf16)


def release_thread_pool() -> None:
    """Let go of the calling thread's OpenMP worker threads (they come back if it runs OpenMP
    again).

    OpenMP keeps a pool of workers per thread that ran a parallel region. Once the model runs on
    another thread (the executor's), the loading thread's idle pool makes libgomp count more
    threads than cores, and it then puts workers to sleep at every region's end: each of the
    kernels' short regions paid a wake-up, 2-4x slower here. The executor calls this on the
    thread that loaded the engine before handing the model to its own thread.
    """
    lib = native_library()
    if lib is not None and hasattr(lib, "omp_pause_resource_all"):
        lib.omp_pause_resource_all(1)  # omp_pause_soft


def elementwise_supported(x: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels take ``x``: a CPU fp32/bf16 tensor whose rows
    (last dim) are contiguous, with the native library built."""
    return (x.dtype in DTYPE_SUFFIX and x.device.type == "cpu" and x.stride(-1) == 1 and x.dim() == 2
            and native_library() is not None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row of 2-D ``x`` (see ``elementwise_supported``)."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=x.dtype)
    getattr(native_library(), f"kiln_rmsnorm_{DTYPE_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), weight.contiguous().data_ptr(), out.data_ptr(), rows, dim, eps,
        torch.get_num_threads())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a contiguous float32 ``[rows, n]`` (int64 ``[rows]``: the first
    maximum, or the first NaN), in one native pass; torch's runs ~30 us on a vocabulary."""
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    native_library().kiln_argmax_rows_f32(x.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where each row of 2-D ``gate_up`` is ``[gate | up]``."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    getattr(native_library(), f"kiln_silu_mul_{DTYPE_SUFFIX[gate_up.dtype]}")(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, start: int = 0) -> torch.Tensor:
    """Rotate dims ``start .. start + rotary_dim`` of each head of ``x`` ``[tokens, heads,
    head_size]`` in place (rotate_half pairing) by fp32 ``cos``/``sin`` ``[tokens, rotary_dim]``;
    heads of a token must be contiguous (MLA rotates the rope dims at the end of each head)."""
    tokens, heads, head_size = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_size or cos.dtype != torch.float32 or start + rotary_dim > head_size:
        raise ValueError("rotary_: x needs contiguous heads holding the rotated dims; cos/sin must be float32")
    cos, sin = cos.contiguous(), sin.contiguous()
    getattr(native_library(), f"kiln_rotary_{DTYPE_SUFFIX[x.dtype]}")(
        x.data_ptr() + start * x.element_size(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads,
        head_size, rotary_dim, torch.get_num_threads())
    return x


# The KILN_KV_* kind of each quantized cache type (dtypes.h), as kv_quantize and decode_step.c take it.
KV_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}


def supports_decode_attention(dtype: torch.dtype) -> bool:
    """Whether ``paged_decode_attention`` has a native kernel for this dtype here."""
    return dtype in DECODE_KERNELS and native_library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, token_index: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                           scale: float, *, window: int | None = None, alibi_slopes: torch.Tensor | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           kv_scales: tuple[float, float] | list[float] | None = None, check: bool = True) -> None:
    """Attention of one query token per sequence over its paged K/V, written into ``out``.

    ``q``/``out``: ``[num_tokens, num_heads, head_size]`` (``q``'s tokens may be strided, e.g. a
    view into the fused qkv output); row ``token_index[i]`` belongs to
    sequence ``i``, whose cache holds ``seq_lens[i]`` tokens in blocks ``block_tables[i]``.
    ``k_cache``/``v_cache``: ``[num_blocks, num_kv_heads, block_size, head_size]``.
    ``window``: a sequence of length L attends to its last ``window`` tokens only (None: all);
    ``alibi_slopes``: float32 ``[num_heads]``, adds ``slope * (key position - query position)``
    to each score; ``softcap``: scores become ``softcap * tanh(score / softcap)`` (after
    scaling, before ALiBi); ``sinks``: float32 ``[num_heads]`` attention sinks, one more logit
    per head in the softmax's denominator with no value of its own (gpt-oss).
    ``kv_scales``: ``(k_scale, v_scale)`` of a quantized cache, int8 (INT8 KV cache) or float8
    e4m3 (FP8 KV cache) codes, whose values times the scale are the K/V; None for a cache of
    ``q``'s dtype.
    ``check=False`` skips the argument checks (the attention backend, on its hot path, builds
    every argument itself).
    """
    lib = native_library()
    if lib is None or q.dtype not in DECODE_KERNELS:
        raise RuntimeError(f"no native decode attention kernel for {q.dtype}")
    if kv_scales is None:
        kernel = DECODE_KERNELS[q.dtype]
    elif k_cache.dtype in DECODE_KERNELS_QUANTIZED_KV:
        kernel = DECODE_KERNELS_QUANTIZED_KV[k_cache.dtype][q.dtype]
    else:
        raise ValueError(f"k_cache: kv_scales go with an int8 or float8_e4m3fn cache, got {k_cache.dtype}")
    k_scale, v_scale = (1.0, 1.0) if kv_scales is None else kv_scales
    if check:
        _check_decode_arguments(q, k_cache, v_cache, token_index, block_tables, seq_lens, out,
                                q.dtype if kv_scales is None else k_cache.dtype)
        if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or not alibi_slopes.is_contiguous()
                                         or tuple(alibi_slopes.shape) != (q.shape[1],)):
            raise ValueError(f"alibi_slopes: expected a contiguous float32 [{q.shape[1]}] tensor")
        if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()
                                  or tuple(sinks.shape) != (q.shape[1],)):
            raise ValueError(f"sinks: expected a contiguous float32 [{q.shape[1]}] tensor")
        if window is not None and window <= 0:
            raise ValueError(f"window: expected a positive number of tokens, got {window}")
    num_seqs = block_tables.shape[0]
    _, num_kv_heads, block_size, head_size = k_cache.shape
    rc = getattr(lib, kernel)(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), token_index.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), num_seqs, q.shape[1], num_kv_heads,
        head_size, block_size, block_tables.shape[1], scale, window or 0,
        alibi_slopes.data_ptr() if alibi_slopes is not None else None, softcap or 0.0,
        sinks.data_ptr() if sinks is not None else None, k_scale, v_scale,
        torch.get_num_threads())
    if rc == 1:
        raise ValueError(f"paged_decode_attention: {q.shape[1]} query heads do not group onto {num_kv_heads} KV heads")
    if rc == 2:
        raise MemoryError("paged_decode_attention: no memory for the context-split scratch buffer")


def kv_quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The codes the native decode step writes for float32 ``x`` with ``scale`` into a cache of
    ``dtype`` (int8 or float8_e4m3fn): ``x * (1 / scale)`` rounded by dtypes.h's ``i8_store`` /
    ``fp8_store``. Tests hold it against ``kiln.step.attention.quantize_kv``, which the
    layer-by-layer path writes with."""
    x = x.float().contiguous()
    codes = torch.empty(x.shape, dtype=dtype)
    inv = torch.tensor(scale, dtype=torch.float32).reciprocal().item()
    native_library().kiln_kv_quantize(x.data_ptr(), x.numel(), inv, KV_KINDS[dtype], codes.data_ptr())
    return codes


def fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of float8 e4m3 ``codes`` as the attention kernels convert them when they
    stage a block (16 at a time by vector, the rest of a row one by one)."""
    codes = codes.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32)
    native_library().kiln_fp8_to_f32(codes.data_ptr(), codes.numel(), out.data_ptr())
    return out


def _check_decode_arguments(q, k_cache, v_cache, token_index, block_tables, seq_lens, out,
                            cache_dtype: torch.dtype) -> None:
    for name, t, dtype in (("k_cache", k_cache, cache_dtype), ("v_cache", v_cache, cache_dtype), ("out", out, q.dtype)):
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor")
    if q.device.type != "cpu" or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        raise ValueError("q: expected a CPU tensor whose heads are contiguous within a token")
    for name, t in (("token_index", token_index), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous int64 tensor")


SKINNY_MAX_ROWS = 16  # fp32: beyond this MKL wins (docs/benchmark-log.md)


def skinny_linear_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``skinny_linear`` takes these: 1..``SKINNY_MAX_ROWS`` contiguous rows of fp32/bf16
    activations and a contiguous weight (and bias) of the same dtype."""
    return (x.dtype in DTYPE_SUFFIX and weight.dtype == x.dtype and x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS
            and x.device.type == "cpu" and weight.is_contiguous()
            and (bias is None or (bias.is_contiguous() and bias.dtype == x.dtype)) and native_library() is not None)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  check: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows ``x`` ``[m, k]`` and a ``weight`` ``[n, k]``, both
    fp32 or both bf16 (see ``skinny_linear_supported``): decode steps' matmuls, which read each
    weight once. ``check=False`` is for a caller that has just asked ``skinny_linear_supported``."""
    if check and (not skinny_linear_supported(x, weight, bias) or weight.shape[1] != x.shape[1]):
        raise ValueError(f"skinny_linear: needs 1-{SKINNY_MAX_ROWS} fp32/bf16 rows [m, k] and a contiguous weight "
                         f"[n, k] of their dtype; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    m, n = x.shape[0], weight.shape[0]
    y = output(out, m, n, x.dtype)
    getattr(native_library(), f"kiln_skinny_gemm_{DTYPE_SUFFIX[x.dtype]}")(
        x.contiguous().data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
        m, n, x.shape[1], torch.get_num_threads())
    return y


def head_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per head ``out[t, h] = x[t, h] @ weight[h].T`` (``x`` ``[m, heads, k]``, contiguous ``weight``
    ``[heads, n, k]``, ``out`` ``[m, heads, n]``; ``x`` and ``out`` may be strided views, the last
    dim contiguous): the skinny GEMM per head for a few fp32/bf16 rows, ``torch.matmul`` else."""
    (m, heads, k), n, lib = x.shape, weight.shape[1], native_library()
    if (lib is None or x.dtype not in DTYPE_SUFFIX or weight.dtype != x.dtype or out.dtype != x.dtype
            or m > SKINNY_MAX_ROWS or not weight.is_contiguous() or x.stride(2) != 1 or out.stride(2) != 1
            or tuple(weight.shape) != (heads, n, k) or tuple(out.shape) != (m, heads, n)):
        out.copy_(torch.matmul(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1))
        return out
    getattr(lib, f"kiln_head_gemm_{DTYPE_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), x.stride(1), weight.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        heads, m, n, k, torch.get_num_threads())
    return out


def w8a8_supported(x_dtype: torch.dtype, codes: torch.Tensor) -> bool:
    """Whether ``w8a8_linear`` takes inputs of ``x_dtype`` (bf16 only) with int8 CPU ``codes``
    ``[n, k]`` (n % 16 == 0, k % 32 == 0, a CPU with AVX512-VNNI)."""
    lib = native_library()
    return (lib is not None and x_dtype == torch.bfloat16 and codes.dtype == torch.int8
            and codes.device.type == "cpu" and bool(lib.kiln_w8a8_supported(codes.shape[0], codes.shape[1])))


def w8a8_linear(x: torch.Tensor, codes: torch.Tensor, weight_scales: torch.Tensor, prequant: torch.Tensor | None,
                bias: torch.Tensor | None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SmoothQuant's W8A8 ``x W^T (+ bias)`` for bf16 ``x`` ``[m, k]``: each row times
    ``prequant`` quantized to int8 with its own scale, integer dot products with the row-major
    int8 ``codes`` ``[n, k]``, scaled by the row's and ``weight_scales``' factors (float32 ``[n]``);
    bit for bit ``kiln.quantization.smoothquant.w8a8_linear``'s torch arithmetic (w8a8_linear.c).
    Needs ``w8a8_supported``."""
    m, k = x.shape
    n = codes.shape[0]
    y = output(out, m, n, torch.bfloat16)
    native_library().kiln_w8a8_linear_bf16(
        x.contiguous().data_ptr(), codes.data_ptr(), weight_scales.data_ptr(),
        prequant.data_ptr() if prequant is not None else None, bias.data_ptr() if bias is not None else None,
        y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, weight_scales: torch.Tensor, act_scale: float,
               prequant: torch.Tensor | None, bias: torch.Tensor | None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 linear of bf16 ``x`` ``[m, k]`` (fp8_linear.c): ``x * prequant / act_scale`` rounded to
    e4m3, times the e4m3 ``codes`` (tile order, ``quant_pack`` with 8 bits, any 1-byte dtype),
    each column's sum times ``act_scale * weight_scales[c]`` (float32 ``[n]``), plus ``bias``."""
    m, k = x.shape
    n = codes.shape[0]
    y = output(out, m, n, torch.bfloat16)
    native_library().kiln_fp8_linear_bf16(
        x.contiguous().data_ptr(), codes.data_ptr(), weight_scales.data_ptr(), act_scale,
        prequant.data_ptr() if prequant is not None else None, bias.data_ptr() if bias is not None else None,
        y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def fp8_quantize_rows(x: torch.Tensor, act_scale: float, prequant: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``x * prequant / act_scale`` rounded to the nearest e4m3 value (ties to even,
    saturating at +-448), as ``fp8_linear`` rounds its input."""
    x = x.contiguous()
    out = torch.empty_like(x)
    native_library().kiln_fp8_quantize_rows(x.data_ptr(), x.shape[0], x.shape[1],
                                            prequant.data_ptr() if prequant is not None else None, act_scale,
                                            out.data_ptr(), torch.get_num_threads())
    return out


def fp8_to_bf16(codes: torch.Tensor) -> torch.Tensor:
    """The bf16 values of e4m3 ``codes`` (any 1-byte dtype), as the kernels decode them."""
    codes = codes.contiguous()
    out = torch.empty(codes.shape, dtype=torch.bfloat16)
    native_library().kiln_fp8_to_bf16(codes.data_ptr(), codes.numel(), out.data_ptr())
    return out


