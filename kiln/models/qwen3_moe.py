"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm, no biases)
with Qwen2-MoE's sparse layers minus the shared expert: ``num_experts`` SiLU-gated experts,
``num_experts_per_tok`` per token (softmax weights, renormalised over the chosen ones with
``norm_topk_prob``), dense layers where ``decoder_sparse_step`` / ``mlp_only_layers`` say, and
a sliding window on every layer when ``use_sliding_window`` is set."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.hf_config import rope_decoder_config
from kiln.models.qwen2_moe import Qwen2MoeForCausalLM, qwen_moe_fields
from kiln.models.registry import register_model


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen2-MoE's blocks (its ``make_mlp``); the config records no shared expert."""

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        bias = bool(hf.get("attention_bias", False))
        return rope_decoder_config(hf, dtype, mapping, "Qwen3MoeForCausalLM", extra={
            "attn_bias": bias, "dense_bias": bias, "qk_norm": True, **qwen_moe_fields(hf, mapping)})
