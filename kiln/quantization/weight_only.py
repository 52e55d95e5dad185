"""Weight-only quantization: W8A16 (int8, one scale per output channel) and W4A16 (4-bit
codes, a scale and optionally a zero point per group of ``group_size`` input features),
by round-to-nearest; and the layout of a ``MIXED_PRECISION`` checkpoint, whose linears each
have their own format (``QuantConfig.quantized_layers``; made by ``kiln.quantization.gguf``).

Checkpoint tensors of a quantized linear (names from reference 002):

* ``weight``: int8 codes ``[out, in]`` (W8A16), or 4-bit codes two a byte ``[out, in / 2]``
  uint8, feature ``2j`` in the low nibble of byte ``j`` (W4A16);
* ``weights_scaling_factor``: float32 ``[out]`` (W8A16) or ``[out, in / group_size]`` (W4A16, and
  a mixed-precision layer's W8A16 with a group size; values float16 can hold: an engine stores
  them as float16);
* ``zero`` (W4A16 with ``has_zero_point``): float32 ``[out, in / group_size]``, in code units;
* ``weights_offset`` (a mixed-precision layer with ``has_offset``): float32 ``[out, in /
  group_size]``.

``w = code * scale`` (W8A16, codes -127..127); ``w = (code - zero) * scale`` (W4A16, codes
0..15; zero 8 when not stored); ``w = code * scale + offset`` with an offset. Scales stay float32
(bf16 scales would add more error than 8-bit rounding; group scales are float16 values). An
engine keeps the same tensors laid out for the kernels (``kiln.kernels.quant_pack`` and
``quant_pack_scales``, done by ``kiln build``): codes in tile / chunk order, group scales and
offsets as float16 in block order, a zero point as its offset ``-zero * scale``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging

import torch
from torch import nn

from kiln import kernels
from kiln.config import LayerQuant, QuantConfig
from kiln.config.quant_algos import ALGOS, MIXED_PRECISION
from kiln.errors import ConfigError
from kiln.layers.linear import Linear
from kiln.layers.expert_linear import ExpertLinear

log = logging.getLogger(__name__)

# W4A16_GPTQ: W4A16's layout, imported from a GPTQ checkpoint (kiln.quantization.gptq) or
# calibrated at convert time (kiln.quantization.gptq_quantize). W4A16_AWQ: W4A16's layout of W diag(s) plus a
# ``prequant_scaling_factor`` 1/s per linear (kiln.quantization.awq, calibrated at convert time).
# W4A8_AWQ: W4A16_AWQ's tensors plus a static ``activation_scaling_factor``: the input is
# rounded to FP8 e4m3 before the 4-bit matmul (emulated, kiln.quantization.fp8). All of them
# hold integer codes in this module's layout.
# Views of kiln.config.quant_algos.ALGOS, the one table of algorithms.
WEIGHT_ONLY_ALGOS = {name: a.weight_bits for name, a in ALGOS.items() if a.weight_only}
ROUND_TO_NEAREST_ALGOS = tuple(name for name, a in ALGOS.items() if not a.calibrated)
PREQUANT_ALGOS = tuple(name for name, a in ALGOS.items() if a.prequant)
DEFAULT_EXCLUDED = ("lm_head",)
SMOOTHQUANT_ALGO = "W8A8_SQ_PER_CHANNEL"  # int8 activations too: kiln.quantization.smoothquant
FP8_ALGO = "FP8"  # e4m3 weights and activations, per-tensor scales: kiln.quantization.fp8
ACTIVATION_SCALE_ALGOS = tuple(name for name, a in ALGOS.items() if a.activation_scale)
IMPLEMENTED_ALGOS = (*ALGOS, MIXED_PRECISION)
# Those experts (ExpertLinear) are quantized by as well: the weight-only formats without calibration.
EXPERT_ALGOS = (*(name for name in WEIGHT_ONLY_ALGOS if name in ROUND_TO_NEAREST_ALGOS), MIXED_PRECISION)
# their kernels take bf16
BF16_ENGINE_ALGOS = (*(name for name, a in ALGOS.items() if a.bf16_engine), MIXED_PRECISION)


def fp16_exact(scale: torch.Tensor) -> torch.Tensor:
    """4-bit group scales rounded up to float16 values (kept float32): engines store them as
    float16 (``kernels.quant_pack_scales``), so codes computed against these lose nothing at
    build; rounding up keeps the group's range within the 16 codes, so round-to-nearest stays
    within half a step. Floored at float16's smallest normal (an all-zero group keeps a usable
    scale)."""
    scale = scale.float().clamp(min=2.0 ** -14)
    half = scale.to(torch.float16)
    up = torch.nextafter(half, torch.full_like(half, float("inf")))
    return torch.where(half.float() < scale, up, half).float()


def group_params(groups: torch.Tensor, has_zero_point: bool,
                 clip: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit ``(scale, zero)`` of weight groups ``[..., group_size]`` (each ``[...]``, float32):
    the group's range over 16 codes with a zero point, else ``max|w| / 7`` around code 8.
    ``clip`` (broadcasting to ``[...]``, in (0, 1]) first clips the group to ``+-clip * max|w|``:
    values beyond round to the end codes (AWQ's clipping search)."""
    if has_zero_point:
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        if clip is not None:
            limit = groups.abs().amax(dim=-1) * clip
            low, high = torch.maximum(low, -limit), torch.minimum(high, limit)
        scale = fp16_exact((high - low) / 15)
        return scale, torch.round(-low / scale).clamp(0, 15)
    absmax = groups.abs().amax(dim=-1)
    if clip is not None:
        absmax = absmax * clip
    scale = fp16_exact(absmax / 7)
    return scale, torch.full_like(scale, 8.0)


