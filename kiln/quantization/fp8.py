"""FP8 (``FP8``): e4m3 weights and activations with per-tensor scales, calibrated at convert time.

The CPU has no FP8 arithmetic, so kiln emulates it exactly: the weight is stored as e4m3 codes
(1 byte each, ``torch.float8_e4m3fn``) with one float32 scale, ``w = code * weights_scaling_factor``;
at run time each input row is divided by the static ``activation_scaling_factor`` and rounded to
the nearest e4m3 value (ties to even, saturating at +-448); both sides' e4m3 values are exact in
bfloat16, their products are summed in float32 and each sum is multiplied by the two scales
once — what an FP8 tensor core with fp32 accumulation computes (kiln/kernels/fp8_linear.c).

Scales: ``weights_scaling_factor = max|W| / 448`` and ``activation_scaling_factor = 2 max|x| / 448``
over the calibration prompts run through the float model (a margin for inputs beyond those
of the calibration text: ``ACTIVATION_HEADROOM``) (reference 002's tensor names; shape
``[1]``). In an engine the weight scale is repeated per output column, so the gated MLP's fused
fc/gate keeps each half's scale; fc and gate read one input, so they share the activation scale.

W4A8_AWQ reuses the activation rounding: its input, multiplied by AWQ's prequant factor, is
rounded to the e4m3 grid of its own static scale before the 4-bit matmul (emulated in bf16;
``kiln.quantization.awq``).
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from kiln.layers.quantized_matmul import E4M3_MAX
from kiln.quantization.calibration import InputStats
from kiln.quantization.sequential import KVCacheCalibration, per_linear, stream_calibrated
from kiln.quantization.weight_only import FP8_ALGO

log = logging.getLogger(__name__)

_TINY = 1e-12  # floor of a scale: an all-zero tensor still gets a finite one


def quantize_fp8_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """e4m3 codes ``[out, in]`` of float ``weight`` and its per-tensor scale (float32 ``[1]``)."""
    w = weight.detach().float()
    scale = (w.abs().max() / E4M3_MAX).clamp(min=_TINY).reshape(1)
    return {"weight": (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn),
            "weights_scaling_factor": scale}


# Static activation scales leave this much room above the calibration maximum: on SmolLM2,
# 66 of 120 linears met inputs up to 1.3x their calibrated maximum on held-out text, which a
# scale of exactly max / 448 saturates (the outliers that matter most), while e4m3's 2^17
# range loses nothing measurable to a 2x margin (perplexity 7.81 -> 7.78; 8x: 7.82).
ACTIVATION_HEADROOM = 2.0


def activation_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The static per-tensor activation scale (float32 ``[1]``) of inputs whose per-channel
    maxima are ``absmax``: ``ACTIVATION_HEADROOM * max|x| / 448``."""
    return (ACTIVATION_HEADROOM * absmax.float().max() / E4M3_MAX).clamp(min=_TINY).reshape(1)


def _quantize_linear(name: str, linear: nn.Module, stats: InputStats) -> dict[str, torch.Tensor]:
    tensors = quantize_fp8_weight(linear.weight)
    tensors["activation_scaling_factor"] = activation_scale(stats.absmax)
    return tensors


def stream_fp8(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
               names: list[str], progress: bool = False,
               kv_cache: KVCacheCalibration | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of a meta-device ``model`` whose float ``weights`` stream in, the
    linears ``names`` quantized to FP8 with static activation scales calibrated layer by layer
    on ``token_lists``."""
    yield from stream_calibrated(model, weights, token_lists, names, lambda: InputStats(max_sample=0),
                                 per_linear(_quantize_linear), progress, kv_cache=kv_cache)
    log.info("%s: %d linears quantized", FP8_ALGO, len(names))
