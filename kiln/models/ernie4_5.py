"""ERNIE 4.5 (dense): the LLaMA layout with rotary over adjacent dimension pairs (GPT-J's
pairing, applied like GLM's) and one ``use_bias`` switch for every linear's bias.

As for GPT-J, each q and k head's rows are reordered on conversion (even dims, then odd), so
kiln's rotate-half rotary computes ERNIE's q.k exactly (``adjacent_rotary_dims``)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import rope_decoder_config
from kiln.models.registry import register_model


@register_model("Ernie4_5ForCausalLM")
class Ernie4_5ForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # LLaMA's names

    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__(config, engine_layout)
        for layer in self.transformer.layers.values():
            layer.attention.qkv.adjacent_rotary_dims = config.head_size

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        bias = bool(hf.get("use_bias", False))
        return rope_decoder_config(hf, dtype, mapping, "Ernie4_5ForCausalLM", extra={
            "attn_bias": bias, "dense_bias": bias, "mlp_bias": bias})
