"""OLMo 2 and OLMo 3: no norm before attention or the MLP; each block's output is normalised
before its residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``), and one
RMSNorm runs over the whole q and the whole k projection before rotary. OLMo 3 adds sliding
windows on the layers ``layer_types`` names (three of every four), with rotary settings per
layer type."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_sliding_window, rope_decoder_config
from kiln.models.registry import register_model


@register_model("Olmo2ForCausalLM", "Olmo3ForCausalLM")
class Olmo2ForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    sublayer_norms = "post"
    hf_key_map = {}  # LLaMA's names (post_attention_layernorm is the attention output's norm here)

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        architecture = (hf.get("architectures") or ["Olmo2ForCausalLM"])[0]
        bias = bool(hf.get("attention_bias", False))
        return rope_decoder_config(hf, dtype, mapping, architecture, extra={
            "attn_bias": bias, "dense_bias": bias, "sublayer_norms": "post", "qk_norm": True,
            "qk_norm_whole": True, **hf_sliding_window(hf)})
