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

Layers are quantized in order: each layer's linears are calibrated on the inputs the already
quantized layers before it produce (the model run layer by layer over packed steps), so a
layer also corrects what the earlier ones lost. Within a layer one pass calibrates all its
linears (the MLP's on the attention's float-computed output). ``sequential=False`` calibrates
every layer on the float model instead (one pass over the whole model).

With AWQ's scales (``W4A16_AWQ`` with ``awq_scales``) each layer's linears first get their
per input channel scale ``s`` (``kiln.quantization.awq.search_scale``, on the same inputs),
then GPTQ rounds ``W diag(s)`` against ``diag(1/s) H diag(1/s)``, the Hessian of the inputs
``x / s`` that weight meets; the checkpoint is an ordinary W4A16_AWQ one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from torch import nn
from tqdm import tqdm

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.layers.quantized_matmul import dequantize
from kiln.quantization.awq import input_groups, search_clip, search_scale
from kiln.quantization.calibration import InputStats, prompt_steps, step_kv_caches
from kiln.quantization.gptq import GPTQ_ALGO
from kiln.quantization.weight_only import (check_group_size, codes_4bit, group_params, pack_4bit,
                                           quantizable_modules, quantize_weight)

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


def _quantize_linears(modules: dict[str, nn.Module], hessians: dict[str, HessianAccumulator], quant: QuantConfig,
                      act_order: bool, damp: float, clip_ranges: bool, done: dict[str, dict[str, torch.Tensor]],
                      stats: dict | None = None) -> list[float]:
    """GPTQ each of ``modules`` (their accumulators leave ``hessians``) into ``done`` (name ->
    W4A16 tensors, plus ``prequant_scaling_factor`` 1/s when ``stats`` are given for AWQ's
    scales: then ``W diag(s)`` is quantized against ``diag(1/s) H diag(1/s)``, the Hessian of
    the inputs ``x / s`` it will see). With ``clip_ranges`` each group's range is first searched
    (``awq.search_clip`` against ``H``). Each float weight becomes the weight its tensors stand
    for meanwhile, so later passes see the quantized layer at float speed. Returns each one's
    output error relative to round-to-nearest's (``tr((W - Q) H (W - Q)^T)``: the squared error
    on the calibration rows)."""
    scales = _awq_scales(list(modules), stats, modules, quant) if stats is not None else {}
    ratios = []
    for name, linear in modules.items():
        h = hessians.pop(name).hessian(linear.in_features)  # popped: its hook stops collecting
        weight = linear.weight.detach().float()
        s = scales.get(name)
        w, hw = (weight, h) if s is None else (weight * s, h / (s.double()[:, None] * s.double()[None, :]))
        clip = search_clip(w, hw, quant.group_size, quant.has_zero_point) if clip_ranges else None
        tensors = gptq_quantize_weight(w, hw, quant.group_size, quant.has_zero_point, act_order, damp, clip=clip)
        effective = dequantize(tensors, 4, quant.group_size)
        if s is not None:
            effective = effective / s
            tensors["prequant_scaling_factor"] = (1.0 / s).float().contiguous()
        rtn = dequantize(quantize_weight(weight, 4, quant.group_size, quant.has_zero_point), 4, quant.group_size)
        errors = [_output_error(weight - q, h) for q in (effective, rtn)]
        ratios.append(errors[0] / errors[1] if errors[1] > 0 else 1.0)
        log.debug("GPTQ %s: output error %.4g (round-to-nearest %.4g)", name, *errors)
        linear.weight.data.copy_(effective)
        done[name] = tensors
    return ratios


