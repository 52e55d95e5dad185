"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm, no biases)
with Qwen2-MoE's sparse layers minus the shared expert: ``num_experts`` SiLU-gated experts,
``num_experts_per_tok`` per token (softmax weights, renormalised over the chosen ones with
``norm_topk_prob``), dense layers where ``decoder_sparse_step`` / ``mlp_only_layers`` say, and
a sliding window on every layer when ``use_sliding_window`` is set."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.layers.moe import check_expert_config
from kiln.mapping import Mapping
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.qwen2_moe import Qwen2MoeForCausalLM
from kiln.models.registry import register_model


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen2-MoE's blocks (its ``make_mlp``); the config records no shared expert."""

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        experts, top_k = hf_get(hf, "num_experts", "num_local_experts"), hf_get(hf, "num_experts_per_tok")
        moe_inter = hf_get(hf, "moe_intermediate_size")
        step = hf_get(hf, "decoder_sparse_step", default=1)
        if not isinstance(step, int) or step < 1:
            raise ConfigError(f"decoder_sparse_step must be a positive integer, got {step!r}")
        if experts:
            check_expert_config(experts, top_k, moe_inter, mapping.tp_size, experts_field="num_experts",
                                top_k_field="num_experts_per_tok", intermediate_field="moe_intermediate_size")
        bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        return rope_decoder_config(hf, dtype, mapping, "Qwen3MoeForCausalLM", extra={
            "attn_bias": bias, "dense_bias": bias, "qk_norm": True, "sliding_window": window,
            "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe_inter,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "decoder_sparse_step": step,
            "mlp_only_layers": list(hf.get("mlp_only_layers") or [])})
