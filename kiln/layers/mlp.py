"""Feed-forward blocks: the plain two-layer MLP (GPT-2) and the gated MLP (LLaMA's SwiGLU).

Names follow reference 002: ``fc`` is the first projection, ``proj`` the output one and,
for the gated MLP, ``gate`` the projection multiplied in (``proj(act(fc(x)) * gate(x))``).
In an engine the gated MLP's ``fc`` and ``gate`` are fused into one ``fused_fc`` matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln import kernels
from kiln.errors import ConfigError
from kiln.layers.activation import get_activation
from kiln.layers.linear import QUANT_PARAMETERS, ColumnLinear, RowLinear
from kiln.layers.lora import LoraStep


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, *,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0,
                 source_transposed: bool = False):
        super().__init__()
        common = dict(dtype=dtype, tp_size=tp_size, tp_rank=tp_rank, source_transposed=source_transposed)
        self.fc = ColumnLinear(hidden_size, intermediate_size, bias, **common)
        self.proj = RowLinear(intermediate_size, hidden_size, bias, **common)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        return self.proj(self.act(self.fc(x, lora)), lora)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, *,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0,
                 fused: bool = False):
        super().__init__()
        common = dict(dtype=dtype, tp_size=tp_size, tp_rank=tp_rank)
        self.fused = fused
        if fused:
            self.fused_fc = ColumnLinear(hidden_size, 2 * intermediate_size, bias, **common)
            self.fused_fc.fused_from = ("fc", "gate")  # the checkpoint's linears it stands for
        else:
            self.fc = ColumnLinear(hidden_size, intermediate_size, bias, **common)
            self.gate = ColumnLinear(hidden_size, intermediate_size, bias, **common)
        self.proj = RowLinear(intermediate_size, hidden_size, bias, **common)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        if self.fused:
            both = self.fused_fc(x, lora)
            if self.act is F.silu and kernels.elementwise_supported(both):
                return self.proj(kernels.silu_mul(both), lora)  # one native pass instead of three ops
            fc, gate = both.chunk(2, dim=-1)
        else:
            fc, gate = self.fc(x, lora), self.gate(x, lora)
        return self.proj(self.act(fc) * gate, lora)

    @staticmethod
    def engine_weights(prefix: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rewrite this block's checkpoint tensors into the engine's fused layout."""
        out = {}
        for name in ("bias", *QUANT_PARAMETERS):  # quantized rows too
            fc, gate = weights.pop(f"{prefix}fc.{name}", None), weights.pop(f"{prefix}gate.{name}", None)
            if fc is not None:
                out[f"{prefix}fused_fc.{name}"] = torch.cat([fc, gate], dim=0)
        # AWQ, SmoothQuant and FP8: fc and gate read one input, scaled by one factor (and, with FP8
        # activations, rounded on one scale); the fused linear keeps one copy.
        for name in ("prequant_scaling_factor", "activation_scaling_factor"):
            fc, gate = (weights.pop(f"{prefix}{part}.{name}", None) for part in ("fc", "gate"))
            if fc is not None:
                if gate is None or not torch.equal(fc, gate):
                    raise ConfigError(f"{prefix}fc and {prefix}gate need one shared {name} to be fused")
                out[f"{prefix}fused_fc.{name}"] = fc
        return out
