"""Phi-2 (``PhiForCausalLM``): attention and MLP in parallel off one shared LayerNorm, biases
everywhere (q/k/v, ``dense``, the gelu_new MLP, the lm_head), partial rotary
(``partial_rotary_factor``), and optionally a LayerNorm on each query and key head
(``qk_layernorm``)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.layers.normalization import LayerNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, hf_partial_rotary, rope_decoder_config
from kiln.models.registry import register_model


@register_model("PhiForCausalLM")
class PhiForCausalLM(DecoderModelForCausalLM):
    norm_class = LayerNorm
    gated_mlp = False
    hf_key_map = {
        "qkv": ["q_proj", "k_proj", "v_proj"],
        "dense": "dense",
        "q_norm": "q_layernorm",
        "k_norm": "k_layernorm",
        "fc": "fc1",
        "proj": "fc2",
        "ln_f": "final_layernorm",
    }

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        if hf.get("model_type") == "phi-msft":
            raise ConfigError("model_type 'phi-msft' (Phi's original remote-code checkpoints: transformer.embd, "
                              "mixer.Wqkv) is not supported; use the transformers-format checkpoint")
        qk_layernorm = bool(hf.get("qk_layernorm", False))
        return rope_decoder_config(
            hf, dtype, mapping, "PhiForCausalLM", hidden_act=hf_get(hf, "hidden_act", default="gelu_new"),
            norm_epsilon=float(hf_get(hf, "layer_norm_eps", default=1e-5)),
            extra={"rotary_pct": hf_partial_rotary(hf), "attn_bias": True, "dense_bias": True, "mlp_bias": True,
                   "lm_head_bias": True, "parallel_residual": True, "shared_layernorm": True,
                   "qk_norm": qk_layernorm, "qk_layernorm": qk_layernorm})
