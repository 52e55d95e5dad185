"""Reading Hugging Face config dicts: required fields with clear errors, rope settings."""
from __future__ import annotations

from typing import Any

from kiln.errors import ConfigError

_MISSING = object()


def hf_get(hf: dict, *names: str, default: Any = _MISSING) -> Any:
    """The first of ``names`` present in ``hf``; without a default, a missing field is an error."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is _MISSING:
        raise ConfigError(f"Hugging Face config.json lacks field {names[0]!r}")
    return default


def hf_rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config style.

    transformers >= 5 writes ``rope_parameters`` ({rope_type, rope_theta, factor...});
    older configs write ``rope_theta`` and ``rope_scaling`` ({type|rope_type, factor...}).
    """
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or scaling.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    merged = {**params, **scaling}
    merged.pop("partial_rotary_factor", None)  # not a scaling: see hf_partial_rotary
    kind = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if kind == "default":
        return float(theta), None
    return float(theta), {"rope_type": kind, **merged}


def hf_partial_rotary(hf: dict) -> float:
    """The fraction of each head that rotary embedding rotates (1.0 unless the config says less):
    ``partial_rotary_factor`` / ``rotary_pct`` at the top level or inside ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    return float(hf_get(hf, "partial_rotary_factor", "rotary_pct", default=params.get("partial_rotary_factor", 1.0)))


def hf_dtype(hf: dict, requested: str | None) -> str:
    """The dtype to convert to: the requested one, or the checkpoint's own (float32 if unknown)."""
    if requested and requested != "auto":
        return requested
    name = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").replace("torch.", "")
    return name if name in ("float32", "float16", "bfloat16") else "float32"
