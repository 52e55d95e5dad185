"""Rotary position embedding (RoPE) with linear, dynamic-NTK, llama3, YaRN, LongRoPE and
proportional frequency scaling.

Rotation follows the Hugging Face LLaMA layout (``rotate_half``: the first and second
halves of the rotary dims form the pairs). ``rotary_dim`` may be less than the head size
(partial rotary); the remaining dims pass through.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kiln.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    # Between the two wavelengths, blend the scaled and unscaled frequencies smoothly.
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, base: float, rotary_dim: int, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept, and
    the dims between blended along a linear ramp."""
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns ``rotations`` times over the old context
        return rotary_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _proportional_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Gemma 4's proportional rotary: the whole head is the rotary span (the exponents count over
    all of it), but only the first ``partial_rotary_factor`` of its frequency pairs turn; the
    others get frequency 0 (cos 1, sin 0: those dims pass through). Unlike a partial rotary of
    that fraction, the turning pairs keep the full head's frequencies and pair dim i with
    i + head/2."""
    fraction = scaling.get("partial_rotary_factor", 1.0)
    if not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ConfigError(f"proportional rotary_scaling needs 'partial_rotary_factor' in [0, 1], got {fraction!r}")
    turning = int(fraction * inv_freq.numel() * 2 // 2)  # as transformers: int(fraction * head_dim // 2)
    return torch.cat([inv_freq[:turning], torch.zeros(inv_freq.numel() - turning, dtype=inv_freq.dtype,
                                                      device=inv_freq.device)])


def _yarn_attention_factor(scaling: dict) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def _longrope_attention_factor(factor: float, old_context: int) -> float:
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_context))


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for positions and rotates q and k in place of nothing (pure)."""

    def __init__(self, rotary_dim: int, base: float, max_position_embeddings: int | None,
                 scaling: dict | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.base = base
        self.max_position_embeddings = max_position_embeddings
        scaling = dict(scaling or {})
        self.rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rotary_scaling type {self.rope_type!r} is not one of {ROPE_TYPES}")
        if self.rope_type in ("yarn", "longrope"):
            if not scaling.get("original_max_position_embeddings"):
                raise ConfigError(f"rotary_scaling of type {self.rope_type!r} needs 'original_max_position_embeddings'")
            if scaling.get("factor") is None:  # Phi-3 style: the ratio of the two context lengths
                if not max_position_embeddings:
                    raise ConfigError(f"rotary_scaling of type {self.rope_type!r} needs a 'factor' or "
                                      "max_position_embeddings")
                scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
        if self.rope_type == "proportional":  # factor optional (1): see _proportional_inv_freq
            scaling.setdefault("factor", 1.0)
        if self.rope_type != "default" and "factor" not in scaling:
            raise ConfigError(f"rotary_scaling of type {self.rope_type!r} needs a 'factor'")
        self.factor = float(scaling.get("factor", 1.0))
        if self.rope_type == "dynamic" and not max_position_embeddings:
            raise ConfigError("dynamic rotary scaling needs max_position_embeddings")
        # cos and sin are multiplied by this (YaRN's and LongRoPE's attention temperature).
        self.attention_factor = float(scaling.get("attention_factor") or 1.0)
        inv_freq = self._inv_freq(base)
        long_inv_freq = None
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif self.rope_type == "yarn":
            inv_freq = _yarn_inv_freq(inv_freq, base, rotary_dim, scaling)
            if scaling.get("attention_factor") is None:
                self.attention_factor = _yarn_attention_factor(scaling)
        elif self.rope_type == "proportional":
            inv_freq = _proportional_inv_freq(inv_freq, scaling) / self.factor
        elif self.rope_type == "longrope":
            # Short factors while a sequence is within the original context, long ones past it.
            self.original_context = int(scaling["original_max_position_embeddings"])
            short, long = (self._longrope_factors(scaling, key) for key in ("short_factor", "long_factor"))
            inv_freq, long_inv_freq = inv_freq / short, inv_freq / long
            if scaling.get("attention_factor") is None:
                self.attention_factor = _longrope_attention_factor(self.factor, self.original_context)
        # Not parameters: derived from the config, rebuilt on load, never saved.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def _longrope_factors(self, scaling: dict, key: str) -> torch.Tensor:
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != self.rotary_dim // 2:
            raise ConfigError(f"longrope rotary_scaling needs '{key}': a list of {self.rotary_dim // 2} numbers "
                              f"(half the rotary dims), got {factors!r}")
        return torch.tensor(factors, dtype=torch.float32, device="cpu")

    def _inv_freq(self, base: float) -> torch.Tensor:
        # Explicit device: models are constructed under torch.device("meta"), but this
        # buffer is derived from the config, never loaded, so it must be real.
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu").float() / self.rotary_dim
        return 1.0 / (base ** exponents)

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each ``[num_tokens, rotary_dim]``, for the tokens' positions.

        ``seq_lens`` (one per token: the length of its sequence once this step is done) is
        needed by dynamic NTK scaling, whose base grows with the sequence length. Other kinds
        look positions up in tables computed once (five small ops a step cost more than a
        batch-1 step's rotary itself); ``max_position``, when the caller knows it, saves
        finding the largest position.
        """
        if self.rope_type == "dynamic" and seq_lens is not None:
            freqs = self._dynamic_freqs(positions, seq_lens)
            emb = torch.cat([freqs, freqs], dim=-1)
            return emb.cos(), emb.sin()
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        cos, sin = self._tables(max_position + 1)
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        if self.long_inv_freq is not None:  # LongRoPE: tokens of sequences past the original context
            lengths = seq_lens if seq_lens is not None else positions + 1
            long = (lengths > self.original_context)[:, None]
            if bool(long.any()):
                long_cos, long_sin = self._tables(max_position + 1, long=True)
                cos = torch.where(long, long_cos.index_select(0, positions), cos)
                sin = torch.where(long, long_sin.index_select(0, positions), sin)
        return cos, sin

    def _tables(self, positions: int, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[n, rotary_dim]`` (times the attention factor) of positions ``0..n-1``
        for at least ``positions`` positions (grown by doubling); ``long``: LongRoPE's long factors."""
        attr = "_long_cos_sin_tables" if long else "_cos_sin_tables"
        tables = getattr(self, attr, None)
        if tables is None or tables[0].shape[0] < positions:
            n = max(256, 1 << (positions - 1).bit_length())
            inv_freq = self.long_inv_freq if long else self.inv_freq
            freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            tables = (cos, sin)
            setattr(self, attr, tables)
        return tables

    def _dynamic_freqs(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        max_pos = self.max_position_embeddings
        seq = torch.clamp(seq_lens.to(torch.float64), min=max_pos)
        ratio = (self.factor * seq / max_pos) - (self.factor - 1)
        bases = self.base * ratio ** (self.rotary_dim / (self.rotary_dim - 2))  # [num_tokens]
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        inv_freq = 1.0 / (bases.float()[:, None] ** exponents[None, :])
        return positions.to(torch.float32)[:, None] * inv_freq

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[num_tokens, num_heads, head_size]`` by cos/sin ``[num_tokens, rotary_dim]``."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated * sin
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)
