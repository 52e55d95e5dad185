"""EXAONE 4: OLMo 2's layer (output norms only, no input norms) with Qwen3's per-head q/k
RMSNorm; hybrid attention (sliding windows on the layers ``layer_types`` names) where the
full-attention layers apply no rotary."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.decoder import LAYER_TYPES
from kiln.models.hf_config import hf_get, hf_sliding_window, rope_decoder_config
from kiln.models.registry import register_model


@register_model("Exaone4ForCausalLM")
class Exaone4ForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    sublayer_norms = "post"
    hf_key_map = {}  # LLaMA's names

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        layers = hf_get(hf, "num_hidden_layers")
        window = hf_sliding_window(hf)
        types = window["layer_types"] or [LAYER_TYPES[0]] * layers
        # With a window configured, only the sliding layers are rotary (EXAONE 4's global layers are NoPE).
        nope = [i for i, kind in enumerate(types) if kind == "full_attention"] if window["sliding_window"] else []
        return rope_decoder_config(hf, dtype, mapping, "Exaone4ForCausalLM", extra={
            "attn_bias": False, "dense_bias": False, "sublayer_norms": "post", "qk_norm": True,
            "nope_layers": nope, **window})
