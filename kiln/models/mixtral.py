"""Mixtral: LLaMA attention (GQA, rope, optional sliding window) with a mixture of experts in
every layer: a ``block_sparse_moe.gate`` router picks ``num_experts_per_tok`` of
``num_local_experts`` SiLU-gated experts (w1 activated, w3 multiplied in, w2 out), weighted by
their softmax probabilities renormalised over the chosen ones (kiln/layers/moe.py).
``router_jitter_noise`` only applies in training and is ignored."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.layers.moe import ExpertNames, MixtureOfExperts, check_expert_config
from kiln.mapping import Mapping
from kiln.dtypes import torch_dtype
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.registry import register_model


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # LLaMA's names outside the experts
    expert_names = ExpertNames(block="block_sparse_moe", router="gate", fc="w1", gate="w3", proj="w2")

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, engine_layout: bool) -> MixtureOfExperts:
        tp = config.mapping
        return MixtureOfExperts(config.hidden_size, config.intermediate_size, config.num_experts,
                                config.num_experts_per_tok, config.hidden_act, normalize_top_k=True,
                                names=cls.expert_names, dtype=torch_dtype(config.dtype), tp_size=tp.tp_size,
                                tp_rank=tp.tp_rank, fused=engine_layout)

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        experts, top_k = hf_get(hf, "num_local_experts"), hf_get(hf, "num_experts_per_tok")
        check_expert_config(experts, top_k, hf_get(hf, "intermediate_size"), mapping.tp_size,
                            experts_field="num_local_experts", top_k_field="num_experts_per_tok",
                            intermediate_field="intermediate_size")
        return rope_decoder_config(hf, dtype, mapping, "MixtralForCausalLM", extra={
            "num_experts": experts, "num_experts_per_tok": top_k, "sliding_window": hf.get("sliding_window")})
