"""GPTQ quantization at convert time (``W4A16_GPTQ``): 4-bit weights that compensate for their
own rounding, calibrated on text. (``kiln.quantization.gptq`` imports GPTQ checkpoints made
elsewhere; both end in the same W4A16 layout, so the same engines and kernels run them.)

For a linear with weight ``W`` ``[out, in]`` and calibration inputs ``X`` ``[n, in]``, GPTQ
minimises ``||X W^T - X Q^T||^2`` row by row, whose curvature is ``H = 2 X^T X``. Columns are
quantized one at a time; each column's rounding error, divided by the pivot of the Cholesky
factor ``U`` of ``H^-1`` (upper triangular), is spread over the columns not yet quantized
along that row of ``U``: the optimal correction for the columns that remain. Updates inside a
block of 128 columns are applied at once; the rest of the matrix gets the block's errors in
one matrix product ("lazy batch" updates). Before the inversion ``H`` gets a dampening of
``damp * mean(diag H)`` on its diagonal, and columns never seen active are left to plain
rounding (their diagonal set to 1).

Each group's scale and zero point (``weight_only.group_params``, the same as round-to-nearest)
are taken when quantization reaches the group's first column, from the weights as updated so
far. With ``act_order`` (the default) columns are quantized in order of decreasing ``diag H``
(the most active inputs first, while there is most freedom left to compensate); kiln's groups
stay contiguous runs of inputs, so their parameters are fixed beforehand from the original
weights ("static groups") and only the order of quantization changes. On SmolLM2 in-order
GPTQ hurts the attention's qkv (whose few loud input channels, quantized late, gather the
compensation and stretch their groups) and act-order avoids that.

With a diagonal ``H`` (uncorrelated inputs) no error moves to another column and the result
is round-to-nearest exactly.

Before the columns are rounded, each group's range is clipped by AWQ's search
(``awq.search_clip``: per output channel and group the share of ``max|w|`` kept, 1.0 down to
0.5, minimising the output error ``d^T H d`` of the group's rounding; kept where it lowers the
channel's whole error), the ranges taken from the float weights. On SmolLM2 this alone takes
GPTQ's perplexity loss at group size 64 from +15% to +10% (float-calibrated, in a quick check).

Layers are quantized in order as their weights stream in (``kiln.quantization.sequential``):
each layer's linears are calibrated on the inputs the already quantized layers before it
produce, so a layer also corrects what the earlier ones lost. Within a layer one pass
calibrates all its linears (the MLP's on the attention's float-computed output), and a second
runs it with its quantized weights for the next. ``sequential=False`` calibrates every layer on
the float model's inputs instead.

With AWQ's scales (``W4A16_AWQ`` with ``awq_scales``) each layer's linears first get their
per input channel scale ``s`` (``kiln.quantization.awq.search_scale``, on the same inputs),
then GPTQ rounds ``W diag(s)`` against ``diag(1/s) H diag(1/s)``, the Hessian of the inputs
``x / s`` that weight meets; the checkpoint is an ordinary W4A16_AWQ one.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.layers.quantized_matmul import dequantize
from kiln.quantization.awq import input_groups, search_clip, search_scale
from kiln.quantization.calibration import InputStats
from kiln.quantization.sequential import KVCacheCalibration, stream_calibrated
from kiln.quantization.weight_only import check_group_size, codes_4bit, group_params, pack_4bit, quantize_weight

log = logging.getLogger(__name__)

BLOCK_SIZE = 128  # columns per lazy update (rounded up to whole groups, so groups never straddle blocks)
DEFAULT_DAMP = 0.01


class HessianAccumulator:
    """``X^T X`` of the rows a linear sees, and how many there were."""

    def __init__(self) -> None:
        self.xtx: torch.Tensor | None = None
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if self.xtx is None:
            self.xtx = torch.zeros(x.shape[1], x.shape[1])
        self.xtx.addmm_(x.t(), x)  # float32 sums, as GPTQ's usual; inverted in float64
        self.rows += x.shape[0]

    def hessian(self, in_features: int) -> torch.Tensor:
        """``2 X^T X / n`` ``[in_features, in_features]`` (the scale does not change GPTQ's result;
        the mean keeps it readable); zeros if no row was seen."""
        if self.xtx is None:
            return torch.zeros(in_features, in_features, dtype=torch.float64)
        return self.xtx.double() * (2.0 / self.rows)


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor ``U`` (float64) of ``(H + damp * mean(diag H) * I)^-1``."""
    h = hessian.double().clone()
    diag = h.diagonal()
    dead = diag <= 0
    h[dead, :] = 0.0  # an input never active: no curvature to correct through
    h[:, dead] = 0.0
    diag[dead] = 1.0
    diag += damp * diag.mean()
    try:
        lower = torch.linalg.cholesky(h)
    except torch.linalg.LinAlgError:
        raise ConfigError(f"GPTQ: the calibration Hessian is not positive definite even with damp {damp}; "
                          "use more calibration text") from None
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)


