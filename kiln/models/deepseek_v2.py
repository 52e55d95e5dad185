"""DeepSeek-V2 and -Lite: multi-head latent attention (kiln/layers/mla.py) over a latent KV
cache (kiln/step/latent_attention.py), and DeepSeekMoE.

* Attention: ``q_proj`` (``q_lora_rank`` null: V2-Lite) or ``q_a_proj`` -> ``q_a_layernorm`` ->
  ``q_b_proj``; ``kv_a_proj_with_mqa`` -> the compressed latent (``kv_lora_rank``, then
  ``kv_a_layernorm``) and one rotary key (``qk_rope_head_dim``) every head shares; ``kv_b_proj``
  -> each head's ``k_nope`` and ``v``. Rotary covers the rope dims only, in adjacent pairs (rows
  reordered on loading); softmax scale ``(qk_nope + qk_rope) ** -0.5``, times ``mscale ** 2`` for
  YaRN with ``mscale_all_dim`` (as Hugging Face's ``yarn_apply_mscale``). The cache holds
  ``kv_lora_rank + qk_rope_head_dim`` values per token and layer.
* Feed-forward: dense SiLU-gated MLPs on the first ``first_k_dense_replace`` layers, then
  ``n_routed_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token:
  softmax over all, the top ones (``topk_method`` ``greedy``, or ``group_limited_greedy``: only
  experts of the ``topk_group`` groups of ``n_group`` with the highest best score), weights
  times ``routed_scaling_factor`` (not renormalised); plus ``n_shared_experts`` shared experts
  as one un-gated MLP of ``n_shared_experts * moe_intermediate_size``.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.mla import MultiHeadLatentAttention
from kiln.layers.moe import MixtureOfExperts, check_expert_config
from kiln.layers.rotary import RotaryEmbedding
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.registry import register_model
from kiln.step.latent_attention import latent_attention


class DeepseekV2Experts(MixtureOfExperts):
    """DeepSeekMoE routing: the top-k softmax probabilities (within the best ``groups`` where
    set: ``(n_group, topk_group)``) times ``routed_scaling_factor``."""

    def __init__(self, *args, routed_scaling_factor: float, groups: tuple[int, int] | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.routed_scaling_factor, self.groups = routed_scaling_factor, groups

    def routing_scale(self) -> float | None:
        return self.routed_scaling_factor if self.groups is None else None

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.groups is None:  # the plain softmax top-k (natively where it can), scaled
            weights, experts = super().route(router_logits)
            return weights * self.routed_scaling_factor, experts
        # group_limited_greedy: experts of the topk_group best groups only
        probs = torch.softmax(router_logits.float(), dim=-1)
        n_group, topk_group = self.groups
        best = probs.view(-1, n_group, self.num_experts // n_group).amax(dim=-1)  # [n, n_group]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(topk_group, dim=-1).indices, True)
        probs = probs.masked_fill(~keep.repeat_interleave(self.num_experts // n_group, dim=1), 0.0)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return weights * self.routed_scaling_factor, experts


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm, sequential: ``h += attn(ln1(h)); h += mlp(ln2(h))``, with latent attention."""

    native_decode_shape = True  # kiln.models.native_decode computes it (latent attention included)

    def __init__(self, model_cls: type, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding | None,
                 engine_layout: bool):
        super().__init__()
        dtype, tp = torch_dtype(config.dtype), config.mapping
        self.input_layernorm = model_cls.make_norm(config, dtype)
        self.attention = MultiHeadLatentAttention(
            layer_idx, config.hidden_size, config.num_attention_heads, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rotary=rotary,
            scale=softmax_scale(config), attend=latent_attention, bias=config.attn_bias, engine_layout=engine_layout,
            dtype=dtype, tp_size=tp.tp_size, tp_rank=tp.tp_rank)
        self.post_layernorm = model_cls.make_norm(config, dtype)
        self.mlp = model_cls.make_mlp(config, layer_idx, engine_layout)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, kv_cache) -> torch.Tensor:
        hidden = hidden + self.attention(self.input_layernorm(hidden), positions, metadata, kv_cache)
        return hidden + self.mlp(self.post_layernorm(hidden), metadata.lora)


