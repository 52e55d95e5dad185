"""Import of Hugging Face GPTQ checkpoints (``quantization_config.quant_method: "gptq"``) into
kiln's W4A16 layout, recorded as ``quant_algo: W4A16_GPTQ``.

A GPTQ linear holds (AutoGPTQ / optimum layout):

* ``qweight`` int32 ``[in / 8, out]``: eight 4-bit codes per int32 along the input features,
  feature ``8r + j`` in bits ``4j..4j+3`` of row ``r`` (low bits first);
* ``qzeros`` int32 ``[groups, out / 8]``: zero points packed the same way along the outputs;
* ``scales`` float16 ``[groups, out]``;
* ``g_idx`` int32 ``[in]`` (optional): the group of each input feature.

``w[o, i] = (code[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]``. The classic ``gptq``
checkpoint format (AutoGPTQ, ``checkpoint_format`` absent or ``"gptq"``) stores each zero point
minus one, and its kernels add the one back without masking, so a stored nibble ``z`` means
``z + 1`` (15 means 16); ``gptq_v2`` (GPTQModel) stores the zero point itself. kiln's zero
points are float32, so both map exactly.

Mapping to kiln (``kiln.quantization.weight_only``): codes transposed to ``[out, in]`` and
packed two a byte, scales and zero points transposed to ``[out, groups]`` float32. Symmetric
checkpoints (``sym``) have every zero point 8, kiln's implicit one (``has_zero_point`` false).
``group_size`` -1 (one group per row) becomes the largest multiple of 32 dividing every
quantized layer's input features, each row's scale repeated over its groups: still exact.

Act-order (``desc_act`` with a ``g_idx`` other than ``i // group_size``): a group's features are
scattered over the row, while kiln's groups are contiguous runs of inputs. Such a layer is
dequantized exactly and re-quantized by round-to-nearest into kiln's groups (same group size,
same zero-point mode), with a warning: the result is within half a kiln step of the GPTQ weight,
not equal to it. Tensor parallelism (tp > 1) is refused: the packed tensors would need splitting
along packed dimensions, which this importer does not do yet.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn

from kiln import kernels
from kiln.checkpoint.loader import translate_key
from kiln.config import QuantConfig
from kiln.errors import CheckpointError, ConfigError
from kiln.quantization.weight_only import quantize_weight, quantized_modules

log = logging.getLogger(__name__)

GPTQ_ALGO = "W4A16_GPTQ"
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # the external tensors of one quantized linear
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what to add to a stored zero point


@dataclasses.dataclass(frozen=True)
class GptqSettings:
    """What a GPTQ ``quantization_config`` says, checked: ``group_size`` None means one group per row."""

    group_size: int | None
    sym: bool
    desc_act: bool
    zero_offset: int


def gptq_settings(hf_config: dict, where: str) -> GptqSettings | None:
    """The GPTQ settings of a Hugging Face ``config.json``, or None if it is not a GPTQ checkpoint.

    Raises :class:`ConfigError`, naming the field, for what kiln cannot import.
    """
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "gptq":
        return None
    bits = qc.get("bits")
    if bits != 4:
        raise ConfigError(f"{where}: quantization_config.bits is {bits!r}; kiln imports 4-bit GPTQ checkpoints only")
    group_size = qc.get("group_size", -1)
    if group_size != -1 and (not isinstance(group_size, int) or group_size <= 0 or group_size % 32):
        raise ConfigError(f"{where}: quantization_config.group_size {group_size!r} does not tile for kiln's "
                          "quantized kernels (a multiple of 32, or -1)")
    fmt = qc.get("checkpoint_format") or "gptq"
    if fmt not in CHECKPOINT_FORMATS:
        raise ConfigError(f"{where}: quantization_config.checkpoint_format {fmt!r} is not one of "
                          f"{sorted(CHECKPOINT_FORMATS)}")
    return GptqSettings(None if group_size == -1 else group_size, bool(qc.get("sym", True)),
                        bool(qc.get("desc_act", False)), CHECKPOINT_FORMATS[fmt])


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The 4-bit values (int32, 0..15) packed eight to an int32 along ``dim``, low bits first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    moved = packed.to(torch.int32).movedim(dim, -1)
    nibbles = (moved.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift is fine: the mask drops the sign bits
    return nibbles.flatten(-2).movedim(-1, dim)


def _dequantize_gptq(codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """float32 ``[out, in]`` weight from codes ``[in, out]`` and per-group ``zero``/``scale`` ``[groups, out]``."""
    g = g_idx.long()
    return ((codes.float() - zero[g]) * scale[g]).t().contiguous()


def to_weight_only(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                   settings: GptqSettings, group_size: int, has_zero_point: bool,
                   where: str = "gptq") -> dict[str, torch.Tensor]:
    """kiln's W4A16 tensors (``weight``, ``weights_scaling_factor``, ``zero`` if ``has_zero_point``)
    for one GPTQ linear, with kiln group size ``group_size`` (see the module doc)."""
    codes = unpack_int32(qweight, 0)  # [in, out]
    in_features, out_features = codes.shape
    zero = unpack_int32(qzeros, 1)[:, :out_features].float() + settings.zero_offset  # [groups, out]
    scale = scales.float()
    gptq_group = settings.group_size or in_features
    groups = math.ceil(in_features / gptq_group)
    if scale.shape != (groups, out_features) or zero.shape != scale.shape:
        raise CheckpointError(f"{where}: scales {list(scales.shape)} / qzeros {list(qzeros.shape)} do not fit "
                              f"{groups} groups of {out_features} outputs")
    contiguous = torch.arange(in_features, dtype=torch.int64) // gptq_group
    if g_idx is not None and not torch.equal(g_idx.long(), contiguous):
        # Act-order: GPTQ groups are scattered over the inputs; kiln's are contiguous runs.
        log.warning("%s: act-order GPTQ (desc_act) groups do not map onto kiln's contiguous groups; "
                    "re-quantized by round-to-nearest (not exact)", where)
        w = _dequantize_gptq(codes, zero, scale, g_idx)
        return quantize_weight(w, 4, group_size, has_zero_point)
    if gptq_group % group_size:
        raise ConfigError(f"{where}: GPTQ group size {gptq_group} is not a multiple of kiln's {group_size}")
    if not has_zero_point and not torch.all(zero == 8):
        raise CheckpointError(f"{where}: quantization_config.sym is true but the zero points are not all 8")
    repeat = gptq_group // group_size  # 1, except for group_size -1
    codes_t = codes.t().to(torch.uint8)
    out = {"weight": (codes_t[:, 0::2] | (codes_t[:, 1::2] << 4)).contiguous(),
           "weights_scaling_factor": scale.t().repeat_interleave(repeat, dim=1).contiguous()}
    if has_zero_point:
        out["zero"] = zero.t().repeat_interleave(repeat, dim=1).contiguous()
    return out


def use_gptq_layout(model: nn.Module, settings: GptqSettings, external: set[str], base_key_map: dict,
                    where: str) -> QuantConfig:
    """Switch the linears of a meta-device ``model`` whose weights the checkpoint holds as GPTQ
    tensors to kiln's W4A16 parameters, loading ``weight`` from ``qweight``/``qzeros``/``scales``
    (/``g_idx``) through the loader's multi-key map; returns the quantization config to record."""
    if model.config.mapping.tp_size > 1:
        raise ConfigError(f"{where}: GPTQ checkpoints convert with tp_size 1 only (splitting the packed "
                          f"tensors over ranks is not implemented); got tp_size {model.config.mapping.tp_size}")
    candidates = quantized_modules(model, QuantConfig(quant_algo=GPTQ_ALGO, exclude_modules=[]))
    gptq = []
    for name, linear in candidates:
        stems = [k.rpartition(".")[0] for k in translate_key(f"{name}.weight", base_key_map)]
        if all(f"{s}.qweight" in external for s in stems):
            gptq.append((name, linear, stems))
    if not gptq:
        raise CheckpointError(f"{where}: quantization_config says GPTQ but no linear has a qweight tensor")
    in_sizes = {linear.in_features for _, linear, _ in gptq}
    group_size = settings.group_size or math.gcd(*in_sizes)
    if group_size % 32:
        raise ConfigError(f"{where}: quantization_config.group_size -1 needs input features sharing a multiple "
                          f"of 32 for kiln's groups; these are {sorted(in_sizes)}")
    has_zero_point = not settings.sym
    for name, linear, stems in gptq:
        if (linear.source_transposed or linear.fused_part is not None or getattr(linear, "interleaved_heads", False)
                or getattr(linear, "adjacent_rotary_dims", 0)):
            raise ConfigError(f"{where}: {name}: GPTQ import handles separate, untransposed linears only")
        if not kernels.quant_shape_tiles(linear.out_features, linear.in_features, 4, group_size):
            raise ConfigError(f"{where}: {name}: shape {(linear.out_features, linear.in_features)} with "
                              f"quantization_config.group_size {settings.group_size} does not tile for the "
                              "quantized kernels")
        with_g_idx = all(f"{s}.g_idx" in external for s in stems)
        linear.use_weight_only(4, group_size, has_zero_point)
        linear.external_key_map = {"weight": list(GPTQ_TENSORS if with_g_idx else GPTQ_TENSORS[:3])}
        linear.weight_postprocess = _postprocess_for(settings, group_size, has_zero_point, with_g_idx, where)
    names = {name for name, _, _ in gptq}
    excluded = [name for name, _ in candidates if name not in names]  # left float by the checkpoint
    return QuantConfig(quant_algo=GPTQ_ALGO, group_size=group_size, has_zero_point=has_zero_point,
                       exclude_modules=sorted(set(excluded) | {"lm_head"}))


def _postprocess_for(settings: GptqSettings, group_size: int, has_zero_point: bool, with_g_idx: bool, where: str):
    """A ``Linear.weight_postprocess``: the loaded GPTQ tensors (a run per external linear, fused
    ones such as q/k/v one after another) -> kiln's tensors, parts concatenated along outputs."""
    per = 4 if with_g_idx else 3

    def postprocess(key: str, weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        stem = key.rpartition(".")[0]
        parts = [to_weight_only(*weights[i:i + 3], weights[i + 3] if with_g_idx else None, settings, group_size,
                                has_zero_point, where=f"{where}: {stem}")
                 for i in range(0, len(weights), per)]
        return {f"{stem}.{name}": torch.cat([p[name] for p in parts], dim=0) for name in parts[0]}

    return postprocess
