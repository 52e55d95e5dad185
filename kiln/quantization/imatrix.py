"""Importance-weighted 4-bit quantization (``W4A16_IMATRIX``), calibrated at convert time.

Each linear's weights are rounded in groups of ``group_size`` inputs (default 32) to 16 levels
with a float scale and a float minimum per group, ``w ~ code * scale + offset``: the W4A16 layout
with offsets that GGUF Q4_1 and Q4_K files import into. The scale and offset are not the group's
range but the pair that minimises the importance-weighted squared error
``sum_j E[x_j^2] (w_j - code_j * scale - offset)^2``, ``E[x_j^2]`` being the mean square of input
channel ``j`` over the calibration text: the output's squared error when inputs are
uncorrelated (llama.cpp names these importances an importance matrix). An input channel that
carries large activations then keeps its weights closest, as AWQ's scales aim to, without
changing the matmul. The search tries codes over the group's range stretched to 14.1 .. 15.9
steps; for each candidate's codes the weighted least-squares scale and offset are solved in
closed form, and the group keeps the lowest error (the plain range is a candidate, so it never
does worse than range rounding under that weighting).

The statistics come from the float model's activations. ``kiln convert`` streams them layer by
layer (``kiln.quantization.sequential``), never holding the model; ``imatrix_quantize_model``
does the same on a model in memory. The checkpoint records ``MIXED_PRECISION`` with every
quantized linear ``W4A16`` with offsets (``QuantConfig.quantized_layers``), so engines need
nothing new.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from kiln import kernels
from kiln.config import LayerQuant, QuantConfig
from kiln.config.quant_algos import MIXED_PRECISION
from kiln.errors import ConfigError
from kiln.quantization.calibration import InputStats
from kiln.quantization.sequential import KVCacheCalibration, per_linear, stream_calibrated
from kiln.quantization.weight_only import check_group_size, pack_4bit

IMATRIX_ALGO = "W4A16_IMATRIX"
STRETCH = [15 + 0.05 * i for i in range(-18, 19)]  # candidate code ranges over the group's range
_CHUNK_ELEMENTS = 1 << 18  # weights searched at once by PyTorch: the candidates' temporaries stay small


def importance(stats: InputStats) -> torch.Tensor:
    """Per input channel weight of the rounding error: the inputs' mean square, floored at a
    millionth of its mean so a silent channel's weights still round sensibly."""
    mean_square = stats.mean_square.float()
    return mean_square + 1e-6 * mean_square.mean().clamp(min=1e-30)


