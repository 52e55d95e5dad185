"""Activation functions by the names configs use."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kiln.errors import ConfigError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swiglu": F.silu,  # the gate's activation in a gated MLP
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # Nemotron-H's squared ReLU
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(f"hidden_act {name!r} is not one of {sorted(ACTIVATIONS)}") from None


class ClampedSwiGLU:
    """gpt-oss's expert activation of the two projections (kiln's ``fc``: HF's gate, ``gate``:
    HF's up): ``g = min(fc, limit)``, ``u = clamp(gate, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)``."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, fc: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        g = fc.clamp(max=self.limit)
        u = gate.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))
