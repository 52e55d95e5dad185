"""Gated DeltaNet (Qwen3.5, Qwen3-Next): linear attention whose per-head state the gated delta
rule updates (``kiln.layers.delta_rule``), after a short causal convolution.

    qkv = silu(conv(in_proj_qkv(h)))       conv over the q, k and v channels together
    q, k = l2norm(q), l2norm(k)             key heads; each serves heads_v / heads_k value heads
                                            (grouped, or tiled in llama.cpp's files)
    beta = sigmoid(in_proj_b(h));  g = -exp(A_log) * softplus(in_proj_a(h) + dt_bias)
    o = delta_rule(q * key_dim ** -0.5, k, v, g, beta)
    out = out_proj(rmsnorm(o) * w * silu(in_proj_z(h)))      per value head

Per sequence it keeps the convolution's last inputs (``K - 1`` x ``2 key_dim + value_dim``, the
model's dtype) and a float32 ``key_dim x value_dim`` matrix per value head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln import kernels
from kiln.layers.delta_rule import delta_rule_chunked, delta_rule_step
from kiln.layers.linear import Linear
from kiln.layers.recurrent import CausalConv1d, read_state, require_state_groups, write_state


def _l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dimension (the reference's form of the norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedRmsNorm(nn.Module):
    """``rmsnorm(x) * weight * silu(gate)`` over each value head (normalised in float32, rounded
    to the model dtype before the weight, as Hugging Face does)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, *, num_key_heads: int, num_value_heads: int,
                 key_dim: int, value_dim: int, kernel_size: int, eps: float, dtype: torch.dtype,
                 value_heads_tiled: bool = False):
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"{num_value_heads} value heads do not divide among {num_key_heads} key heads")
        self.layer_idx, self.dtype = layer_idx, dtype
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        # Which key head a value head reads: grouped (Hugging Face: value heads 0..r-1 read key
        # head 0) or tiled (llama.cpp's GGUF files: value head j reads key head j % key heads).
        self.value_heads_tiled = value_heads_tiled
        keys, values = num_key_heads * key_dim, num_value_heads * value_dim
        self.in_proj_qkv = Linear(hidden_size, 2 * keys + values, bias=False, dtype=dtype)
        self.in_proj_z = Linear(hidden_size, values, bias=False, dtype=dtype)
        self.in_proj_b = Linear(hidden_size, num_value_heads, bias=False, dtype=dtype)
        self.in_proj_a = Linear(hidden_size, num_value_heads, bias=False, dtype=dtype)
        self.conv1d = CausalConv1d(2 * keys + values, kernel_size, bias=False, activation="silu", dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_value_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRmsNorm(value_dim, eps, dtype=dtype)
        self.out_proj = Linear(values, hidden_size, bias=False, dtype=dtype)

    def state_spec(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Its state parts per sequence: the convolution's last inputs, the delta-rule matrices."""
        return [self.conv1d.state_part(self.dtype),
                ((self.num_value_heads, self.key_dim, self.value_dim), torch.float32)]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, state: tuple[torch.Tensor, ...]
                ) -> torch.Tensor:
        lora = metadata.lora
        mixed, gate = self.in_proj_qkv(hidden, lora), self.in_proj_z(hidden, lora)
        b, a = self.in_proj_b(hidden, lora), self.in_proj_a(hidden, lora)
        conv_state, delta_state = state
        out = torch.empty(hidden.shape[0], self.num_value_heads * self.value_dim, dtype=hidden.dtype)
        native = kernels.recurrent_decode_supported(mixed, conv_state)
        for group in require_state_groups(metadata, self.layer_idx):
            rows = group.rows
            if group.length == 1 and native:  # decode rows: conv, delta rule and gated norm in one pass
                kernels.gated_delta_decode(
                    mixed[rows], gate[rows], b[rows], a[rows], self.conv1d.weight, conv_state, delta_state, self.A_log,
                    self.dt_bias, self.norm.weight, self.norm.eps, group, out[rows], key_heads=self.num_key_heads,
                    key_dim=self.key_dim, value_dim=self.value_dim, tiled=self.value_heads_tiled)
                continue
            inputs = mixed[rows].view(group.count, group.length, -1)
            qkv, after = self.conv1d(inputs, read_state(conv_state, group))
            write_state(conv_state, group, after)
            q, k, v = self._heads(qkv.reshape(-1, qkv.shape[-1]))
            beta = torch.sigmoid(b[rows]).float()  # [tokens, value heads]
            decay = -self.A_log.float().exp() * F.softplus(a[rows].float() + self.dt_bias.float())
            start = read_state(delta_state, group)
            if group.length == 1:  # decode rows: one token for each sequence
                o, end = delta_rule_step(q, k, v, decay, beta, start)
            else:  # a prompt chunk of one sequence
                o, end = delta_rule_chunked(q, k, v, decay, beta, start[0])
                end = end[None]
            write_state(delta_state, group, end)
            out[rows] = self.norm(o.to(hidden.dtype).reshape(-1, self.value_dim),
                                  gate[rows].reshape(-1, self.value_dim)).view(o.shape[0], -1)
        return self.out_proj(out, lora)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved channels ``[tokens, ...]`` as float32 heads: L2-normalised queries (times
        ``key_dim ** -0.5``) and keys repeated for each value head they serve, and the values."""
        keys = self.num_key_heads * self.key_dim
        q, k, v = qkv.float().split([keys, keys, self.num_value_heads * self.value_dim], dim=-1)
        repeat = self.num_value_heads // self.num_key_heads
        q, k = (_l2_normalize(x.view(-1, self.num_key_heads, self.key_dim)) for x in (q, k))
        q, k = ((x.repeat(1, repeat, 1) if self.value_heads_tiled else x.repeat_interleave(repeat, dim=1))
                for x in (q, k))
        return q * self.key_dim ** -0.5, k, v.view(-1, self.num_value_heads, self.value_dim)
