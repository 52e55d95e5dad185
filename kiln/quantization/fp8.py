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

import dataclasses
import logging

import torch
from torch import nn

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.layers.quantized_matmul import E4M3_MAX
from kiln.quantization.calibration import InputStats, collect_linear_inputs
from kiln.quantization.weight_only import FP8_ALGO, quantizable_modules

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


@torch.inference_mode()
def fp8_quantize_model(model: nn.Module, quant: QuantConfig, token_lists: list[list[int]],
                       progress: bool = False) -> QuantConfig | None:
    """Calibrate float ``model`` on ``token_lists`` (each linear's input range), then quantize its
    linears to FP8 in place. Returns ``quant`` as the checkpoint must record it
    (``exclude_modules`` names every linear left in float), None if none was quantized."""
    if model.config.mapping.world_size != 1:
        raise ConfigError(f"{FP8_ALGO} calibrates the whole model in one process: convert with tp_size 1 and pp_size 1")
    chosen, excluded = quantizable_modules(model, quant)
    if not chosen:
        return None
    if not token_lists:
        raise ConfigError(f"{FP8_ALGO}: the calibration texts gave no prompt of 2 or more tokens")
    longest = model.config.max_position_embeddings
    if longest:  # positions beyond the model's would calibrate on activations it never sees
        token_lists = [ids[:longest] for ids in token_lists]
    stats = collect_linear_inputs(model, token_lists, [name for name, _ in chosen],
                                  make=lambda: InputStats(max_sample=0), progress=progress)
    for name, linear in chosen:
        tensors = quantize_fp8_weight(linear.weight)
        tensors["activation_scaling_factor"] = activation_scale(stats[name].absmax)
        linear.use_fp8(tensors)
    log.info("%s: %d linears quantized", FP8_ALGO, len(chosen))
    return dataclasses.replace(quant, exclude_modules=excluded)
