"""LFM2's short-convolution block: a gated depthwise causal convolution in place of attention.

    b, c, x = in_proj(h)            three slices of the hidden width
    y = conv(b * x)                 causal, kernel K (3): its state is the last K - 1 inputs
    out = out_proj(c * y)

Per sequence it keeps ``(K - 1) x hidden`` values (in the model's dtype), whatever its length.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln import kernels
from kiln.layers.linear import Linear
from kiln.layers.recurrent import CausalConv1d, read_state, require_state_groups, write_state


class ShortConv(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, kernel_size: int, bias: bool, *, dtype: torch.dtype):
        super().__init__()
        self.layer_idx, self.hidden_size, self.dtype = layer_idx, hidden_size, dtype
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias, dtype=dtype)
        self.conv = CausalConv1d(hidden_size, kernel_size, bias, dtype=dtype)
        self.out_proj = Linear(hidden_size, hidden_size, bias, dtype=dtype)

    def state_spec(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Its state parts per sequence: the convolution's last inputs."""
        return [self.conv.state_part(self.dtype)]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, state: tuple[torch.Tensor, ...]
                ) -> torch.Tensor:
        bcx = self.in_proj(hidden, metadata.lora)
        out = torch.empty(hidden.shape[0], self.hidden_size, dtype=bcx.dtype)
        (conv_state,) = state
        native = kernels.recurrent_decode_supported(bcx, conv_state)
        for group in require_state_groups(metadata, self.layer_idx):
            rows = group.rows
            if group.length == 1 and native:  # decode rows: gate, convolution and state in one pass
                kernels.short_conv_decode(bcx[rows], self.conv.weight, self.conv.bias, conv_state, group, out[rows])
                continue
            b, c, x = bcx[rows].chunk(3, dim=-1)
            y, after = self.conv((b * x).view(group.count, group.length, -1), read_state(conv_state, group))
            write_state(conv_state, group, after)
            out[rows] = c * y.reshape(-1, self.hidden_size)
        return self.out_proj(out, metadata.lora)
