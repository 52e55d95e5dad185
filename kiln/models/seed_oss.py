"""Seed-OSS: the LLaMA layout with biases on q/k/v (``attention_bias``) and, separately, on the
attention output (``attention_out_bias``)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import rope_decoder_config
from kiln.models.registry import register_model


@register_model("SeedOssForCausalLM")
class SeedOssForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # LLaMA's names

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return rope_decoder_config(hf, dtype, mapping, "SeedOssForCausalLM", extra={
            "attn_bias": bool(hf.get("attention_bias", True)), "dense_bias": bool(hf.get("attention_out_bias", False)),
            "mlp_bias": bool(hf.get("mlp_bias", False))})