def codes_4bit(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (float) of ``w`` with elementwise-broadcast ``scale``/``zero``: ``round(w / scale + zero)``."""
    return torch.round(w / scale + zero).clamp(0, 15)


def pack_4bit(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              has_zero_point: bool) -> dict[str, torch.Tensor]:
    """W4A16 checkpoint tensors from codes ``[out, in]`` (0..15) and group ``scale``/``zero``
    ``[out, in / group_size]``: feature ``2j`` in the low nibble of byte ``j``."""
    codes = codes.to(torch.uint8)
    out = {"weight": (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(),
           "weights_scaling_factor": scale.float().contiguous()}
    if has_zero_point:
        out["zero"] = zero.float().contiguous()
    return out


def quantize_weight(weight: torch.Tensor, bits: int, group_size: int = 64, has_zero_point: bool = False,
                    clip: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Round-to-nearest codes and scales of a float ``weight`` ``[out, in]`` (see the module doc);
    4-bit ``clip`` ``[out, in / group_size]``: each group's range ratio (``group_params``).
    Stacked experts ``[E, out, in]`` give each tensor stacked the same way (expert by expert)."""
    if weight.dim() == 3:
        parts = [quantize_weight(w, bits, group_size, has_zero_point) for w in weight]
        return {name: torch.stack([part[name] for part in parts]) for name in parts[0]}
    w = weight.detach().float()
    out_features, in_features = w.shape
    if bits == 8:
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return {"weight": codes, "weights_scaling_factor": scale}
    if bits != 4:
        raise ValueError(f"weight-only quantization has 8 or 4 bits, not {bits}")
    if in_features % group_size or in_features % 2:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
    g = w.view(out_features, in_features // group_size, group_size)
    scale, zero = group_params(g, has_zero_point, clip)
    codes = codes_4bit(g, scale[..., None], zero[..., None]).view(out_features, -1)
    return pack_4bit(codes, scale, zero, has_zero_point)


def _checkpoint_names(name: str, module: nn.Module) -> list[str]:
    # An engine's fused linear (the gated MLP's fused_fc) stands for its checkpoint parts: it is
    # excluded (or formatted) as they are, so a checkpoint and the engine built from it agree.
    parent = name.rpartition(".")[0]
    return [f"{parent}.{part}" if parent else part for part in getattr(module, "fused_from", ())] or [name]


def _excluded(name: str, module: nn.Module, patterns) -> bool:
    names = _checkpoint_names(name, module)
    return any(fnmatch.fnmatch(n, p) or fnmatch.fnmatch(n.rsplit(".", 1)[-1], p) for n in names for p in patterns)


def layer_format(name: str, module: nn.Module, quant: QuantConfig) -> LayerQuant | None:
    """A ``MIXED_PRECISION`` linear's format (None: left float); a fused engine linear's parts
    must share one (the converter gives them the finer of theirs)."""
    formats = {(quant.quantized_layers or {}).get(n) for n in _checkpoint_names(name, module)}
    if len(formats) > 1:
        raise ConfigError(f"{name}: the linears fused into it have different formats {sorted(map(str, formats))}")
    return formats.pop()


def untie_lm_head_for(model: nn.Module, quant: QuantConfig) -> None:
    """Give a model whose ``lm_head`` shares the embedding table a copy of its own when ``quant``
    quantizes ``lm_head`` (``exclude_modules`` does not name it): the lookup keeps the float
    table, the head gets codes. The config then records ``share_embedding_table`` false."""
    if not untie_needed(model, quant):
        return
    lm_head = model.lm_head
    lm_head.weight = nn.Parameter(lm_head.weight.detach().clone(), requires_grad=False)
    model.config = dataclasses.replace(model.config, share_embedding_table=False)


def untie_needed(model: nn.Module, quant: QuantConfig) -> bool:
    """Whether ``quant`` quantizes an ``lm_head`` that shares the embedding table."""
    lm_head = getattr(model, "lm_head", None)
    return not (quant.quant_algo is None or lm_head is None or not getattr(model, "shares_embedding_table", False)
                or _excluded("lm_head", lm_head,
                             DEFAULT_EXCLUDED if quant.exclude_modules is None else quant.exclude_modules))


def quantized_modules(model: nn.Module, quant: QuantConfig) -> list[tuple[str, nn.Module]]:
    """The linear layers ``quant`` quantizes: every ``Linear`` not matched by ``exclude_modules``
    (default: ``lm_head``; patterns match the full name or its last part, fnmatch style) and
    not sharing its weight with another module (a tied lm_head: ``untie_lm_head_for`` first)."""
    if quant.quant_algo is None:
        return []
    if quant.quant_algo not in IMPLEMENTED_ALGOS:
        raise ConfigError(f"quantization.quant_algo {quant.quant_algo!r} is not implemented yet; kiln runs "
                          f"{sorted(IMPLEMENTED_ALGOS)}")
    patterns = DEFAULT_EXCLUDED if quant.exclude_modules is None else tuple(quant.exclude_modules)
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    # Experts take the formats that need no calibration (round to nearest, a GGUF's blocks).
    kinds = (Linear, ExpertLinear) if quant.quant_algo in EXPERT_ALGOS else Linear
    if quant.quant_algo == MIXED_PRECISION:
        return [(name, m) for name, m in model.named_modules()
                if isinstance(m, kinds) and layer_format(name, m, quant) is not None]
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, kinds) and not _excluded(name, m, patterns) and owners[id(m.weight)] == 1]


