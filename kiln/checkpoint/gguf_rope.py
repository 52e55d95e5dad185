"""A GGUF file's rotary settings as Hugging Face config fields, read as llama.cpp reads them
(``llama_model_base::load_hparams``): ``rope.freq_base`` (default 10,000), ``rope.scaling.type``
(default linear) with ``rope.scaling.factor``, YaRN's original context and betas, Llama 3's
per-frequency divisors (``rope_freqs``), Phi-3's LongRoPE factors (``rope_factors_long/short``).
Functions here take a ``gguf_architectures.Meta``, which records the keys they read."""
from __future__ import annotations

import numpy as np


def _float(value) -> float:
    return float(str(np.float32(value)))


def _scaling(m) -> dict | None:
    """The scaling ``rope.scaling.*`` describes, or None."""
    key = f"{m.arch}.rope.scaling.type"
    kind = m.get("rope.scaling.type", None)
    factor = m.float("rope.scaling.factor", None)
    if factor is None:
        factor = m.float("rope.scale_linear", None)  # llama.cpp's older key
    original = m.int("rope.scaling.original_context_length", None)
    if kind == "none" or (kind in (None, "linear") and factor in (None, 0.0, 1.0)):
        return None
    if kind in (None, "linear"):  # llama.cpp's default type is linear
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise m.error(f"metadata key {key!r} is {kind!r}, which kiln does not support (supported: linear, yarn)")
    if factor is None:
        raise m.error(f"metadata key {key!r} is 'yarn' but 'rope.scaling.factor' is missing")
    scaling = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": int(original or m.int("context_length"))}
    for name in ("beta_fast", "beta_slow"):
        if (value := m.float(f"rope.scaling.yarn_{name}", None)) is not None:
            scaling[name] = value
    return scaling


def global_rope(m) -> dict:
    """``rope_theta`` and ``rope_scaling`` (when there is one) for a model rotating every layer alike."""
    theta = m.float("rope.freq_base", 10000.0)
    scaling = _scaling(m)
    if m.has("rope_freqs.weight"):
        if scaling is not None:
            raise m.error("a file with both 'rope_freqs' and rope.scaling metadata is not supported")
        heads = m.int("attention.head_count")
        head_dim = m.int("attention.key_length", m.int("embedding_length") // heads)
        dims = m.int("rope.dimension_count", head_dim)
        divisors = m.values("rope_freqs.weight")
        if divisors.size != dims // 2:
            raise m.error(f"rope_freqs has {divisors.size} values, expected {dims // 2}")
        original = m.int("rope.scaling.original_context_length", None) or 8192
        scaling = llama3_scaling(divisors, theta, dims, int(original))
    return {"rope_theta": theta, **({"rope_scaling": scaling} if scaling else {})}


def typed_rope(m, swa_base: float) -> dict:
    """``rope_parameters`` per layer type: full layers at ``rope.freq_base`` with the scaling,
    sliding layers at ``swa_base`` without (llama.cpp's ``rope_freq_scale_train_swa`` is 1)."""
    full = global_rope(m)
    return {"rope_parameters": {
        "full_attention": {"rope_theta": full["rope_theta"], **(full.get("rope_scaling") or {"rope_type": "default"})},
        "sliding_attention": {"rope_type": "default", "rope_theta": swa_base}}}


def longrope(m, config: dict) -> dict:
    """Phi-3's rotary: ``rope_parameters`` with LongRoPE's long and short factors when the file
    has them (plus llama.cpp's ``rope.scaling.attn_factor``, its cos/sin scale), else plain."""
    full = global_rope(m)
    if "rope_scaling" in full:
        raise m.error(f"rope scaling {full['rope_scaling']['rope_type']!r} in a phi3 file is not supported")
    params = {"rope_type": "default", "rope_theta": full["rope_theta"],
              "partial_rotary_factor": config.get("partial_rotary_factor", 1.0)}
    original = m.int("rope.scaling.original_context_length", None)
    attention = m.float("rope.scaling.attn_factor", None)
    factors = [name for name in ("rope_factors_long.weight", "rope_factors_short.weight") if m.has(name)]
    if factors:
        if len(factors) == 1 or original is None:
            raise m.error("LongRoPE needs both rope_factors_long and rope_factors_short and "
                          f"'{m.arch}.rope.scaling.original_context_length'")
        params.update(rope_type="longrope", original_max_position_embeddings=original,
                      long_factor=[_float(v) for v in m.values("rope_factors_long.weight")],
                      short_factor=[_float(v) for v in m.values("rope_factors_short.weight")])
        if attention is not None:
            params["attention_factor"] = attention
    elif attention not in (None, 1.0):
        raise m.error(f"metadata key '{m.arch}.rope.scaling.attn_factor' ({attention}) without LongRoPE factors "
                      "is not supported")
    return {"rope_parameters": params, **({"original_max_position_embeddings": original} if original else {})}


def llama3_scaling(divisors: np.ndarray, theta: float, dims: int, original: int) -> dict | None:
    """Recover HF's llama3 rope parameters from llama.cpp's per-frequency divisors (``rope_freqs``).

    llama.cpp divides frequency i by d_i: 1 for short wavelengths, ``factor`` for long ones, and
    1 / ((1 - s) / factor + s) between, with s = (original / wavelength - low) / (high - low).
    Only original/low and original/high matter, so ``original`` can be any fixed value.
    """
    factor = float(divisors.max())
    if factor <= 1.0:
        return None  # all ones: no scaling at all
    wavelen = 2 * np.pi * theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    tol = 1e-4 * factor
    band = (divisors > 1 + tol) & (divisors < factor - tol)
    x = original / wavelen[band]
    s = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)  # s = (x - low) / (high - low)
    if band.sum() >= 2:
        slope, intercept = np.polyfit(x, s, 1)
        low = -intercept / slope
        high = low + 1 / slope
    else:
        # Too few blend points to fit. Edges anywhere in the gaps around them split the frequencies
        # the same way, so place them there (through the one blend point when there is one).
        ones, full = wavelen[divisors <= 1 + tol], wavelen[divisors >= factor - tol]
        short = ones.max() if ones.size else wavelen.min() / 2
        long = full.min() if full.size else wavelen.max() * 2
        if band.any():
            span = 0.5 * min((x[0] - original / long) / s[0], (original / short - x[0]) / (1 - s[0]))
            low, high = x[0] - s[0] * span, x[0] + (1 - s[0]) * span
        else:
            low = original / (short * (long / short) ** (2 / 3))
            high = original / (short * (long / short) ** (1 / 3))
    return {"rope_type": "llama3", "factor": _float(factor), "low_freq_factor": round(float(low), 6),
            "high_freq_factor": round(float(high), 6), "original_max_position_embeddings": original}
