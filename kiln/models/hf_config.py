"""Reading Hugging Face config dicts: required fields with clear errors, rope settings."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kiln.config import PretrainedConfig
from kiln.dtypes import DTYPES
from kiln.errors import ConfigError
from kiln.models.decoder import LAYER_TYPES

_MISSING = object()


def hf_get(hf: dict, *names: str, default: Any = _MISSING) -> Any:
    """The first of ``names`` present in ``hf``; without a default, a missing field is an error."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is _MISSING:
        raise ConfigError(f"Hugging Face config.json lacks field {names[0]!r}")
    return default


def _rope_parameters(hf: dict, layer_type: str) -> dict:
    """``rope_parameters`` for layers of ``layer_type``: the dict itself, or its entry for that
    type where the config keys it by layer type (Gemma 3, OLMo 3: ``{"full_attention": {...}, ...}``)."""
    params = hf.get("rope_parameters") or {}
    if params and set(params) <= set(LAYER_TYPES):
        return dict(params.get(layer_type) or {})
    return dict(params)


def hf_rope(hf: dict, layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config style, for layers of ``layer_type``.

    transformers >= 5 writes ``rope_parameters`` ({rope_type, rope_theta, factor...}, or one such
    dict per layer type); older configs write ``rope_theta`` and ``rope_scaling`` ({type|rope_type,
    factor...}).
    """
    params = _rope_parameters(hf, layer_type)
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or scaling.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    merged = {**params, **scaling}
    kind = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if kind != "proportional":  # there it says which frequencies turn (kiln.layers.rotary)
        merged.pop("partial_rotary_factor", None)  # not a scaling: see hf_partial_rotary
    if kind == "default":
        return float(theta), None
    if kind in ("yarn", "longrope") and hf.get("original_max_position_embeddings"):
        merged.setdefault("original_max_position_embeddings", hf["original_max_position_embeddings"])
    return float(theta), {"rope_type": kind, **merged}


def hf_layer_rotary(hf: dict) -> dict:
    """kiln's ``layer_rotary`` (per-layer-type overrides of the rotary settings) from a config
    whose ``rope_parameters`` are keyed by layer type: the settings of each type that differ
    from the full-attention layers' (which are the default)."""
    params = hf.get("rope_parameters") or {}
    if not params or not set(params) <= set(LAYER_TYPES):
        return {}
    full_theta, full_scaling = hf_rope(hf)
    default = (full_theta, full_scaling, None if full_scaling and full_scaling["rope_type"] == "proportional" else
               _rope_parameters(hf, "full_attention").get("partial_rotary_factor"))
    overrides = {}
    for kind in params:
        theta, scaling = hf_rope(hf, kind)
        # Proportional rotary spans the whole head (its fraction is inside the scaling).
        fraction = None if scaling and scaling["rope_type"] == "proportional" else \
            _rope_parameters(hf, kind).get("partial_rotary_factor")
        if (theta, scaling, fraction) != default:
            overrides[kind] = {"rotary_base": theta, "rotary_scaling": scaling,
                               **({"rotary_pct": float(fraction)} if fraction is not None else {})}
    return overrides


def hf_partial_rotary(hf: dict) -> float:
    """The fraction of each head that rotary embedding rotates (1.0 unless the config says less):
    ``partial_rotary_factor`` / ``rotary_pct`` at the top level or inside ``rope_parameters``."""
    params = _rope_parameters(hf, "full_attention")
    return float(hf_get(hf, "partial_rotary_factor", "rotary_pct", default=params.get("partial_rotary_factor", 1.0)))


def hf_sliding_window(hf: dict, *, default_types: list[str] | None = None) -> dict:
    """The checkpoint fields of a sliding attention window: ``sliding_window`` (None: none) and
    ``layer_types`` (which layers use it; None: all), from ``layer_types`` when the config lists
    them (transformers >= 5), else ``default_types`` (the family's older rule)."""
    window = hf.get("sliding_window")
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": window, "layer_types": hf.get("layer_types") or default_types}


def hf_dtype(hf: dict, requested: str | None) -> str:
    """The dtype to convert to: the requested one, or the checkpoint's own (float32 if unknown)."""
    if requested and requested != "auto":
        return requested
    name = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").replace("torch.", "")
    return name if name in DTYPES else "float32"


def rope_decoder_config(hf: dict, dtype: str | None, mapping, architecture: str, *, hidden_act: str | None = None,
                        norm_epsilon: float | None = None, tied_default: bool = False,
                        extra: dict | None = None) -> PretrainedConfig:
    """The config of a decoder with rotary positions from a Hugging Face config, with the field
    names most families share (``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``...);
    a family passes what it names differently and its own ``extra`` fields (which win)."""
    heads, hidden = hf_get(hf, "num_attention_heads"), hf_get(hf, "hidden_size")
    theta, scaling = hf_rope(hf)
    tied = bool(hf.get("tie_word_embeddings", tied_default))
    return PretrainedConfig(
        architecture=architecture,
        dtype=hf_dtype(hf, dtype),
        vocab_size=hf_get(hf, "vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=hf_get(hf, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=hf_get(hf, "num_key_value_heads", default=heads),
        head_size=hf_get(hf, "head_dim", default=hidden // heads),
        hidden_act=hidden_act or hf_get(hf, "hidden_act", default="silu"),
        intermediate_size=hf_get(hf, "intermediate_size"),
        norm_epsilon=norm_epsilon if norm_epsilon is not None else float(hf_get(hf, "rms_norm_eps", default=1e-6)),
        max_position_embeddings=hf_get(hf, "max_position_embeddings", default=None),
        position_embedding_type="rope_gpt_neox",
        mapping=mapping,
        share_embedding_table=tied,
        extra={"rotary_base": theta, "rotary_scaling": scaling, "tie_word_embeddings": tied,
               **({"layer_rotary": layer_rotary} if (layer_rotary := hf_layer_rotary(hf)) else {}), **(extra or {})},
    )


def nested_text_config(family_config: Callable[[dict, str | None, Any], PretrainedConfig], hf: dict,
                       dtype: str | None, mapping: Any, source: str) -> PretrainedConfig:
    """The config of the language model inside a multimodal checkpoint of architecture ``source``
    (Gemma 3 / 4's ``*ForConditionalGeneration``): ``family_config`` (the text family's
    ``config_from_hf``) over its ``text_config``, the source recorded in ``extra``."""
    if not hf.get("text_config"):
        raise ConfigError(f"{source} config lacks 'text_config'")
    config = family_config(hf_text_config(hf, tie_default=True), dtype, mapping)
    # The checkpoint is an ordinary language model of the family from here on.
    return dataclasses.replace(config, extra={**config.extra, "source_architecture": source})


def hf_text_config(hf: dict, tie_default: bool) -> dict:
    """A multimodal checkpoint's ``text_config`` (LLaVA, Gemma 3) completed from its top level:
    whether the head is tied, and the dtype the weights are stored as."""
    text = dict(hf.get("text_config") or {})
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", tie_default))
    for field in ("torch_dtype", "dtype"):
        if field in hf:
            text.setdefault(field, hf[field])
    return text
