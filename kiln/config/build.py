"""BuildConfig: the limits and options an engine is built with."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from kiln.errors import ConfigError


_MAY_BE_ZERO = frozenset({"max_prompt_embedding_table_size"})  # 0: the feature is off


@dataclass(frozen=True)
class BuildConfig:
    """Limits an engine is built for; stored as ``build_config`` in the engine's config.json."""

    max_batch_size: int = 64
    max_input_len: int = 2048
    max_seq_len: int = 4096
    max_num_tokens: int = 8192
    tokens_per_block: int = 64
    max_beam_width: int = 1
    gather_all_token_logits: bool = False  # keep the logits of every prompt token (context logits)
    # Prompt tuning (reference 001): the most virtual-token rows a request's embedding table may
    # have; 0 builds an engine without prompt tuning.
    max_prompt_embedding_table_size: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in (bool, "bool"):
                if not isinstance(value, bool):
                    raise ConfigError(f"build option {f.name} must be true or false, got {value!r}")
            elif f.name in _MAY_BE_ZERO:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ConfigError(f"build option {f.name} must be a whole number >= 0, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"build option {f.name} must be a positive integer, got {value!r}")
        if self.max_input_len > self.max_seq_len:
            raise ConfigError(
                f"max_input_len ({self.max_input_len}) must not exceed max_seq_len ({self.max_seq_len})"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BuildConfig":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"build_config has unknown fields {sorted(unknown)}")
        return cls(**d)
