"""Multi-head attention (MHA/GQA/MQA) over a paged KV cache.

The layer projects q/k/v, applies rotary embedding when configured, and hands the rest to
the attention backend carried by the step's metadata (``metadata.backend``), so the model
code is shared by the reference backend and every faster one. Per layer it may also ask the
backend for a sliding window, attention logit soft-capping and ALiBi biases (this rank's
heads' slopes).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln import kernels
from kiln.checkpoint.shard_spec import ShardSpec
from kiln.errors import ConfigError
from kiln.layers.linear import ColumnLinear, QKVColumnLinear, RowLinear
from kiln.layers.normalization import LayerNorm, RmsNorm
from kiln.layers.rotary import RotaryEmbedding


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (float32 ``[num_heads]``), as BLOOM computes them: for the largest
    power of two ``n <= num_heads``, ``2^(-8i/n)`` for i = 1..n; the remaining heads take every
    other slope of the ``2n`` sequence (odd i)."""
    n = 2 ** math.floor(math.log2(num_heads))
    # Explicit device: models are built under torch.device("meta"), and slopes are never loaded.
    base = torch.tensor(2.0 ** (-8.0 / n), dtype=torch.float32, device="cpu")
    slopes = base ** torch.arange(1, n + 1, dtype=torch.float32, device="cpu")
    if n < num_heads:
        extra_base = torch.tensor(2.0 ** (-4.0 / n), dtype=torch.float32, device="cpu")
        odd = torch.arange(1, 2 * (num_heads - n), 2, dtype=torch.float32, device="cpu")
        slopes = torch.cat([slopes, extra_base ** odd])
    return slopes