def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, has_zero_point: bool,
                         act_order: bool = False, damp: float = DEFAULT_DAMP, block_size: int = BLOCK_SIZE,
                         clip: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """W4A16 tensors (``weight_only.quantize_weight``'s layout) of float ``weight`` ``[out, in]``
    by GPTQ against ``hessian`` ``[in, in]`` (see the module doc); ``clip`` ``[out, in / group_size]``:
    each group's range ratio (``weight_only.group_params``)."""
    w = weight.detach().float().clone()
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"GPTQ: group_size {group_size} must divide in_features {in_features}")
    if block_size % group_size:  # groups must not straddle blocks: whole groups per block
        block_size = group_size * -(-block_size // group_size)
    num_groups = in_features // group_size
    if act_order:
        order = torch.argsort(hessian.diagonal(), descending=True, stable=True)
        # Static groups: every group's parameters from the original weights, before any update.
        scale, zero = group_params(w.view(out_features, num_groups, group_size), has_zero_point, clip)
        hessian = hessian[order][:, order]
        w = w[:, order]
    else:
        order = torch.arange(in_features)
        scale = torch.empty(out_features, num_groups)
        zero = torch.empty(out_features, num_groups)
    group_of = order // group_size  # the group of each column in quantization order
    codes = torch.empty(out_features, in_features)
    with _one_thread():
        u = _inverse_cholesky(hessian, damp).float()
        _quantize_columns(w, u, codes, scale, zero, group_of, group_size, has_zero_point, act_order, block_size, clip)
    if act_order:
        codes = codes[:, torch.argsort(order)]
    return pack_4bit(codes, scale, zero, has_zero_point)


@contextlib.contextmanager
def _one_thread():
    """Run GPTQ's many small ops on one thread: with two, the threads' handoffs cost more than
    the ops (a 1536 x 576 weight: 0.07 s against 5-7 s on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _quantize_columns(w: torch.Tensor, u: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      group_of: torch.Tensor, group_size: int, has_zero_point: bool, act_order: bool,
                      block_size: int, clip: torch.Tensor | None) -> None:
    """GPTQ's loop over the columns of ``w`` ``[out, in]`` (in quantization order, updated in
    place), writing ``codes`` and, unless ``act_order`` fixed them, each group's ``scale``/``zero``."""
    in_features = w.shape[1]
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        block = w[:, start:end].clone()  # [out, b]: updated column by column
        errors = torch.empty_like(block)
        u_block = u[start:end, start:end]
        for i in range(end - start):
            column = start + i
            g = int(group_of[column])
            if not act_order and column % group_size == 0:  # a group starts: its parameters from the updated weights
                s, z = group_params(block[:, i:i + group_size], has_zero_point, None if clip is None else clip[:, g])
                scale[:, g], zero[:, g] = s, z
            q = codes_4bit(block[:, i], scale[:, g], zero[:, g])
            codes[:, column] = q
            error = (block[:, i] - (q - zero[:, g]) * scale[:, g]) / u_block[i, i]
            block[:, i:].sub_(torch.outer(error, u_block[i, i:]))
            errors[:, i] = error
        w[:, end:].sub_(errors @ u[start:end, end:])


def check_gptq_request(quant: QuantConfig, world_size: int, where: str) -> None:
    """ConfigErrors for GPTQ settings kiln cannot honour, raised before any calibration."""
    check_group_size(quant, where)
    if world_size != 1:
        raise ConfigError(f"{where}: --quant_algo {quant.quant_algo} with GPTQ calibrates the whole float model; "
                          f"convert with --tp_size 1 --pp_size 1 (got {world_size} ranks)")


def _awq_scales(names: list[str], stats: dict, modules: dict[str, nn.Module], quant: QuantConfig) -> dict[str, torch.Tensor]:
    """AWQ's per input channel scale ``s`` of each linear, searched per group sharing an input."""
    scales = {}
    for group in input_groups(names, stats):
        st = stats[group[0]]
        s, *_ = search_scale([modules[n].weight for n in group], st.rows_sample(), st.abs_mean, quant.group_size,
                             quant.has_zero_point)
        scales.update((n, s) for n in group)
    return scales


