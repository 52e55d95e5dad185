"""PretrainedConfig: the ``config.json`` of a kiln checkpoint (reference 002's table).

The fields of the reference table are attributes with the table's defaults; anything else
a model needs (rotary settings, bias flags, OPT's ``do_layer_norm_before``...) is kept as
an extra field, so the format stays open the way the reference describes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kiln.config.quant_algos import ALGOS, KV_CACHE_QUANT_ALGOS, LAYER_ALGOS, MIXED_PRECISION
from kiln.dtypes import DTYPES
from kiln.errors import ConfigError
from kiln.mapping import Mapping

QUANT_ALGOS = (*ALGOS, MIXED_PRECISION)


@dataclass(frozen=True)
class LayerQuant:
    """One linear's weight-only format in a ``MIXED_PRECISION`` checkpoint: W8A16 or W4A16 codes,
    ``group_size`` inputs per scale (None: W8A16's scale per output channel), and per group an
    integer ``zero`` point (``has_zero_point``, W4A16) or a float ``weights_offset``
    (``has_offset``): ``w = code * scale + offset``. ``super_scales`` (GGUF's K-quants): the group
    scales and offsets are int8 codes times a float per ``kernels.SUPER_K`` inputs
    (``weights_super_scale``, ``weights_super_offset``)."""

    quant_algo: str
    group_size: int | None = None
    has_zero_point: bool = False
    has_offset: bool = False
    codebook: str | None = None  # "e2m1": W4A16 codes are MXFP4's E2M1 nibbles (twice the value)
    super_scales: bool = False

    def __post_init__(self) -> None:
        if self.quant_algo not in LAYER_ALGOS:
            raise ConfigError(f"quantized_layers: quant_algo {self.quant_algo!r} is not one of {LAYER_ALGOS}")
        if self.group_size is None and (self.bits == 4 or self.has_offset or self.has_zero_point):
            raise ConfigError(f"quantized_layers: {self.quant_algo} with zero points or offsets needs a group_size")
        if self.bits == 6 and (self.group_size != 16 or not self.super_scales or self.has_offset
                               or self.has_zero_point):
            raise ConfigError("quantized_layers: W6A16 (GGUF's Q6_K) takes groups of 16 under super_scales, "
                              "without offsets")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0
                                            or self.group_size % 32 and self.bits != 6):
            raise ConfigError(f"quantized_layers: group_size must be a positive multiple of 32, got {self.group_size!r}")
        if self.has_zero_point and (self.has_offset or self.bits == 8):
            raise ConfigError("quantized_layers: zero points are for W4A16 layers without offsets")
        if self.codebook is not None and (self.codebook != "e2m1" or self.bits != 4 or self.has_zero_point
                                          or self.has_offset):
            raise ConfigError(f"quantized_layers: codebook {self.codebook!r} is not 'e2m1' on a W4A16 layer without "
                              "zero points or offsets")
        if self.super_scales and (self.group_size is None or self.has_zero_point or self.codebook is not None):
            raise ConfigError("quantized_layers: super_scales are for group scales and offsets of integer codes")

    @property
    def bits(self) -> int:
        return LAYER_ALGOS[self.quant_algo]


@dataclass(frozen=True)
class QuantConfig:
    """The ``quantization`` part of a checkpoint config."""

    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int = 64
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list[str] | None = None
    quantized_layers: dict[str, LayerQuant] | None = None  # MIXED_PRECISION: linear name -> its format

    def __post_init__(self) -> None:
        if self.quant_algo is not None and self.quant_algo not in QUANT_ALGOS:
            raise ConfigError(f"quantization.quant_algo {self.quant_algo!r} is not one of {QUANT_ALGOS}")
        if self.kv_cache_quant_algo is not None and self.kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
            raise ConfigError(
                f"quantization.kv_cache_quant_algo {self.kv_cache_quant_algo!r} is not one of {KV_CACHE_QUANT_ALGOS}"
            )
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ConfigError(f"quantization.group_size must be a positive integer, got {self.group_size!r}")
        if (self.quant_algo == MIXED_PRECISION) != bool(self.quantized_layers):
            raise ConfigError(f"quantization.quantized_layers goes with (and only with) quant_algo {MIXED_PRECISION}")

    @classmethod
    def from_dict(cls, d: dict | None) -> "QuantConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"quantization has unknown fields {sorted(unknown)}")
        if d.get("quantized_layers") is not None:
            layers = d["quantized_layers"]
            if not isinstance(layers, dict) or not all(isinstance(v, (dict, LayerQuant)) for v in layers.values()):
                raise ConfigError("quantization.quantized_layers must map linear names to formats")
            try:
                d["quantized_layers"] = {name: v if isinstance(v, LayerQuant) else LayerQuant(**v)
                                         for name, v in layers.items()}
            except TypeError as e:
                raise ConfigError(f"quantization.quantized_layers: {e}") from None
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


# name -> default; None marks a mandatory field (reference 002).
_MANDATORY = ("architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "hidden_act")


@dataclass
class PretrainedConfig:
    """A model's hyper-parameters as stored in a checkpoint's or engine's ``config.json``."""

    architecture: str
    dtype: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    hidden_act: str
    logits_dtype: str = "float32"
    max_position_embeddings: int | None = None
    num_key_value_heads: int | None = None  # None -> num_attention_heads
    intermediate_size: int | None = None
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "learned_absolute"
    mapping: Mapping = field(default_factory=Mapping)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    use_parallel_embedding: bool = False
    embedding_sharding_dim: int = 0
    share_embedding_table: bool = False
    head_size: int | None = None  # None -> hidden_size // num_attention_heads
    extra: dict[str, Any] = field(default_factory=dict)  # model-specific fields

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_size is None:
            self.head_size = self.hidden_size // max(self.num_attention_heads, 1)
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        for name in ("dtype", "logits_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"config field {name!r} must be one of {tuple(DTYPES)}, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.embedding_sharding_dim not in (0, 1):
            raise ConfigError(f"embedding_sharding_dim must be 0 or 1, got {self.embedding_sharding_dim!r}")
        tp = self.mapping.tp_size
        if self.num_attention_heads % tp:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not divisible by tp_size ({tp})")
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:
            raise ConfigError(f"num_key_value_heads ({kv}) and tp_size ({tp}): one must divide the other")

    def __getattr__(self, name: str) -> Any:
        # Model-specific fields read like the standard ones: config.rotary_base.
        extra = self.__dict__.get("extra")
        if extra is not None and name in extra:
            return extra[name]
        raise AttributeError(f"config has no field {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        """A standard or model-specific field, or ``default`` when it is absent."""
        try:
            return getattr(self, name)
        except AttributeError:
            return default

    # -- (de)serialisation ------------------------------------------------------------

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d["mapping"] = self.mapping.to_dict()
        d["quantization"] = self.quantization.to_dict()
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: dict, rank: int = 0, source: str = "config") -> "PretrainedConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        missing = [name for name in _MANDATORY if d.get(name) is None]
        if missing:
            raise ConfigError(f"{source}: mandatory field(s) {missing} missing")
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["mapping"] = Mapping.from_dict(d.get("mapping"), rank=rank)
        kwargs["quantization"] = QuantConfig.from_dict(d.get("quantization"))
        engine_sections = ("build_config", "engine_format", "lora_config")  # an engine's, not the model's
        extra = {k: v for k, v in d.items() if k not in known and k not in engine_sections}
        try:
            return cls(**kwargs, extra=extra)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path, rank: int = 0) -> "PretrainedConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, rank=rank, source=str(path))

    def for_rank(self, rank: int) -> "PretrainedConfig":
        """The same config seen from another rank."""
        return PretrainedConfig.from_dict(self.to_dict(), rank=rank)