def use_weight_only_layout(model: nn.Module, quant: QuantConfig, tile_order: bool) -> None:
    """Give the quantized linears of a model built on the meta device their quantized
    parameters (shapes only), so a quantized checkpoint or (``tile_order``) engine loads into it.
    SmoothQuant W8A8 and FP8 linears get theirs too."""
    for name, linear in quantized_modules(model, quant):
        use_quantized_layout(name, linear, quant, tile_order)


def use_quantized_layout(name: str, linear: Linear | ExpertLinear, quant: QuantConfig, tile_order: bool,
                         tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Switch one linear ``quant`` quantizes to its quantized parameters: ``tensors`` (its
    checkpoint tensors, as the quantizers make them) or empty ones of the right shapes."""
    algo = quant.quant_algo
    if algo == SMOOTHQUANT_ALGO:
        linear.use_w8a8(tensors)
        return
    if algo == FP8_ALGO:
        linear.use_fp8(tensors, tile_order=tile_order)
        return
    if algo == MIXED_PRECISION:
        f = layer_format(name, linear, quant)
        linear.use_weight_only(f.bits, f.group_size, f.has_zero_point, tensors, has_offset=f.has_offset,
                               tile_order=tile_order, codebook=f.codebook, super_scales=f.super_scales)
        return
    bits = WEIGHT_ONLY_ALGOS.get(algo)
    linear.use_weight_only(bits, quant.group_size if bits == 4 else None, quant.has_zero_point, tensors,
                           tile_order=tile_order)
    if algo in PREQUANT_ALGOS:
        linear.use_prequant_scale(None if tensors is None else tensors["prequant_scaling_factor"])
    if algo in ACTIVATION_SCALE_ALGOS:
        linear.use_activation_scale(None if tensors is None else tensors["activation_scaling_factor"])


def check_group_size(quant: QuantConfig, where: str = "quantization") -> None:
    """A ConfigError unless 4-bit ``quant.group_size`` is a multiple of 32: the kernels tile the
    input in 32-feature chunks, each inside one group."""
    if quant.group_size % 32:
        raise ConfigError(f"{where}: --group_size {quant.group_size} for {quant.quant_algo}: must be a multiple of "
                          "32 (the 4-bit kernels' tile), e.g. 32, 64 or 128")


def quantizable_modules(model: nn.Module, quant: QuantConfig) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The linears ``quantize_model`` quantizes, and the names it leaves in float: excluded ones
    plus those of a shape the kernels cannot tile (with a warning). Raises a ConfigError for a
    group size that does not divide a layer's input features."""
    bits = 8 if quant.quant_algo == FP8_ALGO else WEIGHT_ONLY_ALGOS.get(quant.quant_algo)  # FP8: 1-byte codes
    if bits == 4:
        check_group_size(quant)
    excluded = list(DEFAULT_EXCLUDED if quant.exclude_modules is None else quant.exclude_modules)
    chosen = []
    for name, linear in quantized_modules(model, quant):
        out_features, in_features = linear.weight.shape[-2:]  # an expert projection's: [E, out, in]
        if bits == 4 and in_features % quant.group_size:
            raise ConfigError(f"{name}: in_features {in_features} is not a multiple of group_size "
                              f"{quant.group_size}")
        if not kernels.quant_shape_tiles(out_features, in_features, bits, quant.group_size if bits == 4 else None):
            log.warning("%s: shape %s does not tile for the quantized kernels; left unquantized", name,
                        (out_features, in_features))
            excluded.append(name)
            continue
        chosen.append((name, linear))
    return chosen, excluded


def quantize_model(model: nn.Module, quant: QuantConfig) -> QuantConfig | None:
    """Quantize the float weights of ``model``'s linears in place (round to nearest).

    Returns ``quant`` as the checkpoint must record it: ``exclude_modules`` names every linear
    left in float (see ``quantizable_modules``), so a model built from it gets the same layout;
    None if no linear was quantized.
    """
    if quant.quant_algo not in ROUND_TO_NEAREST_ALGOS:
        raise ConfigError(f"quantization.quant_algo {quant.quant_algo!r} needs calibration: round-to-nearest "
                          f"quantization makes {list(ROUND_TO_NEAREST_ALGOS)}; W4A16_GPTQ also comes from a GPTQ "
                          "checkpoint, and the calibrated algorithms from kiln.quantization.calibrated (kiln "
                          "convert runs them)")
    bits = WEIGHT_ONLY_ALGOS.get(quant.quant_algo)
    chosen, excluded = quantizable_modules(model, quant)
    for name, linear in chosen:
        tensors = quantize_weight(linear.weight.float(), bits, quant.group_size, quant.has_zero_point)
        linear.use_weight_only(bits, quant.group_size if bits == 4 else None, quant.has_zero_point, tensors)
    if not chosen:
        return None
    return dataclasses.replace(quant, exclude_modules=excluded, pre_quant_scale=False)
