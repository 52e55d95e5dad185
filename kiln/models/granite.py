"""Granite 3: the LLaMA layout with four scalar multipliers: the token embeddings
(``embedding_multiplier``), the attention scale (``attention_multiplier`` replaces
``head_size ** -0.5``), each block's output before its residual add (``residual_multiplier``)
and the logits (divided by ``logits_scaling``)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import rope_decoder_config
from kiln.models.registry import register_model


@register_model("GraniteForCausalLM")
class GraniteForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # LLaMA's names

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        bias = bool(hf.get("attention_bias", False))

        def multiplier(name: str) -> float | None:  # 1 is no multiplier at all
            value = float(hf.get(name, 1.0))
            return None if value == 1.0 else value

        return rope_decoder_config(hf, dtype, mapping, "GraniteForCausalLM", extra={
            "attn_bias": bias, "dense_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False)),
            "embedding_multiplier": multiplier("embedding_multiplier"),
            "attention_multiplier": float(hf.get("attention_multiplier", 1.0)),
            "residual_multiplier": multiplier("residual_multiplier"), "logits_scaling": multiplier("logits_scaling")})
