"""Multi-head attention (MHA/GQA/MQA) over a paged KV cache.

The layer projects q/k/v, applies rotary embedding when configured, and hands the rest to
the attention backend carried by the step's metadata (``metadata.backend``), so the model
code is shared by the reference backend and every faster one.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln import kernels
from kiln.layers.linear import QKVColumnLinear, RowLinear
from kiln.layers.normalization import LayerNorm, RmsNorm
from kiln.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_size: int, *, qkv_bias: bool, dense_bias: bool, rotary: RotaryEmbedding | None,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0,
                 source_transposed: bool = False, qk_norm_eps: float | None = None, qk_layernorm: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads // tp_size  # per rank
        self.num_kv_heads = max(num_kv_heads // tp_size, 1)
        self.head_size = head_size
        self.scale = head_size ** -0.5
        self.qkv = QKVColumnLinear(hidden_size, num_heads, num_kv_heads, head_size, qkv_bias, dtype=dtype,
                                   tp_size=tp_size, tp_rank=tp_rank, source_transposed=source_transposed)
        self.dense = RowLinear(num_heads * head_size, hidden_size, dense_bias, dtype=dtype,
                               tp_size=tp_size, tp_rank=tp_rank, source_transposed=source_transposed)
        self.rotary = rotary
        # Qwen3: every query and key head RMS-normalised (over head_size) before rotary;
        # Phi-2 with qk_layernorm: LayerNorm instead.
        norm = LayerNorm if qk_layernorm else RmsNorm
        self.q_norm = norm(head_size, qk_norm_eps, dtype=dtype) if qk_norm_eps is not None else None
        self.k_norm = norm(head_size, qk_norm_eps, dtype=dtype) if qk_norm_eps is not None else None

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, kv_cache) -> torch.Tensor:
        # hidden: [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        q, k, v = self.qkv(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_size)).view(num_tokens, self.num_heads, self.head_size)
            k = self.k_norm(k.reshape(-1, self.head_size)).view(num_tokens, self.num_kv_heads, self.head_size)
        if self.rotary is not None:
            cos, sin = metadata.rotary_cos_sin(self.rotary, positions)
            if kernels.elementwise_supported(hidden) and q.dtype == hidden.dtype:
                # In place on the fresh qkv output: one native pass each instead of ~10 ops.
                q = kernels.rotary_(q, cos, sin, self.rotary.rotary_dim)
                k = kernels.rotary_(k, cos, sin, self.rotary.rotary_dim)
            else:
                q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        out = metadata.backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [num_tokens, heads, head]
        return self.dense(out.reshape(num_tokens, q_size))