def _output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr(D H D^T)``: the mean squared output change (times 2) of a weight change ``D`` on the rows of ``H``."""
    d = delta.float()
    return ((d @ hessian.float()) * d).sum().item()


def _stage_of(name: str) -> str:
    """Which part of the model runs linear ``name``: ``pre`` (before the first decoder layer:
    OPT-350m's ``project_in``), a layer index, or ``post`` (``project_out``, ``lm_head``)."""
    if name.startswith("transformer.layers."):
        return name.split(".")[2]
    return "pre" if name.startswith("transformer.project_in") else "post"


@torch.inference_mode()
def gptq_quantize_model(model: nn.Module, quant: QuantConfig, token_lists: list[list[int]], act_order: bool = True,
                        sequential: bool = True, damp: float = DEFAULT_DAMP, awq_scales: bool = False,
                        clip_ranges: bool = True, progress: bool = False) -> QuantConfig | None:
    """Calibrate ``model`` (float, one rank) on ``token_lists`` and GPTQ its linears in place
    (part after part on the quantized parts' outputs, or all on the float model's with
    ``sequential=False``). With ``awq_scales`` (``quant`` a W4A16_AWQ one) each linear first
    gets AWQ's input scales, searched on the same inputs, and GPTQ rounds the scaled weights.
    ``clip_ranges``: each group's range first searched on the output error (see the module doc).
    Returns ``quant`` as the checkpoint must record it (see ``weight_only.quantize_model``);
    None if no linear was chosen."""
    check_gptq_request(quant, model.config.mapping.world_size, quant.quant_algo)
    chosen, excluded = quantizable_modules(model, quant)
    if not chosen:
        return None
    if not token_lists:
        raise ConfigError(f"{GPTQ_ALGO}: no calibration text of 2 tokens or more (--calib_dataset)")
    modules = dict(chosen)
    hessians = {name: HessianAccumulator() for name in modules}
    stats = {name: InputStats() for name in modules} if awq_scales else None

    def collect(name: str, x: torch.Tensor) -> None:
        if name in hessians:  # not yet quantized
            hessians[name].add(x)
            if stats is not None:
                stats[name].observe(x)

    handles = [modules[name].register_forward_pre_hook(lambda m, args, name=name: collect(name, args[0]))
               for name in modules]
    steps = prompt_steps(token_lists)
    caches = step_kv_caches(model, steps)
    t = model.transformer

    def post(step, h: torch.Tensor) -> None:  # the lm_head's input, without computing [tokens, vocab] logits
        x = t.finish(h)
        if "lm_head" in hessians:
            collect("lm_head", x)

    # Each stage: (name, run(step, its input) -> its output); linears are quantized stage by stage.
    stages = [("pre", lambda step, _: model.first_layer_input(step.input_ids, step.positions))]
    stages += [(index, lambda step, h, layer=layer, cache=cache: layer(h, step.positions, step.metadata, cache))
               for (index, layer), cache in zip(t.layers.items(), caches)]
    stages.append(("post", post))
    ratios: list[float] = []
    done: dict[str, dict[str, torch.Tensor]] = {}
    try:
        if not sequential:  # one float pass gives every Hessian
            for step in tqdm(steps, desc="calibrating", unit="step", disable=not progress):
                h = None
                for _, run in stages:
                    h = run(step, h)
            ratios = _quantize_linears(modules, hessians, quant, act_order, damp, clip_ranges, done, stats)
        else:
            hidden = [None] * len(steps)
            for stage, run in tqdm(stages, desc="GPTQ", unit="stage", disable=not progress):
                mine = {n: m for n, m in modules.items() if _stage_of(n) == stage}
                if mine:  # a pass for the Hessians, then the linears quantized, then their outputs
                    for step, h in zip(steps, hidden):
                        run(step, h)
                    ratios += _quantize_linears(mine, hessians, quant, act_order, damp, clip_ranges, done, stats)
                if stage != "post":
                    hidden = [run(step, h) for step, h in zip(steps, hidden)]
    finally:
        for handle in handles:
            handle.remove()
    for name, tensors in done.items():
        prequant = tensors.pop("prequant_scaling_factor", None)
        modules[name].use_weight_only(4, quant.group_size, quant.has_zero_point, tensors)
        if prequant is not None:
            modules[name].use_prequant_scale(prequant)
    log.info("GPTQ%s: %d linears, output error %.1f%% of round-to-nearest's on average (calibration rows)",
             " with AWQ scales" if awq_scales else "", len(ratios), 100 * sum(ratios) / len(ratios))
    return dataclasses.replace(quant, exclude_modules=excluded, pre_quant_scale=awq_scales)
