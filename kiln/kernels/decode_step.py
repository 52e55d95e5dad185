"""The native decode step's ABI: the ctypes structures describing a LLaMA-shaped stack's
weights, dims, LM head and LoRA adapters, and the one call that runs every layer for a decode
step's tokens (decode_step.c)."""
from __future__ import annotations

import ctypes

import torch

from kiln.kernels.library import C_INT64, C_PTR, DTYPE_SUFFIX, native_library
from kiln.kernels.moe_experts import ACTIVATIONS, ExpertWeights


class LinearWeights(ctypes.Structure):
    """A linear layer for ``decode_step``: weight (tile-ordered codes when ``bits`` is 8, 6 or 4, or
    e4m3 codes when ``fp8``), bias (or NULL), tile-packed bf16 copy (or NULL), for quantized
    weights the group size (0: scales per channel), scales and offsets (or NULL) in the kernels'
    layout (``kernels.quant_pack_scales``), AWQ's ``prequant`` multiplier
    (or NULL) and a static FP8 activation scale (FP8, W4A8_AWQ; 0 for none); ``w8a8``: a
    SmoothQuant layer (row-major int8 codes, scales per column, ``prequant`` its smoothing)."""
    _fields_ = [("weight", C_PTR), ("bias", C_PTR), ("packed", C_PTR), ("bits", C_INT64), ("group", C_INT64),
                ("scales", C_PTR), ("offsets", C_PTR), ("prequant", C_PTR), ("fp8", C_INT64), ("act_scale", ctypes.c_float),
                ("w8a8", C_INT64)]


class MoeBlockWeights(ctypes.Structure):
    """A layer's experts block for ``decode_step`` (decode_step.c ``kiln_moe_block``): the bf16
    router weight ``[E, hidden]`` and bias (or NULL), ``top_k`` of ``num_experts`` (renormalized
    when ``normalize``, then times ``scaling``), the stacked experts' fused ``fc`` and ``proj``
    (``ExpertWeights``), the activation (``ACTIVATIONS``, with ``alpha`` and ``limit``) and, with
    ``has_shared``, an un-gated shared expert's ``shared_fc`` and ``shared_proj``."""
    _fields_ = [("router", C_PTR), ("router_bias", C_PTR), ("num_experts", C_INT64), ("top_k", C_INT64),
                ("normalize", C_INT64), ("fc", ExpertWeights), ("proj", ExpertWeights), ("act", C_INT64),
                ("alpha", ctypes.c_float), ("limit", ctypes.c_float), ("scaling", ctypes.c_float),
                ("has_shared", C_INT64), ("shared_fc", ExpertWeights), ("shared_proj", ExpertWeights)]


def moe_block_weights(router: torch.Tensor, router_bias: torch.Tensor | None, top_k: int, normalize: bool,
                      scaling: float, experts: tuple, shared: tuple | None) -> MoeBlockWeights:
    """``MoeBlockWeights`` for a contiguous bf16 router (and bias), ``experts`` as
    ``kiln.layers.moe.MixtureOfExperts.native_experts`` gives them (fc, proj, activation, alpha,
    limit) and a shared expert's (fc, proj) ``ExpertWeights`` (or None)."""
    fc, proj, activation, alpha, limit = experts
    block = MoeBlockWeights(router.data_ptr(), router_bias.data_ptr() if router_bias is not None else None,
                            router.shape[0], top_k, int(normalize), fc, proj, ACTIVATIONS[activation], alpha, limit,
                            scaling, int(shared is not None))
    if shared is not None:
        block.shared_fc, block.shared_proj = shared
    return block


class LatentAttentionWeights(ctypes.Structure):
    """A latent attention layer for ``decode_step`` (decode_step.c ``kiln_latent_attention``):
    ``q_a`` (zeroed without a q LoRA), ``q_b`` (the q projection), ``kv_a`` (``LinearWeights``),
    the q_a and kv_a norms' weights, the absorbed ``keys`` ``[heads, kv_lora, nope]`` and
    ``values`` ``[heads, v_head, kv_lora]`` (model dtype), the widths and the norms' epsilon."""
    _fields_ = [("q_a", LinearWeights), ("q_b", LinearWeights), ("kv_a", LinearWeights), ("q_a_norm", C_PTR),
                ("kv_norm", C_PTR), ("keys", C_PTR), ("values", C_PTR)] + [
        (name, C_INT64) for name in ("q_lora", "kv_lora", "nope", "rope", "v_head")] + [("eps", ctypes.c_float)]


class DecoderLayerWeights(ctypes.Structure):
    """One layer's tensors for ``decode_step`` (raw pointers), its sliding window (0: none), for
    a quantized cache its float32 ``[2]`` K/V scales (else NULL), its per-head q/k norm weights
    (else NULL) and its experts block (a ``MoeBlockWeights`` pointer replacing fused_fc and
    proj, else NULL), latent attention (a ``LatentAttentionWeights`` pointer replacing qkv, else
    NULL) and attention sinks (float32 ``[heads]``, else NULL)."""
    _fields_ = [("input_norm", C_PTR), ("post_norm", C_PTR)] + [
        (name, LinearWeights) for name in ("qkv", "dense", "fused_fc", "proj")] + [
        ("k_cache", C_PTR), ("v_cache", C_PTR), ("window", C_INT64), ("kv_scales", C_PTR),
        ("q_norm", C_PTR), ("k_norm", C_PTR), ("moe", C_PTR), ("mla", C_PTR), ("sinks", C_PTR)]


