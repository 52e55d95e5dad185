"""The calibrated algorithms behind one door: which linears each quantizes, what its checkpoint
records, and its layer-by-layer calibration (``kiln.quantization.sequential``) for a streamed
convert or a model in memory; and KV cache scales calibrated in the same stream.

AWQ (``W4A16_AWQ``, ``W4A8_AWQ``; GPTQ-rounded with ``awq_gptq``), GPTQ (``W4A16_GPTQ``),
SmoothQuant (``W8A8_SQ_PER_CHANNEL``), ``FP8`` and ``W4A16_IMATRIX`` all run the calibration
prompts through the float model a stage at a time, so ``kiln convert`` holds one decoder layer
of any of them, never the model.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch
from torch import nn

from kiln.config import QuantConfig
from kiln.config.quant_algos import ALGOS
from kiln.errors import ConfigError
from kiln.quantization.awq import AWQ_ALGO, AWQ_ALGOS, stream_awq
from kiln.quantization.fp8 import stream_fp8
from kiln.quantization.gptq import GPTQ_ALGO
from kiln.quantization.gptq_quantize import stream_gptq
from kiln.quantization.imatrix import IMATRIX_ALGO, recorded_config, stream_imatrix
from kiln.quantization.sequential import KVCacheCalibration, per_linear, quantize_in_memory, stream_calibrated
from kiln.quantization.smoothquant import DEFAULT_ALPHA, SEARCH_ALPHA, stream_smoothquant
from kiln.quantization.weight_only import (DEFAULT_EXCLUDED, FP8_ALGO, PREQUANT_ALGOS, SMOOTHQUANT_ALGO,
                                           WEIGHT_ONLY_ALGOS, quantizable_modules, quantize_weight, quantized_modules,
                                           untie_lm_head_for)

CALIBRATED_ALGOS = tuple(name for name, algo in ALGOS.items() if algo.calibrated)


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """The calibrated algorithms' own settings (``kiln convert --help`` explains each)."""

    smoothquant_alpha: float | str = DEFAULT_ALPHA  # a number in [0, 1], or SEARCH_ALPHA
    gptq_act_order: bool = True
    gptq_sequential: bool = True
    awq_gptq: bool = False  # W4A16_AWQ's scales, then GPTQ's rounding


def quantization_plan(model: nn.Module, quant: QuantConfig) -> tuple[list[str], QuantConfig]:
    """The linears of ``model`` (any device) that ``quant`` quantizes (calibrated or rounded to
    nearest), and the quantization config its checkpoint records: ``exclude_modules`` names every
    linear left in float. Raises a ConfigError when none is chosen."""
    algo = quant.quant_algo
    if algo == SMOOTHQUANT_ALGO:  # W8A8's kernels take any shape
        names = [name for name, _ in quantized_modules(model, quant)]
        excluded = list(DEFAULT_EXCLUDED if quant.exclude_modules is None else quant.exclude_modules)
        recorded = dataclasses.replace(quant, exclude_modules=excluded)
    else:
        chosen, excluded = quantizable_modules(model, quant)
        names = [name for name, _ in chosen]
        recorded = (recorded_config(quant, names) if algo == IMATRIX_ALGO else
                    dataclasses.replace(quant, exclude_modules=excluded, pre_quant_scale=algo in PREQUANT_ALGOS))
    if not names:
        raise ConfigError(f"--quant_algo {algo} found no linear layer to quantize")
    return names, recorded


def stream_calibration(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
                       quant: QuantConfig, names: list[str], options: CalibrationOptions = CalibrationOptions(),
                       progress: bool = False, kv_cache: KVCacheCalibration | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of a meta-device ``model`` whose float ``weights`` stream in (in
    parameter order), the linears ``names`` quantized by ``quant``'s algorithm, calibrated layer
    by layer on ``token_lists``; with ``kv_cache`` each layer's KV cache scales too (then a
    round-to-nearest ``quant``, or none, streams here as well)."""
    algo = quant.quant_algo
    if algo == AWQ_ALGO and options.awq_gptq or algo == GPTQ_ALGO:
        return stream_gptq(model, weights, token_lists, quant, names, options.gptq_act_order,
                           options.gptq_sequential, awq_scales=algo == AWQ_ALGO, progress=progress, kv_cache=kv_cache)
    if algo in AWQ_ALGOS:
        return stream_awq(model, weights, token_lists, quant, names, progress, kv_cache=kv_cache)
    if algo == IMATRIX_ALGO:
        return stream_imatrix(model, weights, token_lists, quant, names, progress, kv_cache)
    if algo == SMOOTHQUANT_ALGO:
        alpha = None if options.smoothquant_alpha == SEARCH_ALPHA else options.smoothquant_alpha
        return stream_smoothquant(model, weights, token_lists, quant, alpha, progress, kv_cache)
    if algo == FP8_ALGO:
        return stream_fp8(model, weights, token_lists, names, progress, kv_cache)
    if kv_cache is None or algo in CALIBRATED_ALGOS:
        raise ConfigError(f"--quant_algo {algo} is not calibrated; kiln calibrates {list(CALIBRATED_ALGOS)}")
    bits = WEIGHT_ONLY_ALGOS.get(algo)
    return stream_calibrated(model, weights, token_lists, names, None, per_linear(
        lambda name, linear, _: quantize_weight(linear.weight.float(), bits, quant.group_size, quant.has_zero_point)),
        progress, kv_cache=kv_cache)


def calibrate_model(model: nn.Module, quant: QuantConfig, token_lists: list[list[int]],
                    options: CalibrationOptions = CalibrationOptions(), progress: bool = False) -> QuantConfig:
    """Quantize a float ``model`` in memory (one rank) by ``quant``'s calibrated algorithm, as a
    streamed convert would; returns the config to record (a quantized lm_head sharing the
    embedding table gets its own copy first)."""
    if model.config.mapping.world_size != 1:
        raise ConfigError(f"--quant_algo {quant.quant_algo} calibrates the whole model in one process: convert "
                          "with --tp_size 1 --pp_size 1")
    untie_lm_head_for(model, quant)
    names, recorded = quantization_plan(model, quant)
    quantize_in_memory(model, recorded, lambda twin, weights: stream_calibration(twin, weights, token_lists, quant,
                                                                                 names, options, progress))
    return recorded
