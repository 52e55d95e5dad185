"""Phi-3 and Phi-4-mini: the LLaMA layout with its projections fused in the checkpoint
(``qkv_proj``, and ``gate_up_proj`` holding the gate's rows then the up projection's), optional
partial rotary (Phi-4-mini: 3/4 of each head) with LongRoPE scaling, and a sliding window on
every layer where the config sets one."""
from __future__ import annotations

import dataclasses

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.hf_config import hf_partial_rotary
from kiln.models.llama import LlamaForCausalLM
from kiln.models.registry import register_model


@register_model("Phi3ForCausalLM")
class Phi3ForCausalLM(LlamaForCausalLM):
    hf_key_map = {"qkv": "qkv_proj", "fc": "gate_up_proj", "gate": "gate_up_proj"}

    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__(config, engine_layout)
        if not engine_layout:  # loading from Hugging Face: fc and gate are the halves of gate_up_proj
            for layer in self.transformer.layers.values():
                layer.mlp.fc.fused_part, layer.mlp.gate.fused_part = (0, 2), (1, 2)

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        config = super().config_from_hf(hf, dtype, mapping)
        extra = dict(config.extra, rotary_pct=hf_partial_rotary(hf), attn_bias=False, dense_bias=False,
                     mlp_bias=False, sliding_window=hf.get("sliding_window"), layer_types=None)
        return dataclasses.replace(config, architecture="Phi3ForCausalLM", extra=extra)