class DecoderDims(ctypes.Structure):
    """The shapes ``decode_step`` needs (per rank; ``rot_dim`` 0 means no rotary; ``inter`` the
    widest dense MLP, 0 when every layer has experts), the KV cache's element kind (0: the model
    dtype, else ``KV_KINDS`` of its dtype), the LM head's output width when the step computes
    logits (0: it does not) and the q/k norms' epsilon."""
    _fields_ = [(name, C_INT64) for name in (
        "hidden", "heads", "kv_heads", "head_size", "rot_dim", "inter", "block_size", "max_blocks")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_kind", C_INT64), ("head_width", C_INT64),
        ("qk_eps", ctypes.c_float)]


class DecoderHead(ctypes.Structure):
    """The final RMSNorm's weight and eps and the LM head for ``decode_step``, whose first
    ``vocab`` outputs are the logits."""
    _fields_ = [("norm", C_PTR), ("eps", ctypes.c_float), ("linear", LinearWeights), ("vocab", C_INT64)]


class LoraLinear(ctypes.Structure):
    """One adapter's module inside one linear for ``decode_step`` (e.g. attn_k of the fused qkv):
    float32 ``a`` ``[rank, in]`` and ``bt`` ``[rank, width]`` (B transposed) for output columns
    ``start:start + width``, DoRA's ``scale`` ``[width]`` (or NULL); ``a`` NULL: no module."""
    _fields_ = [("a", C_PTR), ("bt", C_PTR), ("scale", C_PTR), ("rank", C_INT64), ("start", C_INT64), ("width", C_INT64)]


LORA_SLOTS = 4  # module slots per linear (decode_step.c KILN_LORA_SLOTS): qkv, q, k, v of the fused qkv


class LoraStepWeights(ctypes.Structure):
    """A step's LoRA for ``decode_step``: ``adapters`` (``num_adapters`` pointers to each
    adapter's ``LoraLinear`` ``[num_layers][4][LORA_SLOTS]``: linears qkv, dense, fused_fc,
    proj), ``token_adapter`` (int64 ``[m]``: each token's adapter index, -1 for none) and
    ``work_size``: float32 scratch, ``m`` x (the widest linear input + the largest rank + the
    widest module)."""
    _fields_ = [("adapters", C_PTR), ("num_adapters", C_INT64), ("token_adapter", C_PTR), ("work_size", C_INT64)]


EXPERTS_FAILED = 100  # decode_step.c KILN_STEP_EXPERTS_FAILED: plus moe_experts' own code


def decode_step_scratch_size(dims: DecoderDims, num_tokens: int) -> int:
    """Elements of model dtype ``decode_step`` needs as scratch for ``num_tokens`` tokens."""
    return native_library().kiln_decode_step_scratch(ctypes.byref(dims), num_tokens)


def decode_step(hidden: torch.Tensor, layers: ctypes.Array, dims: DecoderDims, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, token_index: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                scratch: torch.Tensor, profile: torch.Tensor | None = None, head: DecoderHead | None = None,
                logits: torch.Tensor | None = None, lora: LoraStepWeights | None = None) -> None:
    """Run every layer of a LLaMA-shaped stack on ``hidden`` ``[m, hidden]`` (in place): one
    token of each of ``m`` sequences.

    ``layers``: a ``DecoderLayerWeights`` array, each pointing at contiguous tensors of
    ``hidden``'s dtype, its KV cache ``[num_blocks, block_size, kv_heads, head_size]`` among
    them (or int8 / float8 e4m3 codes, with ``dims.kv_kind`` and the layer's scales set);
    token ``t``'s K/V go to cache slot ``slots[t]`` and its attention reads
    ``seq_lens[t]`` tokens through ``block_tables[t]`` (``dims.max_blocks`` entries);
    ``token_index`` is ``arange(m)`` (all int64). ``cos``/``sin``: float32 ``[m, dims.rot_dim]``.
    The caller has checked every pointer (see ``kiln.models.native_decode``): nothing is
    checked here. ``profile`` (float64 ``[3]``, or None): seconds in the linear layers, in
    attention and in the rest are added to it. With a ``head`` (and ``dims.head_width`` set)
    the step ends with the final norm and the LM head and writes float32 ``logits``
    ``[m, head.vocab]``; ``hidden`` is then the last layer's output. With ``lora`` each
    token's adapter adds its deltas to the four linears of every layer (kiln.layers.lora's
    arithmetic).
    """
    rc = getattr(native_library(), f"kiln_decode_step_{DTYPE_SUFFIX[hidden.dtype]}")(
        hidden.data_ptr(), hidden.shape[0], layers, len(layers), ctypes.byref(dims), cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), token_index.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), scratch.data_ptr(),
        ctypes.byref(head) if head is not None else None, logits.data_ptr() if logits is not None else None,
        ctypes.byref(lora) if lora is not None else None, torch.get_num_threads(),
        profile.data_ptr() if profile is not None else None)
    if rc >= EXPERTS_FAILED:
        raise (MemoryError if rc == EXPERTS_FAILED + 2 else RuntimeError)(
            f"decode_step: the experts call failed with code {rc - EXPERTS_FAILED}")
    if rc != 0:
        raise RuntimeError(f"decode_step: attention kernel failed with code {rc}")
