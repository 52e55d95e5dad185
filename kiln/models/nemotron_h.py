"""Nemotron-H (``NemotronHForCausalLM``): every layer is one block with its own pre-norm and
residual, ``h += block(norm(h))``, the block being what ``hybrid_override_pattern`` (or
transformers 5's ``layers_block_type``) says for it:

    M  mamba               Mamba2 (kiln.layers.mamba2): keeps a state, no K/V
    *  full_attention      grouped-query attention without positions (NoPE): keeps K/V
    -  mlp                 up_proj -> relu^2 -> down_proj (no gate): keeps nothing
    E  moe                 experts (Nemotron 3): keeps nothing

An ``E`` block (kiln.layers.moe, un-gated experts) routes each token by ``s = sigmoid(gate(h))``
(float32, as Hugging Face keeps the router): the top ``num_experts_per_tok`` experts by ``s +
e_score_correction_bias``, among the ``topk_group`` best of ``n_group`` groups (a group scored
by its two best) where ``n_group`` > 1; each weighted by its ``s``, renormalised with
``norm_topk_prob``, times ``routed_scaling_factor``. Experts are ``down_proj(relu^2(up_proj x))``
of ``moe_intermediate_size``, on ``h`` itself or, with ``moe_latent_size``, on
``fc1_latent_proj(h)`` with their sum taken back by ``fc2_latent_proj``; a shared expert of
``moe_shared_expert_intermediate_size`` (the same MLP as ``-``) sees every token.

Hugging Face names every block ``mixer`` under ``backbone.layers.N`` beside its ``norm``; the
embedding is ``backbone.embeddings``, the final norm ``backbone.norm_f``; an ``E`` block's
router is ``mixer.gate``, its experts ``mixer.experts.{e}.{up,down}_proj`` (a GGUF file's
stacked: ``mixer.experts.{up,down}_proj``), its shared expert ``mixer.shared_experts``. The
multi-token-prediction layers some checkpoints carry (``mtp.*``) are not read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln import distributed
from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.attention import Attention
from kiln.layers.mlp import MLP
from kiln.layers.moe import ExpertNames, MixtureOfExperts, ReplicatedLinear, check_expert_config, shared_partial
from kiln.layers.rotary import RotaryEmbedding
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.decoder import attention_settings, layer_type
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.hybrid import mamba_mixer
from kiln.models.registry import register_model

_PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}
# Layer kinds by the names transformers 5 (and the converter's older configs) use.
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
          "full_attention": "full_attention", "mlp": "mlp", "moe": "moe"}
# An E block's names: the router mixer.gate, un-gated experts' up_proj / down_proj, all under
# mixer (stacked ones too: the GGUF reader names them so).
_EXPERT_NAMES = ExpertNames(block="mixer", stacked_block="mixer", router="gate", fc="up_proj", gate="",
                            proj="down_proj")


class NemotronHExperts(MixtureOfExperts):
    """Nemotron-H's ``E`` block (see the module docstring): un-gated experts, optionally in a
    latent width, a shared MLP, sigmoid routing with a correction bias and expert groups. The
    router (weight and ``router.e_score_correction_bias``) is float32 whatever the model's dtype."""

    def __init__(self, config: PretrainedConfig, engine_layout: bool):
        dtype, tp, bias = torch_dtype(config.dtype), config.mapping, bool(config.get("mlp_bias", False))
        latent, experts = config.get("moe_latent_size"), config.num_experts
        super().__init__(config.hidden_size, config.moe_intermediate_size, experts, config.num_experts_per_tok,
                         config.hidden_act, normalize_top_k=config.norm_topk_prob,
                         shared_intermediate_size=config.moe_shared_expert_intermediate_size, names=_EXPERT_NAMES,
                         dtype=dtype, tp_size=tp.tp_size, tp_rank=tp.tp_rank, fused=engine_layout, gated=False,
                         expert_hidden_size=latent, shared_bias=bias)
        self.router.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32),
                                          requires_grad=False)
        self.router.e_score_correction_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32),
                                                           requires_grad=False)
        self.router.keeps_float32 = True  # in an engine of any dtype (kiln.build)
        self.routed_scaling_factor = config.routed_scaling_factor
        groups = config.get("expert_groups")
        self.groups = tuple(groups) if groups else None
        # Latent projections: replicated (every rank's experts read the whole latent vector).
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent:
            self.fc1_latent_proj = ReplicatedLinear(config.hidden_size, latent, bias=bias, dtype=dtype)
            self.fc2_latent_proj = ReplicatedLinear(latent, config.hidden_size, bias=bias, dtype=dtype)

    def routing_scale(self) -> float | None:
        return None  # sigmoid routing: not the native decode step's softmax

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 ``[n, top_k]``, expert ids ``[n, top_k]``) for router logits ``[n, E]``."""
        scores = torch.sigmoid(router_logits.float())
        choice = scores + self.router.e_score_correction_bias.float()  # picks experts; weights stay scores
        if self.groups is not None:
            n_group, topk_group = self.groups
            per_group = self.num_experts // n_group
            best = choice.view(-1, n_group, per_group).topk(2, dim=-1).values.sum(dim=-1)  # [n, n_group]
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize_top_k:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:
        """The routed experts' sum (through the latent projections where there are some) plus the
        shared expert's output, one all-reduce for both (``lora``: the MLP interface's only)."""
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        weights, experts = self.route(self.router(x.float()))
        if self.fc1_latent_proj is None:
            out = self.routed(x, weights, experts)
        else:
            out = self.routed(self.fc1_latent_proj(x), weights, experts)
            up = self.fc2_latent_proj  # linear: each rank takes its partial sum up, the bias on rank 0
            out = F.linear(out, up.weight, up.bias if self.tp_rank == 0 else None)
        out = out + shared_partial(self.shared_expert, x, self.tp_rank)
        return distributed.all_reduce(out, self.tp_size).view(shape)


class NemotronHLayer(nn.Module):
    """One Nemotron-H layer: ``h + block(input_layernorm(h))``, the block a Mamba2 ``mixer``, an
    ``attention`` or an ``mlp`` (an MLP or experts) by the layer's kind (the others None). A Mamba2
    layer keeps its state, a feed-forward layer an empty one (``keeps_state``: neither keeps K/V)."""

    native_decode_shape = False

    def __init__(self, model_cls: type, config: PretrainedConfig, layer_idx: int,
                 rotary: RotaryEmbedding | None, engine_layout: bool):
        super().__init__()
        dtype, tp = torch_dtype(config.dtype), config.mapping
        self.kind = layer_type(config, layer_idx)
        self.keeps_state = self.kind != "full_attention"
        self.input_layernorm = model_cls.make_norm(config, dtype)
        self.mixer = mamba_mixer(config, layer_idx) if self.kind == "mamba" else None
        self.mlp = self.attention = None
        if self.kind == "moe":
            self.mlp = NemotronHExperts(config, engine_layout)
        elif self.kind == "mlp":
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           bool(config.get("mlp_bias", False)), dtype=dtype, tp_size=tp.tp_size, tp_rank=tp.tp_rank)
        elif self.kind == "full_attention":
            bias = bool(config.get("attn_bias", False))
            self.attention = Attention(layer_idx, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, config.head_size, qkv_bias=bias, dense_bias=bias,
                                       rotary=None, dtype=dtype, tp_size=tp.tp_size, tp_rank=tp.tp_rank,
                                       **attention_settings(config, layer_idx))

    def state_spec(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Its state parts per sequence: the mixer's, or none."""
        return self.mixer.state_spec() if self.mixer is not None else []

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, cache) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.mixer is not None:
            return hidden + self.mixer(normed, positions, metadata, cache)
        if self.attention is not None:
            return hidden + self.attention(normed, positions, metadata, cache)
        return hidden + self.mlp(normed, metadata.lora)


