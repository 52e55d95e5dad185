"""Architecture name -> model class."""
from __future__ import annotations

from typing import Callable

from kiln.errors import ConfigError

MODEL_REGISTRY: dict[str, type] = {}


def register_model(*architectures: str) -> Callable[[type], type]:
    """Class decorator: ``@register_model("LlamaForCausalLM", "MistralForCausalLM")``."""
    def decorate(cls: type) -> type:
        for name in architectures:
            MODEL_REGISTRY[name] = cls
        return cls
    return decorate


def get_model_class(architecture: str) -> type:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"unknown architecture {architecture!r}; kiln supports {sorted(MODEL_REGISTRY)}") from None
