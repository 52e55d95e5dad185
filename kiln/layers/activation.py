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
