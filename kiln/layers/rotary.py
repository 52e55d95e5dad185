"""Rotary position embedding (RoPE) with linear, dynamic-NTK and llama3 frequency scaling.

Rotation follows the Hugging Face LLaMA layout (``rotate_half``: the first and second
halves of the rotary dims form the pairs). ``rotary_dim`` may be less than the head size
(partial rotary); the remaining dims pass through.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kiln.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


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
        if self.rope_type != "default" and "factor" not in scaling:
            raise ConfigError(f"rotary_scaling of type {self.rope_type!r} needs a 'factor'")
        self.factor = float(scaling.get("factor", 1.0))
        if self.rope_type == "dynamic" and not max_position_embeddings:
            raise ConfigError("dynamic rotary scaling needs max_position_embeddings")
        inv_freq = self._inv_freq(base)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        # Not a parameter: derived from the config, rebuilt on load, never saved.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

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
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[n, rotary_dim]`` of positions ``0..n-1`` for at least ``positions``
        positions (grown by doubling)."""
        tables = getattr(self, "_cos_sin_tables", None)
        if tables is None or tables[0].shape[0] < positions:
            n = max(256, 1 << (positions - 1).bit_length())
            freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            tables = self._cos_sin_tables = (emb.cos(), emb.sin())
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
