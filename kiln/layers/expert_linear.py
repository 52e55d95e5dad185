"""Every expert's copy of one projection of a mixture-of-experts block, stacked (``[E, out,
in]``), and how it loads: one tensor per expert, stacked tensors, transformers' fused
``gate_up_proj``, gpt-oss's transposed and interleaved or MXFP4 tensors, and pre-quantized
GGUF blocks. Weight-only quantized experts keep each expert's codes, scales and offsets
together (expert-major), so a step reads only its chosen experts' bytes.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.checkpoint.shard_spec import ShardSpec, rank_range
from kiln.layers.linear import QUANT_PARAMETERS, Linear
from kiln.layers.quantized_matmul import dequantize_mxfp4


class ExpertLinear(nn.Module):
    """One projection of every expert, stacked: ``weight`` ``[num_experts, out, in]`` (this
    rank's part). ``tp_dim`` 1 splits the outputs over ranks (fc, gate), 2 the inputs (proj).

    ``matmul(e, x)`` multiplies by expert ``e`` through :meth:`Linear.matmul` on a view of its
    slice, so experts get the same kernels as any linear (skinny GEMM, AMX tiles, packed oneDNN).
    """

    # (index, count): from a stacked external tensor whose dim 1 holds ``count`` equal parts
    # (transformers' fused gate_up_proj: fc rows, then gate rows); this weight is part ``index``.
    fused_part: tuple[int, int] | None = None
    # The external tensor is already stacked over experts (else: one tensor per expert).
    stacked_source: bool = False
    # gpt-oss: the stacked external weight is [E, in, out] (``source_transposed``), and this
    # weight's rows are every ``count``-th of its outputs from ``index`` on (``interleaved_part``:
    # gate and up alternate). Such tensors are read whole and cut to this rank's part here.
    source_transposed: bool = False
    interleaved_part: tuple[int, int] | None = None
    # gpt-oss as released: the weight comes as MXFP4 ``*_blocks`` and ``*_scales`` ([E, out, in]
    # order), decoded exactly (E2M1 values times powers of two fit bf16 and float32).
    mxfp4_source: bool = False

    def __init__(self, num_experts: int, in_features: int, out_features: int, tp_dim: int, *,
                 bias: bool = False, dtype: torch.dtype | None = None, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        if tp_dim not in (1, 2):
            raise ValueError(f"tp_dim is 1 (outputs) or 2 (inputs), not {tp_dim}")
        self.num_experts, self.tp_dim = num_experts, tp_dim
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.in_features = in_features // (tp_size if tp_dim == 2 else 1)
        self.out_features = out_features // (tp_size if tp_dim == 1 else 1)
        self.weight = nn.Parameter(torch.empty(num_experts, self.out_features, self.in_features, dtype=dtype),
                                   requires_grad=False)
        # [E, out]: each expert's output bias (an input-split projection's whole bias, added on rank 0 only).
        self.bias = (nn.Parameter(torch.empty(num_experts, self.out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self._views: list[Linear] = []
        self._views_key: tuple | None = None
        self.quant_format: dict | None = None  # use_weight_only's arguments once the experts hold codes

    def use_weight_only(self, bits: int, group_size: int | None, has_zero_point: bool,
                        tensors: dict[str, torch.Tensor] | None = None, *, has_offset: bool = False,
                        tile_order: bool = False, codebook: str | None = None, super_scales: bool = False) -> None:
        """Give every expert :meth:`Linear.use_weight_only`'s parameters, stacked expert-major
        (``[E, ...]`` each: one expert's codes, scales and offsets lie together, so a step reads
        only its chosen experts' bytes): the given ``tensors``, or empty ones of those shapes."""
        fmt = dict(bits=bits, group_size=group_size, has_zero_point=has_zero_point, has_offset=has_offset,
                   tile_order=tile_order, codebook=codebook, super_scales=super_scales)
        with torch.device("meta"):
            one = Linear(self.in_features, self.out_features, bias=False, dtype=self.weight.dtype)
            one.use_weight_only(bits, group_size, has_zero_point, has_offset=has_offset, tile_order=tile_order,
                                codebook=codebook, super_scales=super_scales)
        for name, p in one.named_parameters():
            shape = (self.num_experts, *p.shape)
            tensor = tensors[name] if tensors is not None else torch.empty(shape, dtype=p.dtype,
                                                                            device=self.weight.device)
            if tuple(tensor.shape) != shape or tensor.dtype != p.dtype:
                raise ValueError(f"{name}: expected {p.dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")
            setattr(self, name, nn.Parameter(tensor, requires_grad=False))
        self.quant_format = fmt

    @property
    def quant_bits(self) -> int | None:
        return None if self.quant_format is None else self.quant_format["bits"]

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x W_e^T`` for rows ``x`` ``[n, in]`` routed to expert ``expert``."""
        return self.expert_linears()[expert].matmul(x, None)

    def expert_linears(self) -> list[Linear]:
        """One :class:`Linear` per expert, viewing its slice of ``weight`` (and of its scales and
        offsets, once quantized), built on first use."""
        w = self.weight
        key = (w.data_ptr(), tuple(w.shape), w.dtype)
        if self._views_key != key:  # weights are assigned at load time: rebuild the views then
            names = [n for n in QUANT_PARAMETERS if getattr(self, n, None) is not None]
            views = []
            for e in range(self.num_experts):
                with torch.device("meta"):
                    view = Linear(self.in_features, self.out_features, bias=False, dtype=w.dtype)
                if self.quant_format is None:
                    view.weight = nn.Parameter(w.data[e], requires_grad=False)
                else:
                    f = self.quant_format
                    view.use_weight_only(f["bits"], f["group_size"], f["has_zero_point"],
                                         {n: getattr(self, n).data[e] for n in names}, has_offset=f["has_offset"],
                                         tile_order=f["tile_order"], codebook=f["codebook"],
                                         super_scales=f["super_scales"])
                views.append(view)
            self._views, self._views_key = views, key
        return self._views

    # -- weight loading (kiln.checkpoint.loader) ---------------------------------------------

    weight_postprocess = None  # pre-quantized experts (kiln.quantization.gguf): raw tensor -> parameters

    def load_spec(self, param_name: str, num_external: int) -> list[ShardSpec]:
        if self.weight_postprocess is not None and param_name == "weight":
            return [ShardSpec()] * num_external  # pre-quantized tensors are read whole (tp 1 only)
        if self.source_transposed or self.interleaved_part is not None or self.mxfp4_source:
            return [ShardSpec()] * num_external  # read whole; postprocess takes this rank's part
        if not self.stacked_source:  # one 2-D [out, in] tensor per expert
            return [ShardSpec.even(self.tp_dim - 1, self.tp_size, self.tp_rank)] * num_external
        if self.fused_part is None:
            return [ShardSpec.even(self.tp_dim, self.tp_size, self.tp_rank)]
        index, count = self.fused_part
        rows = self.out_features * self.tp_size
        return [ShardSpec(1, tuple((rows, self.tp_size if i == index else 0, self.tp_rank) for i in range(count)))]

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        if self.weight_postprocess is not None and key.endswith(".weight"):
            return self.weight_postprocess(key, weights)
        if self.mxfp4_source and key.endswith(".weight"):
            weights = [dequantize_mxfp4(*weights)]
        tensor = weights[0] if self.stacked_source else torch.stack(weights)
        if self.source_transposed or self.interleaved_part is not None:
            tensor = self._rank_part(tensor, bias=key.endswith(".bias"))
        return {key: tensor.contiguous()}

    def _rank_part(self, whole: torch.Tensor, bias: bool) -> torch.Tensor:
        """This rank's ``[E, out, in]`` weight (or ``[E, out]`` bias) from a whole stacked tensor."""
        if self.source_transposed and not bias and not self.mxfp4_source:
            whole = whole.transpose(1, 2)
        if self.interleaved_part is not None:
            index, count = self.interleaved_part
            whole = whole[:, index::count]
        if self.tp_size > 1 and (self.tp_dim == 1 or not bias):
            start, stop = rank_range(whole.shape[self.tp_dim], self.tp_size, self.tp_rank)
            whole = whole.narrow(self.tp_dim, start, stop - start)
        return whole
