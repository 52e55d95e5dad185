"""GLM-4 (0414): four norms a layer like Gemma 2 (``post_self_attn_layernorm`` on the attention
output, ``post_attention_layernorm`` before the MLP, ``post_mlp_layernorm`` on its output),
Phi-3's fused ``gate_up_proj``, q/k/v biases, and rotary on the first half of each head over
adjacent dimension pairs (rows reordered on conversion, as for GPT-J)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_partial_rotary, rope_decoder_config
from kiln.models.registry import register_model


@register_model("Glm4ForCausalLM")
class Glm4ForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    sublayer_norms = "pre_and_post"
    hf_key_map = {"fc": "gate_up_proj", "gate": "gate_up_proj", "post_layernorm": "post_self_attn_layernorm",
                  "pre_feedforward_layernorm": "post_attention_layernorm",
                  "post_feedforward_layernorm": "post_mlp_layernorm"}

    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__(config, engine_layout)
        for layer in self.transformer.layers.values():
            layer.attention.qkv.adjacent_rotary_dims = int(config.head_size * config.rotary_pct)
            if not engine_layout:  # loading from Hugging Face: fc and gate are the halves of gate_up_proj
                layer.mlp.fc.fused_part, layer.mlp.gate.fused_part = (0, 2), (1, 2)

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return rope_decoder_config(hf, dtype, mapping, "Glm4ForCausalLM", extra={
            "attn_bias": bool(hf.get("attention_bias", True)), "dense_bias": False,
            "rotary_pct": hf_partial_rotary({"partial_rotary_factor": 0.5, **hf}), "sublayer_norms": "pre_and_post"})
