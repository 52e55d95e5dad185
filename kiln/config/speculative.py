"""Speculative decoding's settings (vLLM's ``speculative_config``): which proposer guesses the
next tokens and how many; ``kiln.runtime.speculative`` proposes, ``kiln.runtime.verification``
keeps what the target model agrees with."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kiln.errors import ConfigError

METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``method`` "ngram", "draft_model" or "mtp" (the target's own
    multi-token-prediction layer: Qwen3.5, Qwen3-Next); ``num_speculative_tokens`` proposed per
    step; for n-gram, the longest and shortest suffix looked up (``prompt_lookup_max`` /
    ``prompt_lookup_min``); for a draft model, ``model``: any engine or source with the target's
    vocabulary (a smaller model of its family, or a W4A16/W8A16 build of the target itself),
    resolved to an engine by the front end."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    quantization: str | None = None  # quantize the draft model's source while building it (W4A16, W8A16, ...)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config.num_speculative_tokens must be in [1, 16], got "
                              f"{self.num_speculative_tokens}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative_config.model: the draft model's engine or source, given with method "
                              f"draft_model (only), got method {self.method!r} and model {self.model!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """The config of ``value``: vLLM's dict (``LLM(speculative_config=...)``) or its JSON text
        (``--speculative_config``); None for None. Unknown keys are a ConfigError."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config: not JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        for key in ("model", "quantization"):
            if value.get(key) is not None and not isinstance(value[key], str):
                raise ConfigError(f"speculative_config.{key} must be a string, got {value[key]!r}")
        for key in known - {"method", "model", "quantization"}:
            if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool)):
                raise ConfigError(f"speculative_config.{key} must be an integer, got {value[key]!r}")
        return cls(**value)
