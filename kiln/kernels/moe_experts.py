"""The routed experts of a mixture-of-experts block for a decode step's few tokens in one native
call (moe_experts.c): the chosen experts' fused gate/up projections, activation, down
projections and the weighted sum, with weight-only quantized experts stacked expert-major."""
from __future__ import annotations

import ctypes

import torch

from kiln.kernels.library import C_INT64, C_PTR, native_library

# Tokens per call: decode batches. A longer prompt chunk's experts each take many rows (tiles either
# way) and the call's buffers grow with its tokens: the layer groups them in PyTorch.
MOE_MAX_ROWS = 256
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}  # moe_experts.c KILN_ACT_*
SHARED_MAX_ROWS = 12  # at most quant_gemv.h KILN_QUANT_GEMV_MAX_ROWS (12 or 32): a shared expert joins calls this short


class ExpertWeights(ctypes.Structure):
    """One projection of every expert (moe_experts.c ``kiln_experts``): expert ``e``'s codes,
    scales and offsets (or NULL) ``e`` strides (bytes) past expert 0's, its bias ``[E, n]`` (or
    NULL), the kernels' ``bits`` argument and group (0: int8 scales per channel)."""
    _fields_ = [("codes", C_PTR), ("scales", C_PTR), ("offsets", C_PTR), ("bias", C_PTR),
                ("codes_stride", C_INT64), ("scales_stride", C_INT64), ("offsets_stride", C_INT64),
                ("bits", C_INT64), ("group", C_INT64), ("n", C_INT64), ("k", C_INT64)]


def expert_weights(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bias: torch.Tensor | None,
                   bits: int, group: int) -> ExpertWeights:
    """``ExpertWeights`` over stacked engine tensors (``[E, ...]`` each, contiguous; ``bits`` as
    ``kernels.quant_bits_arg`` gives it, ``group`` as ``kernels.quant_kernel_group``)."""
    n = codes.shape[1]
    width = codes.shape[2]  # bytes a row: k, 3k / 4 (6-bit) or k / 2 (4-bit)
    k = {8: width, 6: width * 4 // 3, 4: width * 2}[bits & 0xff]

    def stride(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.stride(0) * t.element_size()

    return ExpertWeights(codes.data_ptr(), scales.data_ptr(), offsets.data_ptr() if offsets is not None else None,
                         bias.data_ptr() if bias is not None else None, stride(codes), stride(scales), stride(offsets),
                         bits, group, n, k)


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights, int64 expert ids), each ``[m, top_k]``, of router logits ``[m, E]``
    (contiguous fp32 or bf16): the softmax over all experts in float32, its ``top_k`` largest,
    divided by their sum when ``normalize`` (moe_experts.c ``kiln_moe_route``)."""
    m, num_experts = logits.shape
    ids = torch.empty(m, top_k, dtype=torch.int64)
    weights = torch.empty(m, top_k, dtype=torch.float32)
    native_library().kiln_moe_route(logits.data_ptr(), int(logits.dtype == torch.bfloat16), m, num_experts, top_k,
                                    int(normalize), ids.data_ptr(), weights.data_ptr())
    return weights, ids


def moe_experts_supported() -> bool:
    """Whether ``moe_experts`` runs here (the native library, with the integer GEMV)."""
    lib = native_library()
    return lib is not None and bool(lib.kiln_moe_experts_supported())


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fc: ExpertWeights,
                proj: ExpertWeights, activation: str = "silu", alpha: float = 0.0, limit: float = 0.0, *,
                num_experts: int, shared: tuple[ExpertWeights, ExpertWeights] | None = None,
                shared_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` for bf16 ``x`` ``[m, hidden]``
    (``m`` <= ``MOE_MAX_ROWS``), int64 ``experts`` and float32 ``weights`` ``[m, top_k]``; each
    expert ``act(x fc^T (+b)) proj^T (+b)`` with ``fc`` the fused ``[fc | up]`` projection and
    ``activation`` "silu" (``silu(fc) * up``) or "clamped_swiglu" (gpt-oss's, with ``alpha``
    and ``limit``). Float32 sums; bf16 ``[m, hidden]`` out. Experts chosen by up to 12 of the
    tokens run on the integer GEMV (a token's result then does not depend on the others), the
    rest on dequantized tiles. ``shared``: a shared expert's (fc, proj) (one expert each, same
    activation; ``m`` <= ``SHARED_MAX_ROWS``) that every token takes, times ``shared_weights``
    (float32 ``[m]``; None: 1), summed with the routed experts in float32."""
    m, top_k = experts.shape
    if shared is not None and m > SHARED_MAX_ROWS:
        raise ValueError(f"moe_experts: a shared expert takes at most {SHARED_MAX_ROWS} rows, got {m}")
    experts, weights = experts.contiguous(), weights.float().contiguous()
    x = x.contiguous()
    if shared_weights is not None:
        shared_weights = shared_weights.float().reshape(m).contiguous()
    out = torch.empty(m, proj.n, dtype=torch.bfloat16)
    shared_fc, shared_proj = (ctypes.byref(shared[0]), ctypes.byref(shared[1])) if shared is not None else (None, None)
    rc = native_library().kiln_moe_experts_bf16(
        x.data_ptr(), m, top_k, experts.data_ptr(), weights.data_ptr(), num_experts, ctypes.byref(fc),
        ctypes.byref(proj), shared_fc, shared_proj, shared_weights.data_ptr() if shared_weights is not None else None,
        ACTIVATIONS[activation], alpha, limit, out.data_ptr(), torch.get_num_threads())
    if rc == 3:
        raise ValueError(f"moe_experts: an expert index outside 0..{num_experts - 1}")
    if rc != 0:
        raise MemoryError("moe_experts: no memory for the step's buffers") if rc == 2 else \
            RuntimeError("moe_experts: this build has no integer GEMV (see moe_experts_supported)")
    return out
