"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE): a router picks ``top_k`` of
``num_experts`` SiLU-gated experts per token; an optional shared expert sees every token.
Un-gated experts (``gated=False``, Nemotron-H's squared ReLU: ``proj(act(fc x))``) hold no
``gate`` and a plain :class:`MLP` as shared expert; nothing is fused for them.

Checkpoint tensors of one block (under ``transformer.layers.{i}.mlp``; ``E`` experts, ``I``
the expert intermediate size, ``tp`` the tensor-parallel ranks)::

    router.weight                      [E, hidden]        replicated on every rank
    fc.weight                          [E, I / tp, hidden] each expert's activated projection
                                                          (HF gate_proj / Mixtral w1), column split
    gate.weight                        [E, I / tp, hidden] the projection multiplied in
                                                          (up_proj / w3), column split
    proj.weight                        [E, hidden, I / tp] the output projection (down_proj / w2),
                                                          row split
    shared_expert.{fc,gate,proj}.weight                   a GatedMLP every token goes through
    shared_expert_gate.weight          [1, hidden]        its per-token sigmoid gate (replicated)

An engine holds ``fused_fc.weight`` ``[E, 2 I / tp, hidden]`` (each expert's ``fc`` rows then
its ``gate`` rows) instead of ``fc`` and ``gate``: one matmul per active expert.

External layouts: Hugging Face files keep one tensor per expert and projection
(``experts.{e}.w1.weight`` or ``experts.{e}.gate_proj.weight``), which ``postprocess`` stacks
(reference 000); transformers >= 5 holds them fused in memory (``experts.gate_up_proj``
``[E, 2 I, hidden]``, ``experts.down_proj`` ``[E, hidden, I]``), which loads as well, and so
do GGUF files' experts, each projection stacked (``LAYOUTS``). Each rank reads only its slice
of every expert's intermediate dimension; a block's partial sums (experts and shared expert)
meet in one all-reduce.

The router and the shared-expert gate are :class:`ReplicatedLinear`, not :class:`Linear`, so
they stay float under any quantization. The experts (:class:`ExpertLinear`) take the weight-only
formats (W8A16, W4A16 by round to nearest; a GGUF's own blocks) stacked expert-major: each
expert's codes, scales and offsets are one contiguous slice that a per-expert :class:`Linear`
view hands to the quantized kernels, so a decode step reads only its chosen experts' bytes.
Calibrated algorithms leave them float. The shared expert's projections are ordinary linears.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln import distributed, kernels
from kiln.errors import ConfigError
from kiln.layers.activation import ClampedSwiGLU, get_activation
from kiln.layers.expert_linear import ExpertLinear
from kiln.layers.linear import QUANT_PARAMETERS
from kiln.layers.mlp import MLP, GatedMLP


@dataclass(frozen=True)
class ExpertNames:
    """A family's external names for one MoE block, relative to the decoder layer.

    ``block`` is the block's name in the per-expert files (Mixtral: ``block_sparse_moe``),
    ``fc``/``gate``/``proj`` an expert's three projections there (``w1``/``w3``/``w2``).
    ``stacked_block`` names it in the stacked layouts (transformers' fused one, GGUF's
    per-projection one): ``mlp`` for every family but Nemotron-H (``mixer``).
    """

    block: str = "mlp"
    stacked_block: str = "mlp"
    router: str = "gate"
    fc: str = "gate_proj"
    gate: str = "up_proj"
    proj: str = "down_proj"

    FUSED_FC_GATE = "experts.gate_up_proj"
    FUSED_PROJ = "experts.down_proj"


class ReplicatedLinear(nn.Module):
    """``y = x W^T (+ b)`` with the whole weight on every rank (router, shared-expert gate)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and kernels.skinny_linear_supported(x, self.weight, self.bias):  # a decode step's rows
            return kernels.skinny_linear(x, self.weight, self.bias, check=False)
        return F.linear(x, self.weight, self.bias)


# How a checkpoint holds a block's experts (``gate_proj``: each family's ``ExpertNames``): per_expert,
# ``{block}.experts.{e}.gate_proj.weight`` (HF files); fused, transformers >= 5's ``mlp.experts.gate_up_proj``
# ``[E, 2 I, hidden]`` (fc rows, then gate rows) and ``down_proj`` ``[E, hidden, I]``; per_projection,
# ``mlp.experts.gate_proj.weight`` ``[E, I, hidden]`` (``.bias`` ``[E, I]``), as GGUF's ``ffn_*_exps`` read.
LAYOUTS = ("per_expert", "fused", "per_projection")


def external_layout(external: set[str], names: ExpertNames) -> str:
    """The ``LAYOUTS`` entry a checkpoint with tensor names ``external`` uses."""
    if any(k.endswith(f".{names.FUSED_FC_GATE}") for k in external):
        return "fused"
    if any(k.endswith(f".{names.stacked_block}.experts.{names.fc}.weight") for k in external):
        return "per_projection"
    return "per_expert"


class MixtureOfExperts(nn.Module):
    """Router, top-k gated experts (``act(fc x) * gate x``, SiLU in both families) and an optional
    gated shared expert.

    Routing: softmax over all experts' router logits (float32), the ``top_k`` largest, divided
    by their sum when ``normalize_top_k`` (Mixtral always; Qwen2-MoE per ``norm_topk_prob``;
    gpt-oss's softmax over the chosen logits is the same). ``router_bias`` / ``expert_bias``:
    biased router and expert projections (gpt-oss); ``gated_act``: ``f(fc x, gate x)`` in place
    of ``act(fc x) * gate x`` (gpt-oss's clamped SwiGLU); ``gated`` False: ``act(fc x)`` alone.
    ``expert_hidden_size``: the experts' input and output width where it is not ``hidden_size``
    (Nemotron-H's latent experts, between projections of their own); ``shared_bias``: a biased
    shared expert.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, hidden_act: str, *,
                 normalize_top_k: bool, shared_intermediate_size: int = 0, shared_expert_gate: bool = False,
                 names: ExpertNames = ExpertNames(), dtype: torch.dtype | None = None, tp_size: int = 1,
                 tp_rank: int = 0, fused: bool = False, router_bias: bool = False, expert_bias: bool = False,
                 gated_act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, gated: bool = True,
                 expert_hidden_size: int | None = None, shared_bias: bool = False):
        super().__init__()
        self.num_experts, self.top_k, self.normalize_top_k = num_experts, top_k, normalize_top_k
        fused = fused and gated  # (an un-gated expert has nothing to fuse)
        self.hidden_size, self.tp_size, self.fused, self.names = hidden_size, tp_size, fused, names
        self.tp_rank, self.gated = tp_rank, gated
        self.act, self.gated_act = get_activation(hidden_act), gated_act
        self.adds_proj_bias = expert_bias and tp_rank == 0  # the output bias once, not once per rank
        shard = dict(dtype=dtype, tp_size=tp_size, tp_rank=tp_rank, bias=expert_bias)
        width = expert_hidden_size or hidden_size
        self.router = ReplicatedLinear(hidden_size, num_experts, bias=router_bias, dtype=dtype)
        if fused:
            self.fused_fc = ExpertLinear(num_experts, width, 2 * intermediate_size, 1, **shard)
            self.fused_fc.fused_from = ("fc", "gate")  # the checkpoint's projections it stands for
        else:
            self.fc = ExpertLinear(num_experts, width, intermediate_size, 1, **shard)
            if gated:
                self.gate = ExpertLinear(num_experts, width, intermediate_size, 1, **shard)
        self.proj = ExpertLinear(num_experts, intermediate_size, width, 2, **shard)
        shard.pop("bias")
        self.shared_expert = ((GatedMLP(hidden_size, shared_intermediate_size, hidden_act, shared_bias, fused=fused,
                                        **shard) if gated
                               else MLP(hidden_size, shared_intermediate_size, hidden_act, shared_bias, **shard))
                              if shared_intermediate_size else None)
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, dtype=dtype)
                                   if shared_intermediate_size and shared_expert_gate else None)
        self.use_external_layout("per_expert")

    # -- forward ------------------------------------------------------------------------------

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 ``[n, top_k]``, expert ids ``[n, top_k]``) for router logits ``[n, E]``."""
        if (router_logits.dim() == 2 and router_logits.dtype in (torch.float32, torch.bfloat16)
                and router_logits.is_contiguous() and kernels.native_library() is not None):
            return kernels.moe_route(router_logits, self.top_k, self.normalize_top_k)  # one call, not four
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:
        """The experts' output for ``x``; ``lora`` is taken for the MLP interface only (expert
        linears hold no LoRA targets: ``assign_lora_targets`` marks plain and gated MLPs)."""
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        weights, experts = self.route(self.router(x))
        native = self._native_experts(x)
        shared = self._native_shared(x) if native is not None else None
        if shared is not None:  # the shared expert inside the routed experts' call
            gate = torch.sigmoid(self.shared_expert_gate(x).float()) if self.shared_expert_gate is not None else None
            out = kernels.moe_experts(x, experts, weights, *native, num_experts=self.num_experts, shared=shared,
                                      shared_weights=gate)
            return distributed.all_reduce(out, self.tp_size).view(shape)
        out = self.routed(x, weights, experts)
        if self.shared_expert is not None:
            shared = shared_partial(self.shared_expert, x, self.tp_rank)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        # Every term above is this rank's partial sum over its intermediate slice.
        return distributed.all_reduce(out, self.tp_size).view(shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` for every token ``t``: the
        (token, slot) pairs are grouped by expert, each active expert runs once on its group
        (a decode step's few tokens in one native call, ``kernels.moe_experts``). The weighted
        sum is float32, rounded once."""
        native = self._native_experts(x)
        if native is not None:
            return kernels.moe_experts(x, experts, weights, *native, num_experts=self.num_experts)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        slot_weights = weights.reshape(-1)[order]
        out = torch.zeros(x.shape, dtype=torch.float32)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            y = self.expert(expert, x.index_select(0, rows))
            out.index_add_(0, rows, y.float() * slot_weights[start:start + n, None])
            start += n
        return out.to(x.dtype)

    def _native_experts(self, x: torch.Tensor) -> tuple | None:
        """``native_experts()`` when ``kernels.moe_experts`` takes ``x``: a few bf16 rows."""
        if not (x.dtype == torch.bfloat16 and x.shape[0] <= kernels.MOE_MAX_ROWS):
            return None
        return self.native_experts()

    def native_experts(self) -> tuple | None:
        """``kernels.moe_experts``' (fc, proj, activation, alpha, limit) for these experts when it
        takes them: an engine's quantized experts (the kernels' layout) and an activation it
        computes; else None."""
        if not (self.fused and self.fused_fc.quant_format is not None and self.proj.quant_format is not None):
            return None  # (an un-gated block is never fused)
        key = (self.fused_fc.weight.data_ptr(), self.proj.weight.data_ptr())  # reassigned together at load time
        if getattr(self, "_native_key", None) != key:
            self._native, self._native_key = self._native_weights(), key
        return self._native

    def _native_weights(self) -> tuple | None:
        if self.gated_act is None and self.act is F.silu:
            activation = ("silu", 0.0, 0.0)
        elif isinstance(self.gated_act, ClampedSwiGLU):
            activation = ("clamped_swiglu", self.gated_act.alpha, self.gated_act.limit)
        else:
            return None
        proj_bias = self.proj.bias if self.adds_proj_bias else None
        weights = [_expert_weights(linear.weight, linear.weights_scaling_factor,
                                   getattr(linear, "weights_offset", None), linear.quant_format, bias)
                   for linear, bias in ((self.fused_fc, self.fused_fc.bias), (self.proj, proj_bias))]
        return None if None in weights else (*weights, *activation)

    def _native_shared(self, x: torch.Tensor) -> tuple | None:
        """``native_shared()`` when ``x`` has at most ``SHARED_MAX_ROWS`` rows, else None."""
        return self.native_shared() if x.shape[0] <= kernels.SHARED_MAX_ROWS else None

    def routing_scale(self) -> float | None:
        """The factor this block's routing multiplies ``route``'s plain softmax top-k weights by
        (1.0 here), or None where a subclass routes otherwise (what the native decode step asks)."""
        return 1.0

    def native_shared(self) -> tuple | None:
        """The shared expert's (fc, proj) for ``kernels.moe_experts`` when it can join the routed
        experts' call (bias-free quantized linears in the kernels' layout, SiLU like the routed
        experts; the call takes it for up to ``SHARED_MAX_ROWS`` tokens); else None."""
        mlp = self.shared_expert
        if (not isinstance(mlp, GatedMLP) or not mlp.fused or mlp.act is not F.silu
                or mlp.fused_fc.quant_bits is None or mlp.proj.quant_bits is None):
            return None
        key = (mlp.fused_fc.weight.data_ptr(), mlp.proj.weight.data_ptr())
        if getattr(self, "_shared_key", None) != key:
            weights = []
            for linear in (mlp.fused_fc, mlp.proj):
                fmt = {"bits": linear.quant_bits, "codebook": linear.codebook, "group_size": linear.group_size,
                       "tile_order": linear.tile_order, "super_scales": linear.super_scales}
                plain = (linear.bias is None and not hasattr(linear, "prequant_scaling_factor")
                         and not hasattr(linear, "activation_scaling_factor"))
                offsets = getattr(linear, "weights_offset", None)
                weights.append(_expert_weights(linear.weight[None], linear.weights_scaling_factor[None],
                                               None if offsets is None else offsets[None], fmt, None)
                               if plain else None)
            self._shared, self._shared_key = (None if None in weights else tuple(weights)), key
        return self._shared

    def expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s output (this rank's partial sum) for rows ``x`` ``[n, hidden]``."""
        if not self.gated:
            return self._project(expert, self.act(_biased(self.fc, expert, x)))
        if self.fused:
            both = _biased(self.fused_fc, expert, x)
            if self.gated_act is None and self.act is F.silu and kernels.elementwise_supported(both):
                return self._project(expert, kernels.silu_mul(both))
            fc, gate = both.chunk(2, dim=-1)
        else:
            fc, gate = _biased(self.fc, expert, x), _biased(self.gate, expert, x)
        return self._project(expert, self.act(fc) * gate if self.gated_act is None else self.gated_act(fc, gate))

    def _project(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        y = self.proj.matmul(expert, h)
        return y + self.proj.bias[expert] if self.adds_proj_bias else y

    # -- checkpoints and engines --------------------------------------------------------------

    def use_external_layout(self, layout: str) -> None:
        """Name the experts' external tensors in ``layout`` (see ``LAYOUTS``)."""
        if layout not in LAYOUTS:
            raise ValueError(f"expert layout is one of {LAYOUTS}, not {layout!r}")
        n = self.names
        block = n.block if layout == "per_expert" else n.stacked_block
        self.router.external_key_map = {"mlp": block, "router": n.router}
        if self.fused:  # an engine loads kiln's own names only
            return
        projections = (("fc", n.fc), ("gate", n.gate), ("proj", n.proj))
        for name, external in projections if self.gated else projections[::2]:
            module = getattr(self, name)
            module.fused_part, module.stacked_source = None, layout != "per_expert"
            if layout == "per_expert":
                per_expert = [f"experts.{e}.{external}" for e in range(self.num_experts)]
                module.external_key_map = {"mlp": block, name: per_expert}
            elif layout == "per_projection":
                module.external_key_map = {"mlp": block, name: f"experts.{external}"}
            else:
                fused = n.FUSED_PROJ if name == "proj" else n.FUSED_FC_GATE
                module.external_key_map = {"mlp": block, name: fused, "weight": ""}
        if layout == "fused" and self.gated:
            self.fc.fused_part, self.gate.fused_part = (0, 2), (1, 2)

    def match_external_keys(self, external: set[str]) -> None:
        """Pick the layout of the checkpoint about to be loaded (see ``LAYOUTS``)."""
        self.use_external_layout(external_layout(external, self.names))

    def engine_weights(self, prefix: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fuse each expert's ``fc`` and ``gate`` rows into ``fused_fc`` (the shared expert,
        a GatedMLP, fuses its own)."""
        fused = {}
        # quantized experts: codes, scales, offsets row by row too (un-gated ones: nothing to fuse)
        for kind in ("bias", *QUANT_PARAMETERS) if self.gated else ():
            if f"{prefix}fc.{kind}" in weights:
                fc, gate = weights.pop(f"{prefix}fc.{kind}"), weights.pop(f"{prefix}gate.{kind}")
                fused[f"{prefix}fused_fc.{kind}"] = torch.cat([fc, gate], dim=1)
        return fused


def _expert_weights(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, fmt: dict,
                    bias: torch.Tensor | None) -> object | None:
    """``kernels.expert_weights`` over stacked engine tensors (``[E, ...]`` each) in format ``fmt``
    (its ``bits``, ``codebook``, ``super_scales``, ``group_size``, ``tile_order``), or None when the native call
    cannot read them."""
    if not (fmt["tile_order"] and fmt["bits"] in (4, 6, 8) and kernels.moe_experts_supported()
            and (bias is None or bias.dtype == torch.bfloat16)):
        return None
    bits = kernels.quant_bits_arg(fmt["bits"], fmt["codebook"], fmt["super_scales"])
    return kernels.expert_weights(codes, scales, offsets, bias, bits,
                                  kernels.quant_kernel_group(scales[0], fmt["group_size"]))


def _biased(linear: ExpertLinear, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``x W_e^T (+ b_e)``: an expert projection of ``linear``, with its bias where it has one."""
    y = linear.matmul(expert, x)
    return y if linear.bias is None else y + linear.bias[expert]


def shared_partial(mlp: GatedMLP | MLP, x: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """``mlp(x)`` before its all-reduce (this rank's partial sum; the output bias on rank 0 only)."""
    bias = mlp.proj.bias if tp_rank == 0 else None
    if isinstance(mlp, MLP):
        return mlp.proj.matmul(mlp.act(mlp.fc(x)), bias)
    if mlp.fused:
        both = mlp.fused_fc(x)
        if mlp.act is F.silu and kernels.elementwise_supported(both):
            return mlp.proj.matmul(kernels.silu_mul(both), bias)
        fc, gate = both.chunk(2, dim=-1)
    else:
        fc, gate = mlp.fc(x), mlp.gate(x)
    return mlp.proj.matmul(mlp.act(fc) * gate, bias)


def check_expert_config(num_experts: int, top_k: int, intermediate_size: int, tp_size: int, *,
                        experts_field: str, top_k_field: str, intermediate_field: str) -> None:
    """Raise :class:`ConfigError`, naming the Hugging Face field, for expert settings kiln cannot run."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ConfigError(f"{experts_field} must be a positive integer, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ConfigError(f"{top_k_field} must be between 1 and {experts_field} ({num_experts}), got {top_k!r}")
    if intermediate_size % tp_size:
        raise ConfigError(f"{intermediate_field} ({intermediate_size}) is not divisible by tp_size ({tp_size}): "
                          "every rank holds an equal slice of each expert")