class AttentionSinks(nn.Module):
    """gpt-oss's attention sinks: one learned logit per head (``weight`` float32 ``[heads / tp]``,
    this rank's heads) that joins the head's softmax denominator. Hugging Face names it
    ``self_attn.sinks`` (no ``.weight``)."""

    external_key_map = {"weight": ""}
    keeps_float32 = True  # in an engine of any dtype (kiln.build)

    def __init__(self, num_heads: int, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.weight = nn.Parameter(torch.empty(num_heads // tp_size, dtype=torch.float32), requires_grad=False)

    def load_spec(self, param_name: str, num_external: int) -> list[ShardSpec]:
        return [ShardSpec.even(0, self.tp_size, self.tp_rank)] * num_external

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        return {key: weights[0].float()}


class Attention(nn.Module):
    """Fused-qkv attention of one layer, this rank's heads.

    ``scale`` defaults to ``head_size ** -0.5``; ``window`` (a sliding window, in tokens),
    ``softcap`` (attention logit soft-cap) and ``alibi`` (ALiBi biases instead of positions in
    q/k) are passed to the attention backend, and so are the quantized KV cache's scales (INT8, FP8)
    (``kv_cache_scaling_factor``) when the model has them.
    """

    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_size: int, *, qkv_bias: bool, dense_bias: bool, rotary: RotaryEmbedding | None,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0,
                 source_transposed: bool = False, qk_norm_eps: float | None = None, qk_layernorm: bool = False,
                 qk_norm_class: type[nn.Module] = RmsNorm, qk_norm_whole: bool = False,
                 scale: float | None = None, window: int | None = None, softcap: float | None = None,
                 alibi: bool = False, sinks: bool = False, v_norm: bool = False, value_from_key: bool = False,
                 kv_source: int | None = None, output_gate: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads // tp_size  # per rank
        self.num_kv_heads = max(num_kv_heads // tp_size, 1)
        self.head_size = head_size
        self.scale = scale if scale is not None else head_size ** -0.5
        self.window = window
        self.softcap = softcap
        # Derived from the config, never saved: the slopes of this rank's heads.
        slopes = alibi_slopes(num_heads)[tp_rank * self.num_heads:(tp_rank + 1) * self.num_heads] if alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        self.sinks = AttentionSinks(num_heads, tp_size, tp_rank) if sinks else None
        # Gemma 4's KV-shared layers: keys and values (and the KV cache) are layer ``kv_source``'s,
        # handed on through the step's metadata; the layer projects only its queries.
        self.kv_source = kv_source
        if kv_source is not None:
            self.qkv = ColumnLinear(hidden_size, num_heads * head_size, qkv_bias, dtype=dtype, tp_size=tp_size,
                                    tp_rank=tp_rank, source_transposed=source_transposed)
            self.qkv.external_key_map = {"qkv": "q_proj"}
        else:
            # Qwen3.5's gated attention (``output_gate``): each head's query rows are followed by
            # its output gate's, so the q part holds twice the heads' rows (split in forward).
            self.qkv = QKVColumnLinear(hidden_size, num_heads * (2 if output_gate else 1), num_kv_heads, head_size,
                                       qkv_bias, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank,
                                       source_transposed=source_transposed)
        if output_gate and (kv_source is not None or qk_norm_whole):
            raise ConfigError("an attention output gate is not supported with kv_source or qk_norm_whole")
        self.output_gate = output_gate
        if value_from_key:
            # Gemma 4's attention_k_eq_v: the values are the key projection's output. The v rows are
            # loaded from k_proj, so the fused projection (and every kernel behind it) is unchanged.
            self.qkv.external_key_map = {"qkv": ["q_proj", "k_proj", "k_proj"]}
        self.value_from_key = value_from_key
        # Gemma 4: each value head RMS-normalised, without a weight (eps: the q/k norms').
        self.v_norm_eps = qk_norm_eps if v_norm else None
        if v_norm and qk_norm_eps is None:
            raise ConfigError("a value norm (v_norm) needs the q/k norms' epsilon (qk_norm)")
        self.dense = RowLinear(num_heads * head_size, hidden_size, dense_bias, dtype=dtype,
                               tp_size=tp_size, tp_rank=tp_rank, source_transposed=source_transposed)
        self.rotary = rotary
        # Qwen3: every query and key head RMS-normalised (over head_size) before rotary (Gemma 3:
        # with its own norm class); Phi-2 with qk_layernorm: LayerNorm instead. OLMo 2
        # (``qk_norm_whole``): one RMSNorm over the whole q and the whole k projection.
        norm = LayerNorm if qk_layernorm else qk_norm_class
        self.qk_norm_whole = qk_norm_whole
        if qk_norm_whole and tp_size > 1:
            raise ConfigError("a q/k norm over the whole projection (qk_norm_whole: OLMo 2) needs every head on "
                              f"one rank; tp_size {tp_size} is not supported for it")
        q_dim, k_dim = (num_heads * head_size, num_kv_heads * head_size) if qk_norm_whole else (head_size, head_size)
        self.q_norm = norm(q_dim, qk_norm_eps, dtype=dtype) if qk_norm_eps is not None else None
        self.k_norm = norm(k_dim, qk_norm_eps, dtype=dtype) if qk_norm_eps is not None and kv_source is None else None
        # Set (by the model) when a later layer reads this one's K/V: then the step keeps them.
        self.kv_consumed = False
        # Quantized KV cache (INT8, FP8): float32 [2], the static per-tensor scales of K (after rotary) and V.
        self.register_parameter("kv_cache_scaling_factor", None)

    def use_kv_cache_scales(self) -> None:
        """Give the layer its quantized KV cache scales (filled from a checkpoint or by calibration)."""
        self.kv_cache_scaling_factor = nn.Parameter(torch.ones(2, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, kv_cache) -> torch.Tensor:
        # hidden: [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        own_kv = self.kv_source is None
        gate = None
        if self.output_gate:  # per head: its query rows, then its gate's
            q, k, v = self.qkv(hidden, metadata.lora).split([2 * q_size, kv_size, kv_size], dim=-1)
            q, gate = q.view(num_tokens, self.num_heads, 2, self.head_size).unbind(2)
            q, gate = q.contiguous(), gate.reshape(num_tokens, q_size)
        elif own_kv:
            q, k, v = self.qkv(hidden, metadata.lora).split([q_size, kv_size, kv_size], dim=-1)
        else:  # a KV-shared layer: its own queries over layer kv_source's keys and values (see _source_kv)
            q, (k, v) = self.qkv(hidden, metadata.lora), self._source_kv(metadata)
        if self.qk_norm_whole:
            q = self.q_norm(q)
            k = self.k_norm(k) if own_kv else k
        q = q.view(num_tokens, self.num_heads, self.head_size)
        if own_kv:
            k = k.view(num_tokens, self.num_kv_heads, self.head_size)
            v = v.view(num_tokens, self.num_kv_heads, self.head_size)
            if self.v_norm_eps is not None:
                v = F.rms_norm(v.float(), (self.head_size,), None, self.v_norm_eps).to(v.dtype)
        if self.q_norm is not None and not self.qk_norm_whole:
            q = self.q_norm(q.reshape(-1, self.head_size)).view(num_tokens, self.num_heads, self.head_size)
            if own_kv:
                k = self.k_norm(k.reshape(-1, self.head_size)).view(num_tokens, self.num_kv_heads, self.head_size)
        if self.rotary is not None:
            cos, sin = metadata.rotary_cos_sin(self.rotary, positions)
            native = kernels.elementwise_supported(hidden) and q.dtype == hidden.dtype
            q = self._rotate(q, cos, sin, native)
            k = self._rotate(k, cos, sin, native) if own_kv else k
        if self.kv_consumed:  # for the layers reading this one's K/V (their kv_source)
            metadata.shared_kv[self.layer_idx] = (k, v)
        return self._attend(q, k, v, kv_cache, metadata, gate)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: bool) -> torch.Tensor:
        # Native: in place on the fresh projection output, one pass instead of ~10 ops.
        return kernels.rotary_(x, cos, sin, self.rotary.rotary_dim) if native else self.rotary.apply(x, cos, sin)

    def _source_kv(self, metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``kv_source``'s normalised, rotated keys and values of this step (its cache comes
        through ``kv_cache``: writing the same K/V to the same slots again leaves it as it was, so
        the backends need no other path)."""
        if self.kv_source not in metadata.shared_kv:
            raise RuntimeError(f"layer {self.layer_idx} reads layer {self.kv_source}'s keys and values, "
                               "which this step has not computed")
        return metadata.shared_kv[self.kv_source]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, metadata,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the cache, times ``sigmoid(gate)`` where the layer has an output gate,
        then the output projection."""
        num_tokens = q.shape[0]
        out = metadata.backend.forward(q, k, v, kv_cache, metadata, self.scale, window=self.window,
                                       alibi_slopes=self.alibi_slopes, softcap=self.softcap,
                                       kv_scales=self.kv_cache_scaling_factor,
                                       sinks=None if self.sinks is None else self.sinks.weight)  # [tokens, heads, head]
        out = out.reshape(num_tokens, self.num_heads * self.head_size)
        return self.dense(out if gate is None else out * torch.sigmoid(gate), metadata.lora)
