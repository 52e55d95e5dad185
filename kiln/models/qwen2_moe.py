"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (qkv bias) with sparse layers of ``num_experts``
SiLU-gated experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token (softmax
weights, renormalised over the chosen ones only with ``norm_topk_prob``), plus a shared expert
of ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``
(kiln/layers/moe.py). Layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0`` and it
is not in ``mlp_only_layers``; the others have a dense MLP of ``intermediate_size``."""
from __future__ import annotations

from torch import nn

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.layers.moe import ExpertNames, MixtureOfExperts, check_expert_config
from kiln.mapping import Mapping
from kiln.dtypes import torch_dtype
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.registry import register_model


@register_model("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # LLaMA's names outside the experts
    expert_names = ExpertNames()  # mlp.gate router, experts.{e}.{gate,up,down}_proj

    @staticmethod
    def is_sparse(config: PretrainedConfig, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has experts (else a dense MLP)."""
        return (config.num_experts > 0 and layer_idx not in config.mlp_only_layers
                and (layer_idx + 1) % config.decoder_sparse_step == 0)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, engine_layout: bool) -> nn.Module:
        if not cls.is_sparse(config, layer_idx):
            return super().make_mlp(config, layer_idx, engine_layout)
        tp = config.mapping
        return MixtureOfExperts(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                config.num_experts_per_tok, config.hidden_act, normalize_top_k=config.norm_topk_prob,
                                shared_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
                                shared_expert_gate=True, names=cls.expert_names, dtype=torch_dtype(config.dtype),
                                tp_size=tp.tp_size, tp_rank=tp.tp_rank, fused=engine_layout)

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        fields = qwen_moe_fields(hf, mapping)
        shared_inter = hf_get(hf, "shared_expert_intermediate_size")
        if fields["num_experts"] and shared_inter % mapping.tp_size:
            raise ConfigError(f"shared_expert_intermediate_size ({shared_inter}) is not divisible by "
                              f"tp_size ({mapping.tp_size})")
        return rope_decoder_config(hf, dtype, mapping, "Qwen2MoeForCausalLM", extra={
            "attn_bias": bool(hf.get("qkv_bias", True)), "dense_bias": False,
            "shared_expert_intermediate_size": shared_inter, **fields})


def qwen_moe_fields(hf: dict, mapping: Mapping) -> dict:
    """The config fields of Qwen's sparse layers (Qwen2-MoE, Qwen3-MoE), checked: experts, top-k,
    their width, renormalisation, which layers are sparse, and the window (every layer's)."""
    experts, top_k = hf_get(hf, "num_experts", "num_local_experts"), hf_get(hf, "num_experts_per_tok")
    moe_inter = hf_get(hf, "moe_intermediate_size")
    step = hf_get(hf, "decoder_sparse_step", default=1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    if experts:
        check_expert_config(experts, top_k, moe_inter, mapping.tp_size, experts_field="num_experts",
                            top_k_field="num_experts_per_tok", intermediate_field="moe_intermediate_size")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe_inter,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "decoder_sparse_step": step,
            "mlp_only_layers": list(hf.get("mlp_only_layers") or []),
            "sliding_window": hf.get("sliding_window") if hf.get("use_sliding_window", False) else None}