def _search(groups: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The search in PyTorch (``kernels.fit_offset_groups`` is the same in C): float32 ``(scale,
    offset)`` ``[rows, groups]`` of weight groups ``[rows, groups, size]`` under error weights
    broadcasting to them."""
    groups, weight = groups.double(), weight.double().expand_as(groups)
    low = groups.amin(-1, keepdim=True)
    span = (groups.amax(-1, keepdim=True) - low).clamp(min=1e-12)
    sum_w, sum_x = weight.sum(-1, keepdim=True), (weight * groups).sum(-1, keepdim=True)
    sum_xx = (weight * groups * groups).sum(-1, keepdim=True)
    best_scale, best_offset = span / 15, low
    codes = torch.round((groups - low) / best_scale).clamp(0, 15)
    best_error = (weight * (codes * best_scale + low - groups) ** 2).sum(-1, keepdim=True)
    for stretch in STRETCH:
        codes = torch.round((groups - low) * (stretch / span)).clamp(0, 15)
        wc = weight * codes
        sum_c, sum_cc, sum_xc = wc.sum(-1, keepdim=True), (wc * codes).sum(-1, keepdim=True), (wc * groups).sum(-1, keepdim=True)
        det = sum_w * sum_cc - sum_c * sum_c
        safe = torch.where(det > 0, det, torch.ones_like(det))
        scale = (sum_w * sum_xc - sum_x * sum_c) / safe
        offset = (sum_cc * sum_x - sum_c * sum_xc) / safe
        error = (sum_xx - 2 * scale * sum_xc - 2 * offset * sum_x + scale * scale * sum_cc
                 + 2 * scale * offset * sum_c + offset * offset * sum_w)
        better = (det > 0) & (scale > 0) & (error < best_error)
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_offset = torch.where(better, offset, best_offset)
    return best_scale[..., 0].float(), best_offset[..., 0].float()


def fit_groups(weight: torch.Tensor, channel_importance: torch.Tensor, group_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The searched ``(scale, offset)`` ``[out, in / group_size]`` of a float ``weight``
    ``[out, in]`` whose input channels have the given importance ``[in]``: float16 values
    (engines store them so) held as float32."""
    w = weight.detach().float()
    found = kernels.fit_offset_groups(w, channel_importance, group_size, STRETCH)
    if found is None:
        out_features, in_features = w.shape
        groups = w.view(out_features, in_features // group_size, group_size)
        channel = channel_importance.float().view(1, in_features // group_size, group_size)
        found = torch.empty(groups.shape[:2]), torch.empty(groups.shape[:2])
        rows = max(1, _CHUNK_ELEMENTS // in_features)
        for start in range(0, out_features, rows):
            part = slice(start, start + rows)
            found[0][part], found[1][part] = _search(groups[part], channel)
    # Nearest float16 values (codes are clamped, so the range need not be covered): a grid of 16
    # levels whose scale and offset are float16 values is held exactly.
    scale, offset = found
    return scale.clamp(min=2.0 ** -14).to(torch.float16).float(), offset.to(torch.float16).float()


def quantize_weight_imatrix(weight: torch.Tensor, group_size: int, channel_importance: torch.Tensor
                            ) -> dict[str, torch.Tensor]:
    """W4A16-with-offsets checkpoint tensors (``weight`` codes, ``weights_scaling_factor``,
    ``weights_offset``) of a float ``weight`` ``[out, in]`` whose input channels have the
    given importance ``[in]``."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
    scale, offset = fit_groups(w, channel_importance, group_size)
    groups = w.view(out_features, in_features // group_size, group_size)
    codes = torch.empty(out_features, in_features, dtype=torch.uint8)
    rows = max(1, _CHUNK_ELEMENTS * 16 // in_features)  # float32 temporaries of a bounded size
    for start in range(0, out_features, rows):
        part = slice(start, start + rows)
        codes[part] = torch.round((groups[part] - offset[part, :, None]) / scale[part, :, None]).clamp(0, 15).view(
            -1, in_features).to(torch.uint8)
    out = pack_4bit(codes, scale, None, has_zero_point=False)
    out["weights_offset"] = offset.contiguous()
    return out


def recorded_config(quant: QuantConfig, names: list[str]) -> QuantConfig:
    """The checkpoint's config: the linears ``names`` in W4A16 with offsets, the rest float."""
    layer = LayerQuant("W4A16", quant.group_size, has_offset=True)
    return QuantConfig(quant_algo=MIXED_PRECISION, group_size=quant.group_size,
                       quantized_layers={name: layer for name in names},
                       kv_cache_quant_algo=quant.kv_cache_quant_algo)


def check_imatrix_request(quant: QuantConfig, world_size: int, where: str) -> None:
    """ConfigErrors for W4A16_IMATRIX settings kiln cannot honour, raised before calibrating."""
    check_group_size(quant, where)
    if quant.has_zero_point:
        raise ConfigError(f"{where}: {IMATRIX_ALGO} fits a float offset per group; drop --has_zero_point")
    if world_size != 1:
        raise ConfigError(f"{where}: {IMATRIX_ALGO} calibrates the float model's layers; convert with --tp_size 1 "
                          f"--pp_size 1 (got {world_size} ranks)")


def stats_factory() -> InputStats:
    """The statistics the importances need (no row sample)."""
    return InputStats(max_sample=0)


def stream_imatrix(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
                   quant: QuantConfig, names: list[str], progress: bool = False,
                   kv_cache: KVCacheCalibration | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of a meta-device ``model`` whose float ``weights`` stream in, the
    linears ``names`` quantized, calibrated layer by layer (``kiln.quantization.sequential``)."""
    return stream_calibrated(model, weights, token_lists, names, stats_factory, per_linear(
        lambda name, linear, stats: quantize_weight_imatrix(linear.weight, quant.group_size, importance(stats))),
        progress, kv_cache=kv_cache)