class _Observer:
    """A linear's Hessian and, for AWQ's scales, its input statistics."""

    def __init__(self, awq_scales: bool):
        self.hessian = HessianAccumulator()
        self.inputs = InputStats() if awq_scales else None

    def observe(self, x: torch.Tensor) -> None:
        self.hessian.add(x)
        if self.inputs is not None:
            self.inputs.observe(x)


class GptqStage:
    """GPTQ's ``QuantizeStage`` (``kiln.quantization.sequential``): each of a stage's linears
    rounded by GPTQ against its Hessian (after AWQ's scales ``s`` when asked: then ``W diag(s)``
    is rounded against ``diag(1/s) H diag(1/s)``, the Hessian of the inputs ``x / s`` it meets, and
    the tensors carry ``prequant_scaling_factor`` 1/s). With ``clip_ranges`` each group's range is
    first searched (``awq.search_clip`` against ``H``). Each float weight is replaced by the weight
    its tensors stand for, so later stages calibrate on the quantized ones' outputs. Keeps each
    linear's output error relative to round-to-nearest's (``tr((W - Q) H (W - Q)^T)``: the
    squared error on the calibration rows)."""

    def __init__(self, quant: QuantConfig, act_order: bool, damp: float, clip_ranges: bool, awq_scales: bool):
        self.quant, self.act_order, self.damp, self.clip_ranges = quant, act_order, damp, clip_ranges
        self.awq_scales = awq_scales
        self.ratios: list[float] = []

    def __call__(self, linears: dict[str, nn.Module], observers: dict[str, _Observer]) -> dict[str, dict[str, torch.Tensor]]:
        quant = self.quant
        scales = (_awq_scales(list(linears), {n: o.inputs for n, o in observers.items()}, linears, quant)
                  if self.awq_scales else {})
        out = {}
        for name, linear in linears.items():
            h = observers[name].hessian.hessian(linear.in_features)
            weight = linear.weight.detach().float()
            s = scales.get(name)
            w, hw = (weight, h) if s is None else (weight * s, h / (s.double()[:, None] * s.double()[None, :]))
            clip = search_clip(w, hw, quant.group_size, quant.has_zero_point) if self.clip_ranges else None
            tensors = gptq_quantize_weight(w, hw, quant.group_size, quant.has_zero_point, self.act_order, self.damp,
                                           clip=clip)
            effective = dequantize(tensors, 4, quant.group_size)
            if s is not None:
                effective = effective / s
                tensors["prequant_scaling_factor"] = (1.0 / s).float().contiguous()
            rtn = dequantize(quantize_weight(weight, 4, quant.group_size, quant.has_zero_point), 4, quant.group_size)
            errors = [_output_error(weight - q, h) for q in (effective, rtn)]
            self.ratios.append(errors[0] / errors[1] if errors[1] > 0 else 1.0)
            log.debug("GPTQ %s: output error %.4g (round-to-nearest %.4g)", name, *errors)
            linear.weight = nn.Parameter(effective.to(linear.weight.dtype), requires_grad=False)
            out[name] = tensors
        return out


def _output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr(D H D^T)``: the mean squared output change (times 2) of a weight change ``D`` on the rows of ``H``."""
    d = delta.float()
    return ((d @ hessian.float()) * d).sum().item()


def stream_gptq(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
                quant: QuantConfig, names: list[str], act_order: bool = True, sequential: bool = True,
                damp: float = DEFAULT_DAMP, awq_scales: bool = False, clip_ranges: bool = True,
                progress: bool = False, kv_cache: KVCacheCalibration | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of a meta-device ``model`` whose float ``weights`` stream in, the
    linears ``names`` rounded by GPTQ, calibrated on ``token_lists`` stage by stage: each on the
    outputs of the stages before it as quantized, or all on the float model's with
    ``sequential=False``. ``awq_scales`` (``quant`` a W4A16_AWQ one): each linear first gets
    AWQ's input scales, searched on the same inputs. ``clip_ranges``: each group's range
    searched on the output error first (see the module doc)."""
    stage = GptqStage(quant, act_order, damp, clip_ranges, awq_scales)
    yield from stream_calibrated(model, weights, token_lists, names, lambda: _Observer(awq_scales), stage, progress,
                                 quantized_outputs=sequential, kv_cache=kv_cache)
    if stage.ratios:
        log.info("GPTQ%s: %d linears, output error %.1f%% of round-to-nearest's on average (calibration rows)",
                 " with AWQ scales" if awq_scales else "", len(stage.ratios),
                 100 * sum(stage.ratios) / len(stage.ratios))
