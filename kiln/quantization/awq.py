"""Activation-aware weight quantization (AWQ, ``W4A16_AWQ``), calibrated at convert time.

A few input channels of a linear layer carry much larger activations than the rest; their
weights matter more. AWQ scales each input channel's weight column by ``s`` before the 4-bit
round-to-nearest (so the important columns lose less to rounding) and divides the input by
``s`` at run time: ``y = Q(W diag(s)) (x / s)``. Per input channel ``s = mean|x| ** alpha``
(normalised so its extremes multiply to 1), with ``alpha`` picked from a grid by the output
error on a sample of calibration rows. ``alpha = 0`` is plain round-to-nearest, so the search
never does worse than W4A16 on those rows.

Then, as published, each linear's weight range is clipped: per output channel and group, the
ratio of ``max|w|`` kept (1.0 down to 0.5 by 0.05) that minimises the error of the group's
share of the output on the same rows. A rare large weight then no longer stretches its group's
step for all the others. Ratio 1.0 is no clipping, and an output channel whose whole error
(across groups) the chosen ratios do not lower keeps 1.0, so clipping never does worse on the
calibration rows. The clipped range only changes the stored scales and zero points.

Linears that read the same input (a gated MLP's ``fc`` and ``gate``) get one scale: the
engine fuses them into one matmul with one input multiply.

Checkpoint tensors: W4A16's (``weight`` codes of ``W diag(s)``, ``weights_scaling_factor``,
``zero``) plus ``prequant_scaling_factor`` = 1/s, float32 ``[in_features]`` (reference 002).
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.layers.quantized_matmul import dequantize, round_to_e4m3
from kiln.quantization.calibration import InputStats
from kiln.quantization.fp8 import activation_scale
from kiln.quantization.sequential import KVCacheCalibration, stream_calibrated
from kiln.quantization.weight_only import check_group_size, codes_4bit, group_params, quantize_weight

log = logging.getLogger(__name__)

AWQ_ALGO = "W4A16_AWQ"
W4A8_AWQ_ALGO = "W4A8_AWQ"  # AWQ's 4-bit weights with FP8 e4m3 activations (static per-tensor scale)
AWQ_ALGOS = (AWQ_ALGO, W4A8_AWQ_ALGO)
DEFAULT_GRID = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # share of each group's max|w| kept: 1.0 .. 0.5


def awq_scale(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per input channel ``s = abs_mean ** alpha`` divided by sqrt(max * min) (so the weight's
    overall range stays put); all ones for ``alpha = 0``."""
    s = abs_mean.float().clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def _rtn(weight: torch.Tensor, group_size: int, has_zero_point: bool) -> torch.Tensor:
    """W4A16 round-to-nearest of ``weight``, dequantized (float32)."""
    return dequantize(quantize_weight(weight, 4, group_size, has_zero_point), 4, group_size)


