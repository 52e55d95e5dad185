"""SmoothQuant W8A8 (``W8A8_SQ_PER_CHANNEL``): int8 weights with one scale per output channel,
int8 activations with one scale per token computed at run time, and smoothing factors from
calibration that move activation outliers into the weights.

For linears sharing one input (the fused ``qkv``; the gated MLP's ``fc`` and ``gate``;
``dense``; ``proj``), input channel ``j`` gets ``s_j = max|x_j|^alpha / max|W_:,j|^(1-alpha)``
(``max|x_j|`` over the calibration tokens, ``max|W_:,j|`` over the group's weights). Unless one
``alpha`` is given, each group searches it over ``0, 0.05, ..., 1`` for the smallest squared
error of its int8 outputs (per-token activations included) on a sample of calibration rows:
how much to move depends on how a layer's outliers and weights look. Since
``x W^T = (x / s)(W diag(s))^T``, the weight ``W diag(s)`` is quantized and the input is
multiplied by ``1 / s`` at run time. Checkpoint tensors of such a linear (names from
reference 002):

* ``weight``: int8 codes ``[out, in]`` of ``W diag(s)``, -127..127;
* ``weights_scaling_factor``: float32 ``[out]``, ``W diag(s) ~= weight * scale[:, None]``;
* ``prequant_scaling_factor``: float32 ``[in]``, ``1 / s`` (``fc`` and ``gate`` hold equal ones,
  the engine's fused ``fc`` one copy).

``1 / s`` stays an explicit factor instead of being folded into the preceding norm's weight:
every linear then works alike (``dense`` and ``proj`` have no norm in front of them, and a
norm feeding both attention and MLP could not take two factors). No static
``activation_scaling_factor`` is stored: activations are scaled per token at run time.

At run time ``x' = x * prequant``, ``a_t = max|x'_t| / 127``, ``q = round(x' / a_t)``;
``y = (q @ codes^T) * a_t * scale (+ bias)`` with the integer product in int32 through
``torch._int_mm`` (exact emulation where torch lacks it, see :func:`int8_matmul`).
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.layers.mlp import GatedMLP
from kiln.layers.quantized_matmul import w8a8_linear
from kiln.quantization.calibration import InputStats
from kiln.quantization.sequential import KVCacheCalibration, stream_calibrated
from kiln.quantization.weight_only import SMOOTHQUANT_ALGO, quantized_modules

log = logging.getLogger(__name__)

ALPHA_GRID = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1
# The default migration strength: on SmolLM2's held-out text 0.5 scored best (perplexity +1.32%
# vs float32; 0.25: +3.28%, 0.75: +1.61%, the per-group search over ALPHA_GRID: +1.51%, since
# the smallest per-layer output error is not the best model; docs/benchmark-log.md).
DEFAULT_ALPHA = 0.5
SEARCH_ALPHA = "search"  # smoothquant_alpha value asking for the per-group search
_EPS = 1e-5  # floor of both maxima: an all-zero channel gets a finite factor


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s`` (float32 ``[in]``) for linears of weights ``[out_i, in]`` sharing inputs whose
    per-channel max magnitude is ``act_absmax``; ``alpha`` in [0, 1] is the share of the
    activation range moved into the weights."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"--smoothquant_alpha must lie in [0, 1], got {alpha}")
    w_absmax = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = act_absmax.float().clamp(min=_EPS) ** alpha / w_absmax.clamp(min=_EPS) ** (1.0 - alpha)
    return s.clamp(min=_EPS)


def quantize_w8a8_weight(weight: torch.Tensor, smoother: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (see the module doc) of float ``weight`` ``[out, in]`` smoothed by ``s``."""
    w = weight.detach().float() * smoother.float()[None, :]
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"weight": codes, "weights_scaling_factor": scale,
            "prequant_scaling_factor": (1.0 / smoother.float()).contiguous()}


def search_alpha(weights: list[torch.Tensor], rows: torch.Tensor, act_absmax: torch.Tensor,
                 alphas: tuple[float, ...] = ALPHA_GRID) -> tuple[torch.Tensor, float, float]:
    """The smoothing factors of linears ``weights`` (``[out_i, in]``) sharing inputs ``rows``
    ``[n, in]`` (per-channel max ``act_absmax`` over all calibration tokens): the ``alpha`` of
    ``alphas`` whose W8A8 outputs have the smallest summed squared error against the float
    ones. Returns ``(s, alpha, error)``."""
    x = rows.float()
    references = [x @ w.detach().float().t() for w in weights]
    best = None
    for alpha in alphas:
        s = smoothing_factors(act_absmax, weights, alpha)
        error = 0.0
        for w, reference in zip(weights, references):
            t = quantize_w8a8_weight(w, s)
            y = w8a8_linear(x, t["weight"], t["weights_scaling_factor"], t["prequant_scaling_factor"], None)
            error += (y - reference).pow(2).sum().item()
        if best is None or error < best[2]:
            best = (s, alpha, error)
    return best


def smoothing_groups(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """``modules`` grouped by shared input: a (checkpoint-layout) gated MLP's ``fc`` and ``gate``
    form one group, every other linear its own."""
    chosen = {name for name, _ in modules}
    groups, done = [], set()
    for name, module in model.named_modules():
        if isinstance(module, GatedMLP) and not module.fused:
            members = [f"{name}.fc", f"{name}.gate"]
            present = [m for m in members if m in chosen]
            if len(present) == 1:  # one excluded: a shared factor would not suit both
                raise ConfigError(f"{present[0]}: fc and gate share their input, so --exclude_modules must "
                                  "exclude both or neither for SmoothQuant")
            if present:
                groups.append([(m, model.get_submodule(m)) for m in present])
                done.update(present)
    groups += [[(name, module)] for name, module in modules if name not in done]
    return groups


def stream_smoothquant(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
                       quant: QuantConfig, alpha: float | None = None, progress: bool = False,
                       kv_cache: KVCacheCalibration | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of a meta-device ``model`` whose float ``weights`` stream in, its
    linears smoothed (with ``alpha``, or each group's searched one when None) and quantized,
    calibrated layer by layer on ``token_lists``."""
    groups = smoothing_groups(model, quantized_modules(model, quant))
    group_of = {name: [n for n, _ in group] for group in groups for name, _ in group}
    chosen_alphas: list[float] = []

    def quantize(linears: dict[str, nn.Module], stats: dict[str, InputStats]) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name in linears:
            if name in out:
                continue
            group = group_of[name]  # its members see the same input: the first one's statistics
            st, weights = stats[group[0]], [linears[n].weight for n in group]
            if alpha is None:
                s, best, error = search_alpha(weights, st.rows_sample(), st.absmax)
                log.debug("SmoothQuant %s: alpha %.2f, output error %.4g", "+".join(group), best, error)
            else:
                s, best = smoothing_factors(st.absmax, weights, alpha), alpha
            chosen_alphas.append(best)
            out.update((n, quantize_w8a8_weight(linears[n].weight, s)) for n in group)
        return out

    # The row sample only feeds the alpha search.
    make = InputStats if alpha is None else lambda: InputStats(max_sample=0)
    yield from stream_calibrated(model, weights, token_lists, list(group_of), make, quantize, progress,
                                 kv_cache=kv_cache)
    if chosen_alphas:
        log.info("%s: %d linears smoothed (alpha %s) and quantized", SMOOTHQUANT_ALGO, len(group_of),
                 f"{alpha:.2f}" if alpha is not None else f"searched: {min(chosen_alphas):.2f}.."
                 f"{max(chosen_alphas):.2f}, mean {sum(chosen_alphas) / len(chosen_alphas):.2f}")
