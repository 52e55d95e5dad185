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


def get_model_class(architecture: str, source: str | None = None) -> type:
    """The class registered for ``architecture``; ``source`` (a config path) goes into the error."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        where = f"{source}: " if source else ""
        raise ConfigError(
            f"{where}unknown architecture {architecture!r}; kiln supports {sorted(MODEL_REGISTRY)}") from None