def _fp8_activations(x: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the e4m3 grid of the static scale of inputs whose range is ``absmax``."""
    a = activation_scale(absmax)
    return round_to_e4m3(x / a) * a


def search_scale(weights: list[torch.Tensor], rows: torch.Tensor, abs_mean: torch.Tensor, group_size: int,
                 has_zero_point: bool, grid: int = DEFAULT_GRID,
                 absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, float, float, float]:
    """The AWQ scale ``s`` for linears ``weights`` (``[out_i, in]`` each) sharing the input
    ``rows`` ``[n, in]``: ``alpha`` in ``{0, 1/grid, ..., (grid-1)/grid}`` minimising the summed
    squared error ``||W x - Q(W diag(s)) (x / s)||^2``. With the inputs' per-channel range
    ``absmax`` (W4A8_AWQ), ``x / s`` is also rounded to FP8 on its static scale
    (``max|x / s| / 448``) as the engine will. Returns ``(s, alpha, error, rtn_error)``
    (``rtn_error``: alpha 0, plain round-to-nearest)."""
    x = rows.float()
    w = torch.cat([wi.float() for wi in weights])  # one search for the group: the errors add up
    reference = x @ w.t()
    best = None
    rtn_error = float("nan")
    for i in range(grid):
        alpha = i / grid
        s = awq_scale(abs_mean, alpha)
        xs = x / s if absmax is None else _fp8_activations(x / s, absmax / s)
        error = (xs @ _rtn(w * s, group_size, has_zero_point).t() - reference).pow(2).sum().item()
        if i == 0:
            rtn_error = error
        if best is None or error < best[2]:
            best = (s, alpha, error)
    return best[0], best[1], best[2], rtn_error


def search_clip(weight: torch.Tensor, gram: torch.Tensor, group_size: int, has_zero_point: bool,
                ratios: tuple[float, ...] = CLIP_RATIOS) -> torch.Tensor:
    """Clipping ratios ``[out, in / group_size]`` for quantizing ``weight`` ``[out, in]`` whose
    inputs ``X`` have the Gram matrix ``gram = X^T X`` ``[in, in]`` (any positive multiple): per
    output channel and group the ratio minimising ``||X_g (w_g - Q(w_g))||^2`` (``X_g``, ``w_g``:
    the group's inputs and weights), reset to 1.0 for an output channel whose whole output error
    ``||X (w - Q(w))||^2`` that does not lower."""
    w = weight.detach().float()
    gram = gram.float()
    out_features, in_features = w.shape
    groups = in_features // group_size
    # [groups, g, g]: the diagonal blocks; each group's own error is a quadratic form in its block
    blocks = gram.view(groups, group_size, groups, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    wg = w.view(out_features, groups, group_size)
    best = torch.ones(out_features, groups)
    best_error = torch.full((out_features, groups), float("inf"))
    for ratio in ratios:
        scale, zero = group_params(wg, has_zero_point, ratio)
        delta = wg - (codes_4bit(wg, scale[..., None], zero[..., None]) - zero[..., None]) * scale[..., None]
        error = (torch.einsum("ogi,gij->ogj", delta, blocks) * delta).sum(-1)  # [out, groups]
        better = error < best_error
        best = torch.where(better, torch.full_like(best, ratio), best)
        best_error = torch.where(better, error, best_error)
    # The search treats groups apart; the output adds them up. Keep clipping where the sum agrees.
    deltas = [w - dequantize(quantize_weight(w, 4, group_size, has_zero_point, clip), 4, group_size)
              for clip in (None, best)]
    plain, clipped = (((d @ gram) * d).sum(1) for d in deltas)  # [out]
    best[clipped > plain] = 1.0
    return best


def input_groups(names: list[str], stats: dict[str, InputStats]) -> list[list[str]]:
    """``names`` grouped by shared input: siblings (same parent module) that saw identical rows."""
    groups: list[list[str]] = []
    for name in names:
        parent = name.rpartition(".")[0]
        sample = stats[name].rows_sample()
        for group in groups:
            first = group[0]
            if (first.rpartition(".")[0] == parent and stats[first].rows == stats[name].rows
                    and torch.equal(stats[first].rows_sample(), sample)):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


def check_awq_request(quant: QuantConfig, world_size: int, where: str) -> None:
    """ConfigErrors for AWQ settings kiln cannot honour, raised before any calibration."""
    check_group_size(quant, where)
    if world_size != 1:
        raise ConfigError(f"{where}: {quant.quant_algo} calibrates the whole float model; convert with --tp_size 1 "
                          f"--pp_size 1 (got {world_size} ranks)")


class AwqStage:
    """AWQ's ``QuantizeStage`` (``kiln.quantization.sequential``): per input group of a stage's
    linears, the scale search, then per linear the clipping search and the rounding of ``W diag(s)``
    (W4A8_AWQ: with the static FP8 activation scale ``max|x / s| / 448``). Keeps each group's
    output error relative to round-to-nearest's for the log."""

    def __init__(self, quant: QuantConfig, grid: int = DEFAULT_GRID, clip: bool = True):
        self.quant, self.grid, self.clip = quant, grid, clip
        self.gains: list[float] = []

    def __call__(self, linears: dict[str, nn.Module], stats: dict[str, InputStats]) -> dict[str, dict[str, torch.Tensor]]:
        quant, fp8_inputs = self.quant, self.quant.quant_algo == W4A8_AWQ_ALGO
        out, clips = {}, {}
        for group in input_groups(list(linears), stats):
            st = stats[group[0]]
            rows = st.rows_sample()
            s, alpha, error, rtn_error = search_scale([linears[n].weight for n in group], rows, st.abs_mean,
                                                      quant.group_size, quant.has_zero_point, self.grid,
                                                      absmax=st.absmax if fp8_inputs else None)
            for name in group:
                weight = linears[name].weight.float() * s[None, :]
                if self.clip:
                    scaled_rows = rows.float() / s
                    clips[name] = search_clip(weight, scaled_rows.t() @ scaled_rows, quant.group_size,
                                              quant.has_zero_point)
                out[name] = quantize_weight(weight, 4, quant.group_size, quant.has_zero_point, clips.get(name))
                out[name]["prequant_scaling_factor"] = (1.0 / s).float().contiguous()
                if fp8_inputs:
                    out[name]["activation_scaling_factor"] = activation_scale(stats[name].absmax / s)
            if self.clip:
                error = _group_error(group, linears, rows, s, clips, quant)
            log.debug("AWQ %s: alpha %.2f, output error %.4g (round-to-nearest %.4g)", "+".join(group), alpha, error,
                      rtn_error)
            self.gains.append(error / rtn_error if rtn_error > 0 else 1.0)
        return out


def stream_awq(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
               quant: QuantConfig, names: list[str], progress: bool = False, grid: int = DEFAULT_GRID,
               clip: bool = True, kv_cache: KVCacheCalibration | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of a meta-device ``model`` whose float ``weights`` stream in, the
    linears ``names`` AWQ-quantized, calibrated layer by layer on ``token_lists``."""
    stage = AwqStage(quant, grid, clip)
    yield from stream_calibrated(model, weights, token_lists, names, InputStats, stage, progress, kv_cache=kv_cache)
    if stage.gains:
        log.info("AWQ: %d input groups, output error %.1f%% of round-to-nearest's on average%s", len(stage.gains),
                 100 * sum(stage.gains) / len(stage.gains), " (scales and clipping)" if clip else "")


def _group_error(group: list[str], modules: dict[str, nn.Module], rows: torch.Tensor, s: torch.Tensor, clips: dict[str, torch.Tensor],
                 quant: QuantConfig) -> float:
    """Summed squared output error on ``rows`` of the group's linears, scaled by ``s`` and clipped."""
    x = rows.float()
    total = 0.0
    for name in group:
        w = modules[name].weight.float()
        q = dequantize(quantize_weight(w * s, 4, quant.group_size, quant.has_zero_point, clips[name]), 4,
                       quant.group_size)
        total += ((x / s) @ q.t() - x @ w.t()).pow(2).sum().item()
    return total
