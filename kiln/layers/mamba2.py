"""Mamba2 (Granite 4 hybrids, Nemotron-H): a selective state-space mixer
(``kiln.layers.ssd``) after a short causal convolution.

    z, xBC, dt = in_proj(h)                 gate (inner), conv channels (inner + 2 groups state), heads
    x, B, C = silu(conv(xBC))                the convolution over x, B and C together
    dt = clamp(softplus(dt + dt_bias), *time_step_limit);  A = -exp(A_log)
    y = ssd(x, dt, A, B, C) + D x           per head; B and C shared by the heads of a group
    out = out_proj(rmsnorm(y * silu(z)) * w)  the norm over each group's inner channels

Per sequence it keeps the convolution's last inputs (``K - 1`` x ``inner + 2 groups state``, the
model's dtype) and a float32 ``head_dim x state_size`` matrix per head. The time-step limits
apply on every path (Hugging Face's decode step leaves them out; llama.cpp ignores them): a
prompt split anywhere then gives what one pass gives.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln import kernels
from kiln.layers.linear import Linear
from kiln.layers.recurrent import CausalConv1d, read_state, require_state_groups, write_state
from kiln.layers.ssd import ssd_chunked, ssd_step


class GroupedGatedRmsNorm(nn.Module):
    """``rmsnorm(x * silu(gate)) * weight``, the RMS taken over each of ``groups`` equal slices of
    the channels (float32 throughout, rounded to ``x``'s dtype at the end)."""

    def __init__(self, dim: int, groups: int, eps: float, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` ``[tokens, dim]`` (float32), ``gate`` the same shape: the normed rows in ``dtype``."""
        gated = (x.float() * F.silu(gate.float())).view(x.shape[0], self.groups, -1)
        normed = F.rms_norm(gated, (gated.shape[-1],), None, self.eps).view(x.shape)
        return (normed * self.weight.float()).to(dtype)


class Mamba2(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, *, num_heads: int, head_dim: int, state_size: int,
                 groups: int, kernel_size: int, conv_bias: bool, proj_bias: bool, eps: float, dtype: torch.dtype,
                 time_step_limit: tuple[float, float] = (0.0, math.inf)):
        super().__init__()
        if num_heads % groups:
            raise ValueError(f"{num_heads} Mamba2 heads do not divide among {groups} groups")
        self.layer_idx, self.dtype = layer_idx, dtype
        self.num_heads, self.head_dim, self.state_size, self.groups = num_heads, head_dim, state_size, groups
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state_size
        self.in_proj = Linear(hidden_size, self.inner + self.conv_dim + num_heads, proj_bias, dtype=dtype)
        self.conv1d = CausalConv1d(self.conv_dim, kernel_size, conv_bias, activation="silu", dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(num_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(num_heads, dtype=dtype), requires_grad=False)
        self.norm = GroupedGatedRmsNorm(self.inner, groups, eps, dtype=dtype)
        self.out_proj = Linear(self.inner, hidden_size, proj_bias, dtype=dtype)

    def state_spec(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Its state parts per sequence: the convolution's last inputs, the SSM states."""
        return [self.conv1d.state_part(self.dtype),
                ((self.num_heads, self.head_dim, self.state_size), torch.float32)]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, state: tuple[torch.Tensor, ...]
                ) -> torch.Tensor:
        projected = self.in_proj(hidden, metadata.lora)  # [tokens, inner | conv_dim | heads]
        conv_state, ssm_state = state
        y = torch.empty(hidden.shape[0], self.inner, dtype=torch.float32)
        native = kernels.recurrent_decode_supported(projected, conv_state)
        for group in require_state_groups(metadata, self.layer_idx):
            rows = group.rows
            if group.length == 1 and native:  # decode rows: conv, SSM update and D skip in one pass
                kernels.mamba2_decode(projected[rows], self.conv1d.weight, self.conv1d.bias, conv_state, ssm_state,
                                      self.A_log, self.dt_bias, self.D, group, y[rows], groups=self.groups,
                                      head_dim=self.head_dim, state_size=self.state_size,
                                      time_step_limit=self.time_step_limit)
                continue
            y[rows] = self._scan(projected[rows], group, conv_state, ssm_state)
        return self.out_proj(self.norm(y, projected[:, :self.inner], hidden.dtype), metadata.lora)

    def _scan(self, projected: torch.Tensor, group, conv_state: torch.Tensor, ssm_state: torch.Tensor
              ) -> torch.Tensor:
        """One group's rows of ``projected``: the SSM outputs ``[rows, inner]`` (float32, D skip
        included), its states moved from the read to the write slots."""
        xbc = projected[:, self.inner:self.inner + self.conv_dim].reshape(group.count, group.length, -1)
        xbc, after = self.conv1d(xbc, read_state(conv_state, group))
        write_state(conv_state, group, after)
        groups_state = self.groups * self.state_size
        x, b, c = xbc.reshape(-1, self.conv_dim).float().split([self.inner, groups_state, groups_state], dim=-1)
        x = x.view(-1, self.num_heads, self.head_dim)
        b, c = (t.view(-1, self.groups, self.state_size) for t in (b, c))
        dt = F.softplus(projected[:, self.inner + self.conv_dim:].float() + self.dt_bias.float())
        dt = dt.clamp(*self.time_step_limit)
        a, d = -self.A_log.float().exp(), self.D.float()
        start = read_state(ssm_state, group)
        if group.length == 1:  # decode rows: one token for each sequence
            out, end = ssd_step(x, dt, a, b, c, d, start)
        else:  # a prompt chunk of one sequence
            out, end = ssd_chunked(x, dt, a, b, c, d, start[0])
            end = end[None]
        write_state(ssm_state, group, end)
        return out.reshape(-1, self.inner)
