"""Normalization layers: RMSNorm and LayerNorm, computed in float32 for accuracy."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln import kernels


class RmsNorm(nn.Module):
    """``x / rms(x) * weight`` (LLaMA)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and kernels.elementwise_supported(x):
            return kernels.rmsnorm(x, self.weight, self.eps)  # one native pass, same rounding as below
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32, round to the model dtype, then scale (as Hugging Face does).
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight


class LayerNorm(nn.Module):
    """Mean/variance normalization with an optional bias (GPT-2)."""

    def __init__(self, dim: int, eps: float, *, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), bias, self.eps).to(x.dtype)
