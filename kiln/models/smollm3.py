"""SmolLM3: the LLaMA layout with rotary left out of some layers (``no_rope_layers``: 0 for a
layer without rotary, every fourth in the released model) and an optional sliding window on
the layers ``layer_types`` names."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.models.hf_config import hf_get, hf_sliding_window, rope_decoder_config
from kiln.models.llama import LlamaForCausalLM
from kiln.models.registry import register_model


@register_model("SmolLM3ForCausalLM")
class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        layers = hf_get(hf, "num_hidden_layers")
        interval = hf_get(hf, "no_rope_layer_interval", default=4)
        flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        if len(flags) != layers:
            raise ConfigError(f"SmolLM3 config field 'no_rope_layers' must have one flag per layer ({layers}), "
                              f"got {len(flags)}")
        window = hf_sliding_window(hf) if hf.get("use_sliding_window") else {"sliding_window": None,
                                                                              "layer_types": None}
        bias = bool(hf.get("attention_bias", False))
        return rope_decoder_config(hf, dtype, mapping, "SmolLM3ForCausalLM", extra={
            "attn_bias": bias, "dense_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False)),
            "nope_layers": [i for i, uses_rope in enumerate(flags) if not uses_rope], **window})