def nemotron_h_layer_types(hf: dict) -> list[str]:
    """Each layer's kind from ``hybrid_override_pattern`` (a character a layer) or
    ``layers_block_type``."""
    pattern = hf.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if set(pattern) - set(_PATTERN):
            raise ConfigError(f"hybrid_override_pattern {pattern!r} holds characters other than {sorted(_PATTERN)}")
        kinds = [_PATTERN[c] for c in pattern]
    else:
        names = hf_get(hf, "layers_block_type", "layer_types")
        if not isinstance(names, list) or any(n not in _KINDS for n in names):
            raise ConfigError(f"layers_block_type must list one of {sorted(_KINDS)} per layer, got {names!r}")
        kinds = [_KINDS[n] for n in names]
    return kinds


@register_model("NemotronHForCausalLM")
class NemotronHForCausalLM(DecoderModelForCausalLM):
    gated_mlp = False
    decoder_layer = NemotronHLayer
    hf_key_map = {"transformer": "backbone", "vocab_embedding": "embeddings", "ln_f": "norm_f",
                  "input_layernorm": "norm", "attention": "mixer", "mlp": "mixer", "fc": "up_proj",
                  "proj": "down_proj", "shared_expert": "shared_experts"}

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        kinds = nemotron_h_layer_types(hf)  # (residual_in_fp32: Hugging Face's blocks do not read it either)
        heads = hf_get(hf, "mamba_num_heads")
        head_dim = hf_get(hf, "head_dim", "attention_head_dim", default=hf["hidden_size"] // hf["num_attention_heads"])
        bias = bool(hf.get("attention_bias", False))
        fields = {**hf, "num_hidden_layers": len(kinds), "head_dim": head_dim}
        return rope_decoder_config(
            fields, dtype, mapping, "NemotronHForCausalLM", hidden_act=hf.get("mlp_hidden_act") or "relu2",
            norm_epsilon=float(hf_get(hf, "layer_norm_epsilon", default=1e-5)), extra={
                "attn_bias": bias, "dense_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False)),
                "layer_types": kinds, "nope_layers": list(range(len(kinds))),
                **(_expert_fields(hf, mapping) if "moe" in kinds else {}),
                "mamba_num_heads": heads, "mamba_head_dim": hf_get(hf, "mamba_head_dim"),
                "mamba_state_size": hf_get(hf, "ssm_state_size"),
                "mamba_groups": hf_get(hf, "n_groups", "mamba_n_groups", default=1),
                "mamba_conv_kernel": hf_get(hf, "conv_kernel", "mamba_d_conv", default=4),
                "mamba_conv_bias": bool(hf_get(hf, "use_conv_bias", "mamba_conv_bias", default=True)),
                "mamba_proj_bias": bool(hf.get("use_bias", False)),
                # Hugging Face's mixer: the lower limit is time_step_min, whatever time_step_limit says
                "mamba_time_step_limit": [float(hf_get(hf, "time_step_min", "mamba_dt_min", default=0.001)), None]})


def _expert_fields(hf: dict, mapping: Mapping) -> dict:
    """The ``E`` blocks' config fields (checked against what Hugging Face's NemotronH computes)."""
    experts, top_k = hf_get(hf, "n_routed_experts", "num_local_experts"), hf_get(hf, "num_experts_per_tok")
    inter = hf_get(hf, "moe_intermediate_size")
    check_expert_config(experts, top_k, inter, mapping.tp_size, experts_field="n_routed_experts",
                        top_k_field="num_experts_per_tok", intermediate_field="moe_intermediate_size")
    # (Hugging Face's shared expert falls back to intermediate_size; n_shared_experts is not read)
    shared = hf.get("moe_shared_expert_intermediate_size") or hf_get(hf, "intermediate_size")
    if shared % mapping.tp_size:
        raise ConfigError(f"moe_shared_expert_intermediate_size ({shared}) is not divisible by "
                          f"tp_size ({mapping.tp_size})")
    latent = hf.get("moe_latent_size")
    if latent is not None and (not isinstance(latent, int) or latent < 1):
        raise ConfigError(f"moe_latent_size must be a positive integer or null, got {latent!r}")
    n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if not isinstance(n_group, int) or n_group < 1 or experts % n_group or (n_group > 1 and experts // n_group < 2):
        raise ConfigError(f"n_group must divide n_routed_experts ({experts}) into groups of at least 2 experts "
                          f"(a group scores by its two best), got {n_group!r}")
    if n_group > 1 and (not isinstance(topk_group, int) or not 1 <= topk_group <= n_group
                        or top_k > topk_group * (experts // n_group)):
        raise ConfigError(f"topk_group must be between 1 and n_group ({n_group}) and its groups must hold "
                          f"num_experts_per_tok ({top_k}) experts, got {topk_group!r}")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
            "moe_shared_expert_intermediate_size": shared, "moe_latent_size": latent,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "routed_scaling_factor": float(hf_get(hf, "routed_scaling_factor", default=1.0)),
            "expert_groups": [n_group, topk_group] if n_group > 1 else None}
