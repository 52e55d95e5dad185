"""Linear layers that own their tensor-parallel sharding and weight postprocess.

Weights are stored ``(out_features, in_features)`` as reference 002 prescribes.
``ColumnLinear`` splits the output features over ranks (tp_dim 0), ``RowLinear`` the input
features (tp_dim 1) and sums the partial results with an all-reduce.

Loading protocol (used by :class:`kiln.checkpoint.loader.ModelWeightsLoader`): a module may
define ``load_spec(param_name)`` giving, for each external tensor the parameter is made
from, which dimension to shard and how (:class:`ShardSpec`); and ``postprocess(key,
weights, **kwargs)`` turning the loaded tensors into ``{key: tensor}``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln import distributed, kernels
from kiln.checkpoint.shard_spec import ShardSpec, rank_range
from kiln.layers.lora import LoraStep
from kiln.layers.quantized_matmul import dequantize, fp8_linear, fp8_round_input, w8a8_linear, weight_only_shapes

# bf16 weights: an engine holds them packed into tiles at build time (``tile_order``;
# kiln/kernels/panel_linear.c, amx_linear.c), multiplied on AMX or with AVX512-BF16 dot
# products for any number of rows: one row streams the tiles at the memory bandwidth like a
# plain GEMV, more rows beat oneDNN from 2 to 128 rows on AMX, even at 512
# (docs/benchmark-log.md). A plain bf16 weight (a checkpoint's, a tied lm_head's) is packed
# once on first use where the CPU has those instructions, else goes to oneDNN, whose bf16
# matmul re-lays-out a plain weight on every call, on a weight packed once into its blocked
# format (1.4-2x faster than F.linear). fp32: the native skinny GEMM up to 16 rows (faster
# than MKL), F.linear beyond. oneDNN packs bf16 only where the CPU converts bf16 in hardware
# (AVX512-BW or AVX-NE-CONVERT); elsewhere (AVX2 alone) F.linear.
_PACK_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# A linear's weight and its per-row quantization parameters (codes, scales, zero points, offsets).
QUANT_PARAMETERS = ("weight", "weights_scaling_factor", "zero", "weights_offset", "weights_super_scale",
                    "weights_super_offset")


class Linear(nn.Module):
    """``y = x W^T + b`` with the weight ``(out_features, in_features)``.

    ``source_transposed`` marks weights stored ``(in, out)`` in the external checkpoint
    (GPT-2's ``Conv1D``): they are sliced on the other dimension and transposed on load.
    """

    tp_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0,
                 source_transposed: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.source_transposed = source_transposed
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    quant_bits: int | None = None  # 8, 6 or 4 once use_weight_only() switched the weight to codes
    codebook: str | None = None  # "e2m1": those 4-bit codes are MXFP4's E2M1 nibbles
    super_scales: bool = False  # group scales and offsets are int8 codes under super-block multipliers
    act_quant: bool = False  # True once use_w8a8() switched to SmoothQuant W8A8 (int8 activations too)
    fp8: bool = False  # True once use_fp8() switched to FP8 e4m3 weights and activations
    # The weight (codes, or an engine's float bf16 weight: kernels.pack_bf16) is in the kernels' tile layout.
    tile_order: bool = False
    # The reference LoRA modules this linear holds (kiln.layers.lora.LoraTarget), set by
    # DecoderModelForCausalLM.assign_lora_targets.
    lora_targets: tuple = ()

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        """``x W^T + b``, plus the deltas of the step's adapters (``lora``) for this linear."""
        return self.with_lora(x, self.matmul(x, self.bias), self.bias, lora)

    def with_lora(self, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None,
                  lora: LoraStep | None) -> torch.Tensor:
        """``y`` (``bias`` included) plus ``lora``'s deltas for this linear (none without a step)."""
        if self.lora_targets and lora is not None:
            return lora.apply(self.lora_targets, x, y, bias)
        return y

    # -- weight-only quantization (kiln.quantization.weight_only) -----------------------------

    def use_weight_only(self, bits: int, group_size: int | None, has_zero_point: bool,
                        tensors: dict[str, torch.Tensor] | None = None, *, has_offset: bool = False,
                        tile_order: bool = False, codebook: str | None = None, super_scales: bool = False) -> None:
        """Replace the float weight by weight-only quantized parameters (the given ``tensors``, or
        empty ones of the right shapes): ``weight`` codes, ``weights_scaling_factor`` (8-bit with
        ``group_size`` None: one per output channel; else one per group) and, per group, the
        integer ``zero`` (``has_zero_point``, 4-bit) or the float ``weights_offset``
        (``has_offset``). ``tile_order``: the tensors are in the kernels' layout (an engine's:
        ``kernels.quant_pack`` and ``quant_pack_scales``, where a zero point becomes an offset).
        ``codebook`` "e2m1": 4-bit codes are MXFP4's E2M1 nibbles (``quantized_matmul.dequantize``).
        ``super_scales`` (GGUF K-quants): the group scales and offsets are int8 codes, under float32
        ``weights_super_scale`` and ``weights_super_offset`` ``[out, in / SUPER_K]``; in the
        kernels' layout all in the scales' and offsets' super-block records."""
        kernels.quant_bits_arg(bits, codebook)  # a ValueError for a codebook the kernels lack
        shapes = weight_only_shapes(*self.weight.shape, bits, group_size, has_zero_point, has_offset, tile_order,
                                    super_scales)
        self._set_parameters(shapes, tensors)
        self.quant_bits, self.group_size, self.tile_order, self.codebook = bits, group_size, tile_order, codebook
        self.super_scales = super_scales

    def use_prequant_scale(self, factor: torch.Tensor | None = None) -> None:
        """Give a quantized layer AWQ's ``prequant_scaling_factor`` (float32 ``[in_features]``,
        the given ``factor`` or an empty one): its input is multiplied by it before the matmul."""
        self._set_parameters({"prequant_scaling_factor": ((self.in_features,), torch.float32)},
                             None if factor is None else {"prequant_scaling_factor": factor})

    def use_activation_scale(self, scale: torch.Tensor | None = None) -> None:
        """Give a 4-bit layer W4A8_AWQ's static ``activation_scaling_factor`` (float32 ``[1]``, the
        given ``scale`` or an empty one): its input (after the prequant multiply) is rounded to
        the FP8 e4m3 grid of that scale before the matmul."""
        self._set_parameters({"activation_scaling_factor": ((1,), torch.float32)},
                             None if scale is None else {"activation_scaling_factor": scale})

    def use_fp8(self, tensors: dict[str, torch.Tensor] | None = None, *, tile_order: bool = False) -> None:
        """Replace the float weight by FP8 parameters (kiln.quantization.fp8): e4m3 ``weight``
        ``[out, in]`` (in the kernel's tile order in an engine), float32 ``weights_scaling_factor``
        (per tensor, ``[1]``, in a checkpoint; per output column, ``[out]``, in an engine, so a
        fused pair keeps both scales) and float32 ``activation_scaling_factor`` ``[1]``; the given
        ``tensors``, or empty ones of those shapes."""
        out_features, in_features = self.weight.shape
        self._set_parameters({"weight": ((out_features, in_features), torch.float8_e4m3fn),
                              "weights_scaling_factor": ((out_features if tile_order else 1,), torch.float32),
                              "activation_scaling_factor": ((1,), torch.float32)}, tensors)
        self.fp8, self.tile_order = True, tile_order

    def _set_parameters(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                        tensors: dict[str, torch.Tensor] | None) -> None:
        """Set each named parameter to ``tensors[name]`` (checked against its shape and dtype) or
        to an empty tensor of that shape and dtype."""
        for name, (shape, dtype) in shapes.items():
            tensor = tensors[name] if tensors is not None else torch.empty(shape, dtype=dtype, device=self.weight.device)
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"{name}: expected {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")
            setattr(self, name, nn.Parameter(tensor, requires_grad=False))

    def use_w8a8(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Replace the float weight by SmoothQuant W8A8 parameters (kiln.quantization.smoothquant):
        int8 ``weight`` ``[out, in]``, float32 ``weights_scaling_factor`` ``[out]`` and
        ``prequant_scaling_factor`` ``[in]``; the given ``tensors``, or empty ones of those shapes.
        Checkpoint and engine share the layout (``torch._int_mm`` takes row-major codes)."""
        out_features, in_features = self.weight.shape
        shapes = {"weight": ((out_features, in_features), torch.int8),
                  "weights_scaling_factor": ((out_features,), torch.float32),
                  "prequant_scaling_factor": ((in_features,), torch.float32)}
        self._set_parameters(shapes, tensors)
        self.act_quant = True

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight a quantized layer stands for (row-major codes only)."""
        tensors = {name: getattr(self, name) for name in QUANT_PARAMETERS if hasattr(self, name)}
        return dequantize(tensors, self.quant_bits, self.group_size, self.codebook)

    def _quantized_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        prequant = getattr(self, "prequant_scaling_factor", None)
        act_scale = getattr(self, "activation_scaling_factor", None)
        if act_scale is not None:  # W4A8_AWQ: the input on the e4m3 grid of its static scale, then the 4-bit matmul
            x = fp8_round_input(x, act_scale, prequant, fast=self.tile_order) * act_scale
            x = x.to(torch.bfloat16 if self.tile_order else x.dtype)
        elif prequant is not None:  # AWQ: the codes hold W diag(s), so the input is divided by s (one multiply)
            x = (x * prequant).to(x.dtype)
        if not self.tile_order:  # a checkpoint's layout: a reference path, not a fast one
            return F.linear(x, self.dequantized_weight().to(x.dtype), bias)
        y = kernels.quant_linear(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight,
                                 self.weights_scaling_factor, getattr(self, "weights_offset", None), self.quant_bits,
                                 self.group_size, None if bias is None else bias.to(torch.bfloat16), self.out_features,
                                 codebook=self.codebook, super_scales=self.super_scales)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` through the fastest kernel here for the weight and the rows: up to
        16 fp32 rows or one bf16 row through the native skinny GEMM; more bf16 rows through the
        packed kernel (AMX or AVX512-BF16, a copy of the weight packed once), or through oneDNN
        (weight packed once)."""
        if self.quant_bits is not None:
            return self._quantized_matmul(x, bias)
        if self.fp8:
            return fp8_linear(self, x, bias)
        if self.act_quant:
            return w8a8_linear(x, self.weight, self.weights_scaling_factor, self.prequant_scaling_factor, bias)
        if self.tile_order:  # an engine's bf16 weight, packed by kiln build
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
            y = kernels.packed_linear(rows, self.weight, bias, self.out_features)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        w = self.weight
        if x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] <= kernels.SKINNY_MAX_ROWS \
                and kernels.skinny_linear_supported(x, w, bias):
            return kernels.skinny_linear(x, w, bias, check=False)
        if x.dim() == 2 and x.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16):
            packed = self.packed_weight()
            if packed is not None:
                return kernels.packed_linear(x, packed, bias, self.out_features)
            if x.shape[0] == 1 and kernels.skinny_linear_supported(x, w, bias):
                return kernels.skinny_linear(x, w, bias, check=False)
        if not (_PACK_BF16 and w.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and w.device.type == "cpu"):
            return F.linear(x, w, bias)
        key = (w.data_ptr(), tuple(w.shape))  # weights are assigned at load time, so repack if they change
        if getattr(self, "_packed_key", None) != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            self._packed_key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [None], "")

    def drop_packed_copies(self) -> None:
        """Forget the packed copies ``matmul`` made of a float weight (a layer-by-layer
        calibration drops each layer's weights after use: the copies must go with them)."""
        for name in ("_packed", "_packed_key", "_packed_tiles", "_packed_tiles_key"):
            self.__dict__.pop(name, None)

    def packed_weight(self, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The weight in tiles for ``kernels.packed_linear``: an engine's own (``tile_order``),
        else packed on first use (into ``out`` if given) and again if the weight is reassigned;
        None where that kernel cannot take it."""
        w = self.weight
        if self.tile_order and w.dtype == torch.bfloat16:
            return w
        key = (w.data_ptr(), tuple(w.shape), w.dtype)
        if getattr(self, "_packed_tiles_key", None) != key:
            self._packed_tiles = kernels.pack_bf16(w.detach(), out) if kernels.packed_supported(w) else None
            self._packed_tiles_key = key
        return self._packed_tiles

    # -- weight loading -----------------------------------------------------------------

    def shard_dim(self, param_name: str) -> int | None:
        """The dimension of ``param_name`` split over ranks, or ``None`` if replicated."""
        if self.tp_dim is None or self.tp_size == 1:
            return None
        if param_name == "bias":
            return 0 if self.tp_dim == 0 else None
        return self.tp_dim

    # (index, count): this layer's rows are part ``index`` of ``count`` equal row parts of one
    # fused external tensor (Phi-3's gate_up_proj holds both gated-MLP inputs).
    fused_part: tuple[int, int] | None = None

    # This layer's rows, picked from one external tensor that interleaves several layers' rows
    # (Qwen3-Next's in_proj_qkvz: q, k, v and z per key head); read whole, tp 1 only.
    source_rows: torch.Tensor | None = None

    def load_spec(self, param_name: str, num_external: int) -> list[ShardSpec]:
        if (self.weight_postprocess is not None or self.source_rows is not None) and param_name == "weight":
            return [ShardSpec()] * num_external  # read whole (tp 1 only)
        if self.fused_part is not None and param_name in ("weight", "bias"):
            index, count = self.fused_part
            rows = self.out_features * (self.tp_size if self.tp_dim == 0 else 1)
            split = self.tp_size if self.tp_dim == 0 else 1
            return [ShardSpec(0, tuple((rows, split if i == index else 0, self.tp_rank) for i in range(count)))]
        spec = ShardSpec.even(self.shard_dim(param_name), self.tp_size, self.tp_rank)
        if self.source_transposed and param_name == "weight":
            spec = spec.transposed()
        return [spec] * num_external

    # Set for a weight stored pre-quantized in several external tensors (kiln.quantization.gptq):
    # turns them into this layer's quantized parameters.
    weight_postprocess = None

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        if self.weight_postprocess is not None and key.endswith(".weight"):
            return self.weight_postprocess(key, weights)
        if self.source_transposed and key.endswith("weight"):
            weights = [w.t() for w in weights]
        if self.source_rows is not None and key.endswith(".weight"):
            weights = [weights[0].index_select(0, self.source_rows)]
        # Several external tensors (q, k, v) are concatenated along the output features.
        tensor = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
        return {key: tensor.contiguous()}


class ColumnLinear(Linear):
    """Output features split over ranks; each rank's output is its slice (no gather)."""

    tp_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0,
                 gather_output: bool = False, source_transposed: bool = False):
        super().__init__(in_features, out_features // tp_size, bias, dtype=dtype, tp_size=tp_size,
                         tp_rank=tp_rank, source_transposed=source_transposed)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        y = self.with_lora(x, self.matmul(x, self.bias), self.bias, lora)
        return distributed.all_gather(y, self.tp_size, dim=-1) if self.gather_output else y

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        out = super().postprocess(key, weights, **kwargs)
        missing = self.out_features - out[key].shape[0]
        if self.gather_output and self.tp_rank == self.tp_size - 1 and 0 < missing < self.tp_size:
            # The vocab-parallel lm_head of a vocabulary not divisible by tp_size: the last
            # shard is zero-padded (compute_logits drops the padded columns).
            out[key] = torch.cat([out[key], out[key].new_zeros(missing, *out[key].shape[1:])])
        return out


class RowLinear(Linear):
    """Input features split over ranks; partial products summed with an all-reduce."""

    tp_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0,
                 source_transposed: bool = False):
        super().__init__(in_features // tp_size, out_features, bias, dtype=dtype, tp_size=tp_size,
                         tp_rank=tp_rank, source_transposed=source_transposed)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        if self.tp_size == 1:
            return self.with_lora(x, self.matmul(x, self.bias), self.bias, lora)
        # A rank's LoRA delta is a partial sum too (its rows of A): reduced with the matmul's (a
        # DoRA scale is per output column, so scaling each partial sum scales the total).
        y = distributed.all_reduce(self.with_lora(x, self.matmul(x, None), None, lora), self.tp_size)
        return y if self.bias is None else y + self.bias


def pairs_to_halves_order(head: int, start: int, count: int) -> torch.Tensor:
    """The row order of one ``head``-row group whose ``count`` rotary rows from ``start`` come in
    adjacent pairs (GPT-J, GLM, DeepSeek): those rows' even indices, then their odd ones (the
    halves kiln's rotate-half rotary pairs up), every other row in place."""
    order = torch.arange(head)
    rot = torch.arange(start, start + count)
    order[start:start + count] = torch.cat([rot[0::2], rot[1::2]])
    return order


class QKVColumnLinear(ColumnLinear):
    """The fused ``qkv`` projection: ``[q; k; v]`` rows of this rank's heads.

    With fewer KV heads than ranks, KV heads are replicated: rank ``r`` holds KV head
    ``r * num_kv_heads // tp_size``.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_size: int,
                 bias: bool, *, dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0,
                 source_transposed: bool = False):
        self.q_size = num_heads * head_size  # totals over all ranks
        self.kv_size = num_kv_heads * head_size
        self.head_size = head_size
        self.kv_tp_size = min(tp_size, num_kv_heads)
        self.kv_tp_rank = tp_rank * self.kv_tp_size // tp_size
        local_kv_heads = max(num_kv_heads // tp_size, 1)
        out_local = (num_heads // tp_size + 2 * local_kv_heads) * head_size
        super().__init__(hidden_size, out_local * tp_size, bias, dtype=dtype, tp_size=tp_size,
                         tp_rank=tp_rank, source_transposed=source_transposed)

    # External rows ordered per KV group: the group's query heads, then its key head, then its
    # value head (GPT-NeoX's and Falcon's per-head query_key_value: one query head per group;
    # Falcon-40B's: num_heads / num_kv_heads). Loaded whole, reordered to [q; k; v] and cut to
    # this rank's heads in postprocess.
    interleaved_heads: bool = False
    # GPT-J: the first this-many dims of each external q and k head hold their rotary pairs side
    # by side (rotate_every_two). postprocess reorders them, per head, to the even dims then the
    # odd ones: kiln's rotate-half rotary then computes the same q.k (v is left alone).
    adjacent_rotary_dims: int = 0

    def load_spec(self, param_name: str, num_external: int) -> list[ShardSpec]:
        if self.interleaved_heads or (self.weight_postprocess is not None and param_name == "weight"):
            return [ShardSpec()] * num_external
        dim = 0 if not (self.source_transposed and param_name == "weight") else 1
        q = (self.q_size, self.tp_size, self.tp_rank)
        kv = (self.kv_size, self.kv_tp_size, self.kv_tp_rank)
        if num_external == 3:  # separate q, k, v tensors
            return [ShardSpec(dim, (q,)), ShardSpec(dim, (kv,)), ShardSpec(dim, (kv,))]
        if num_external == 1:  # one fused external tensor
            return [ShardSpec(dim, (q, kv, kv))]
        raise ValueError(f"qkv loads from 1 or 3 external tensors, not {num_external}")

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        if self.interleaved_heads:
            out = {key: self._from_kv_groups(weights[0])}
        else:
            out = super().postprocess(key, weights, **kwargs)
        if self.adjacent_rotary_dims:
            out[key] = out[key].index_select(0, self._rotate_half_order(out[key].shape[0])).contiguous()
        return out

    def _from_kv_groups(self, fused: torch.Tensor) -> torch.Tensor:
        """This rank's [q; k; v] rows from rows ordered per KV group (see ``interleaved_heads``)."""
        heads, kv_heads = self.q_size // self.head_size, self.kv_size // self.head_size
        groups = fused.reshape(kv_heads, heads // kv_heads + 2, self.head_size, *fused.shape[1:])
        q = groups[:, :-2].reshape(heads, self.head_size, *fused.shape[1:])
        q_start, q_stop = rank_range(heads, self.tp_size, self.tp_rank)
        kv_start, kv_stop = rank_range(kv_heads, self.kv_tp_size, self.kv_tp_rank)
        parts = [q[q_start:q_stop], groups[kv_start:kv_stop, -2], groups[kv_start:kv_stop, -1]]
        return torch.cat([part.reshape(-1, *fused.shape[1:]) for part in parts]).contiguous()

    def _rotary_row_order(self) -> torch.Tensor:
        """One head's row order: the rotary dims' even indices, their odd ones, then the rest."""
        return pairs_to_halves_order(self.head_size, 0, self.adjacent_rotary_dims)

    def _rotate_half_order(self, rows: int) -> torch.Tensor:
        """The order of this rank's ``rows`` [q; k; v] rows: q and k heads reordered, v kept."""
        kv_rows = max(self.kv_size // self.head_size // self.tp_size, 1) * self.head_size
        rotated_heads = (rows - kv_rows) // self.head_size  # this rank's q and k heads
        order = (torch.arange(rotated_heads)[:, None] * self.head_size + self._rotary_row_order()).flatten()
        return torch.cat([order, torch.arange(rows - kv_rows, rows)])
