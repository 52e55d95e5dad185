"""Multi-head latent attention (MLA: DeepSeek-V2), this rank's heads.

Per token, keys and values come from one compressed latent ``c`` (``kv_lora_rank`` wide, after
``kv_a_layernorm``) and one rotary key ``k_pe`` (``qk_rope_head_dim``) shared by every head::

    q            = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))   [heads, nope + rope]
    c, k_pe      = kv_a_proj_with_mqa(x)                                  [kv_lora_rank], [rope]
    k_nope, v    = kv_b_proj(kv_a_layernorm(c))                           [heads, nope], [heads, v]
    k            = [k_nope, rotary(k_pe)]    q = [q_nope, rotary(q_pe)]

The paged cache holds only ``[c, rotary(k_pe)]`` per token (one "KV head" row of
``kv_lora_rank + qk_rope_head_dim``, no V: ``cache_value_size`` 0). Attention over it
(``kiln.step.latent_attention``, handed in by the model as ``attend``: layers sit below the step)
takes one of two paths that compute the same thing:

* unabsorbed (prompt chunks): the latent rows expanded through ``kv_b_proj`` into per-head K/V
  (``expand``), then ordinary causal attention;
* absorbed (decode): ``kv_b_proj``'s key part folded into the query (``absorb_query``:
  ``q_nope W_UK`` per head, a query in latent space, scored against the cache rows as they are)
  and its value part applied after attention (``absorb_output``: ``o_latent W_UV^T``), so a decode
  step reads only the latent cache.

DeepSeek's rotary pairs adjacent dims (complex numbers in Hugging Face's code); kiln's rotary is
rotate-half, so the rotary rows of ``q_proj`` / ``q_b_proj`` and ``kv_a_proj_with_mqa`` are
reordered on loading (even dims, then odd: the same q.k, as GPT-J's).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln import kernels
from kiln.checkpoint.shard_spec import ShardSpec
from kiln.errors import ConfigError
from kiln.layers.linear import QUANT_PARAMETERS, ColumnLinear, Linear, RowLinear, pairs_to_halves_order
from kiln.layers.normalization import RmsNorm
from kiln.layers.rotary import RotaryEmbedding


class RopeRowsLinear(ColumnLinear):
    """A projection whose rows come in ``head``-row groups, each holding ``rope`` rotary dims from
    row ``rope_start`` in adjacent pairs; reordered on loading to the even dims, then the odd. A
    GGUF file's quantized rows move whole (blocks run along the input features), so the codes,
    scales and offsets of each row follow it exactly."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, head: int, rope_start: int, rope: int,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0):
        super().__init__(in_features, out_features, bias, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank)
        self.head, self.rope_start, self.rope = head, rope_start, rope

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        out = super().postprocess(key, weights, **kwargs)
        rows = self.out_features
        one = pairs_to_halves_order(self.head, self.rope_start, self.rope)
        order = (torch.arange(rows // self.head)[:, None] * self.head + one).flatten()
        # The weight (or its codes) and what goes per row with it: bias, scales, offsets.
        return {name: t.index_select(0, order).contiguous() if name.rpartition(".")[2] in ("bias", *QUANT_PARAMETERS)
                else t for name, t in out.items()}


class LatentUpProjection(nn.Module):
    """``kv_b_proj``, this rank's heads. A checkpoint holds ``weight`` ``[heads / tp * (nope + v),
    kv_lora_rank]`` as Hugging Face does (each head's ``nope`` key rows, then its ``v`` value
    rows); an engine (``engine_layout``) holds ``keys`` ``[heads, kv_lora_rank, nope]`` (each
    head's ``W_UK`` transposed) and ``values`` ``[heads, v, kv_lora_rank]`` (``W_UV``), so the
    absorbed decode's two products per head each read one contiguous matrix row by row
    (``kernels.head_linear``). Not a :class:`Linear`: it stays a plain float matrix
    (weight-only quantization and bf16 tiles leave it alone)."""

    def __init__(self, kv_lora_rank: int, num_heads: int, nope: int, v: int, *, engine_layout: bool = False,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.heads, self.nope, self.v, self.rank = num_heads // tp_size, nope, v, kv_lora_rank
        self.tp_size, self.tp_rank, self.engine_layout = tp_size, tp_rank, engine_layout
        if engine_layout:
            self.keys = nn.Parameter(torch.empty(self.heads, kv_lora_rank, nope, dtype=dtype), requires_grad=False)
            self.values = nn.Parameter(torch.empty(self.heads, v, kv_lora_rank, dtype=dtype), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(self.heads * (nope + v), kv_lora_rank, dtype=dtype),
                                       requires_grad=False)

    def load_spec(self, param_name: str, num_external: int) -> list[ShardSpec]:
        return [ShardSpec.even(0, self.tp_size, self.tp_rank)] * num_external

    def engine_weights(self, prefix: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's per-head rows into the engine's ``keys`` and ``values``."""
        w = weights.pop(f"{prefix}weight").view(self.heads, self.nope + self.v, self.rank)
        return {f"{prefix}keys": w[:, :self.nope].transpose(1, 2).contiguous(),
                f"{prefix}values": w[:, self.nope:].contiguous()}

    def forward(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised latents ``[n, kv_lora_rank]`` to per-head key parts ``[n, heads, nope]`` and
        values ``[n, heads, v]`` (the unabsorbed path: prompt chunks)."""
        n = latent.shape[0]
        if self.engine_layout:
            keys = torch.matmul(latent, self.keys).transpose(0, 1)  # [heads, n, nope] -> [n, heads, nope]
            return keys, F.linear(latent, self.values.flatten(0, 1)).view(n, self.heads, self.v)
        keys, values = F.linear(latent, self.weight).view(n, self.heads, self.nope + self.v).split(
            [self.nope, self.v], dim=-1)
        return keys, values

    def absorb_keys(self, q_nope: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` ``[n, heads, kv_lora_rank]`` (may be a view) = ``q_nope W_UK`` per head."""
        if self.engine_layout:
            kernels.head_linear(q_nope, self.keys, out)
        else:
            w_uk = self.weight.view(self.heads, self.nope + self.v, -1)[:, :self.nope]
            out.copy_(torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1))

    def apply_values(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention outputs over the latents ``[n, heads, kv_lora_rank]`` (may be a view) to the
        heads' values ``[n, heads, v]``: ``o_latent W_UV^T`` per head."""
        if self.engine_layout:
            out = torch.empty(o_latent.shape[0], self.heads, self.v, dtype=o_latent.dtype)
            return kernels.head_linear(o_latent, self.values, out)
        w_uv = self.weight.view(self.heads, self.nope + self.v, -1)[:, self.nope:]
        return torch.bmm(w_uv, o_latent.permute(1, 2, 0)).permute(2, 0, 1)  # (a transposed W_UV is copied whole)


class MultiHeadLatentAttention(nn.Module):
    """MLA of one layer (see the module docstring). ``scale`` is the softmax scale; ``attend(self,
    q_nope, q_pe, latent, kv_cache, metadata)`` computes attention over the paged latent cache
    (``kiln.step.latent_attention.latent_attention``)."""

    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, *, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 rotary: RotaryEmbedding, scale: float, attend: Callable, bias: bool = False, norm_eps: float = 1e-6,
                 engine_layout: bool = False,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        if num_heads % tp_size:
            raise ConfigError(f"num_attention_heads ({num_heads}) is not divisible by tp_size ({tp_size})")
        self.layer_idx, self.num_heads, self.scale, self.rotary = layer_idx, num_heads // tp_size, scale, rotary
        self.nope, self.rope, self.v_head = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.attend = attend
        qk_head = qk_nope_head_dim + qk_rope_head_dim
        shard = dict(dtype=dtype, tp_size=tp_size, tp_rank=tp_rank)
        q_rows = dict(head=qk_head, rope_start=qk_nope_head_dim, rope=qk_rope_head_dim, **shard)
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = RopeRowsLinear(hidden_size, num_heads * qk_head, False, **q_rows)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias, dtype=dtype)  # replicated
            self.q_a_layernorm = RmsNorm(q_lora_rank, norm_eps, dtype=dtype)
            self.q_b_proj = RopeRowsLinear(q_lora_rank, num_heads * qk_head, False, **q_rows)
        latent = kv_lora_rank + qk_rope_head_dim
        self.kv_a_proj_with_mqa = RopeRowsLinear(hidden_size, latent, bias, head=latent, rope_start=kv_lora_rank,
                                                 rope=qk_rope_head_dim, dtype=dtype)  # replicated
        self.kv_a_layernorm = RmsNorm(kv_lora_rank, norm_eps, dtype=dtype)
        self.kv_b_proj = LatentUpProjection(kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim,
                                            engine_layout=engine_layout, **shard)
        self.dense = RowLinear(num_heads * v_head_dim, hidden_size, bias, **shard)
        # The cache's shape: one "KV head" row of the latent and the rotary key per token, no V.
        self.num_kv_heads, self.head_size, self.cache_value_size = 1, latent, 0

    def use_kv_cache_scales(self) -> None:
        raise ConfigError("a quantized KV cache (kv_cache_quant_algo) is not supported for multi-head latent "
                          "attention (its cache holds the compressed latent)")

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, kv_cache) -> torch.Tensor:
        q_nope, q_pe, latent = self.project(hidden, positions, metadata)
        out = self.attend(self, q_nope, q_pe, latent, kv_cache, metadata)  # [tokens, heads, v_head]
        return self.dense(out.reshape(hidden.shape[0], -1))

    def project(self, hidden: torch.Tensor, positions: torch.Tensor,
                metadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(``q_nope`` ``[tokens, heads, nope]``, rotated ``q_pe`` ``[tokens, heads, rope]``, the
        cache rows ``[tokens, kv_lora_rank + rope]``: the normalised latent, then the rotated key)."""
        n = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(n, self.num_heads, self.nope + self.rope)
        kv = self.kv_a_proj_with_mqa(hidden)
        cos, sin = metadata.rotary_cos_sin(self.rotary, positions)
        self._rotate_(q, cos, sin, self.nope)
        self._rotate_(kv.unsqueeze(1), cos, sin, self.kv_lora_rank)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(c.contiguous()), k_pe], dim=-1)

    def _rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int) -> None:
        """Rotate dims ``start .. start + rope`` of each head of a fresh projection output ``x``
        ``[n, heads, size]`` in place, in float32 and rounded once, as Hugging Face rotates (its
        complex product): natively in one pass where the kernel takes ``x``."""
        if kernels.elementwise_supported(x[:, 0]) and x.stride(1) == x.shape[2]:  # rows of whole heads
            kernels.rotary_(x, cos, sin, self.rope, start=start)
        else:
            part = x[..., start:start + self.rope]
            part.copy_(self.rotary.apply(part.float(), cos, sin))

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows ``[n, kv_lora_rank + rope]`` to per-head keys ``[n, heads, nope + rope]`` and
        values ``[n, heads, v_head]`` (the unabsorbed path)."""
        n = latent.shape[0]
        c, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(c)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(n, self.num_heads, self.rope)], dim=-1)
        return k, v

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """The query in latent space ``[n, heads, kv_lora_rank + rope]``: ``q_nope W_UK`` per head,
        then ``q_pe``; its dot product with a cache row is the head's q.k."""
        q = torch.empty(*q_nope.shape[:2], self.kv_lora_rank + self.rope, dtype=q_nope.dtype)
        self.kv_b_proj.absorb_keys(q_nope, q[..., :self.kv_lora_rank])
        q[..., self.kv_lora_rank:] = q_pe
        return q

    def absorb_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention outputs over the latents ``[n, heads, kv_lora_rank]`` to the heads' values
        ``[n, heads, v_head]``: ``o_latent W_UV^T`` per head."""
        return self.kv_b_proj.apply_values(o_latent)