def softmax_scale(config: PretrainedConfig) -> float:
    """``(qk_nope + qk_rope) ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.get("rotary_scaling") or {}
    m_all, factor = scaling.get("mscale_all_dim"), scaling.get("factor")
    if m_all and factor and factor > 1:
        scale *= (0.1 * m_all * math.log(factor) + 1.0) ** 2
    return scale


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    decoder_layer = DeepseekV2DecoderLayer
    hf_key_map = {"shared_expert": "shared_experts"}  # LLaMA's names elsewhere; MLA's keep theirs

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, engine_layout: bool) -> nn.Module:
        if layer_idx < config.first_k_dense_replace:
            return super().make_mlp(config, layer_idx, engine_layout)
        tp, groups = config.mapping, config.get("expert_groups")
        return DeepseekV2Experts(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            config.hidden_act, normalize_top_k=False,
            shared_intermediate_size=config.n_shared_experts * config.moe_intermediate_size,
            dtype=torch_dtype(config.dtype), tp_size=tp.tp_size, tp_rank=tp.tp_rank, fused=engine_layout,
            routed_scaling_factor=config.routed_scaling_factor, groups=tuple(groups) if groups else None)

    def assign_lora_targets(self) -> None:
        raise ConfigError("LoRA adapters are not supported for DeepseekV2ForCausalLM (multi-head latent attention)")

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        nope, rope = hf_get(hf, "qk_nope_head_dim"), hf_get(hf, "qk_rope_head_dim")
        if rope % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (rotary pairs), got {rope}")
        heads = hf_get(hf, "num_attention_heads")
        if hf.get("num_key_value_heads") not in (None, heads):
            raise ConfigError(f"num_key_value_heads ({hf['num_key_value_heads']}) must equal num_attention_heads "
                              f"({heads}): multi-head latent attention expands the latent for every head")
        if (hf.get("moe_layer_freq") or 1) != 1:
            raise ConfigError(f"moe_layer_freq {hf['moe_layer_freq']!r} is not supported (1: every layer after "
                              "first_k_dense_replace has experts)")
        if hf.get("norm_topk_prob"):
            raise ConfigError("norm_topk_prob true is not supported: Hugging Face's DeepseekV2 ignores it (weights "
                              "times routed_scaling_factor, not renormalised) while DeepSeek's own code renormalises")
        config = rope_decoder_config(hf, dtype, mapping, "DeepseekV2ForCausalLM", extra={
            "attn_bias": bool(hf.get("attention_bias", False)), "rotary_dim": rope,
            "q_lora_rank": hf.get("q_lora_rank"), "kv_lora_rank": hf_get(hf, "kv_lora_rank"),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": hf_get(hf, "v_head_dim"),
            "first_k_dense_replace": int(hf.get("first_k_dense_replace") or 0), **_moe_fields(hf, mapping)})
        return dataclasses.replace(config, num_key_value_heads=heads, head_size=nope + rope)


def _moe_fields(hf: dict, mapping: Mapping) -> dict:
    """The experts' config fields from a DeepSeek-V2 config (checked)."""
    experts, top_k = hf_get(hf, "n_routed_experts", "num_experts"), hf_get(hf, "num_experts_per_tok")
    moe_inter, shared = hf_get(hf, "moe_intermediate_size"), int(hf.get("n_shared_experts") or 0)
    check_expert_config(experts, top_k, moe_inter, mapping.tp_size, experts_field="n_routed_experts",
                        top_k_field="num_experts_per_tok", intermediate_field="moe_intermediate_size")
    method, groups = hf.get("topk_method") or "greedy", None
    if method == "group_limited_greedy":
        n_group, topk_group = hf.get("n_group"), hf.get("topk_group")
        if not isinstance(n_group, int) or n_group < 1 or experts % n_group:
            raise ConfigError(f"n_group must divide n_routed_experts ({experts}) for group_limited_greedy, "
                              f"got {n_group!r}")
        if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group or top_k > topk_group * experts // n_group:
            raise ConfigError(f"topk_group must be between 1 and n_group ({n_group}) and its groups must hold "
                              f"num_experts_per_tok ({top_k}) experts, got {topk_group!r}")
        groups = [n_group, topk_group]
    elif method != "greedy":
        raise ConfigError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe_inter,
            "n_shared_experts": shared, "expert_groups": groups,
            "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0)}
