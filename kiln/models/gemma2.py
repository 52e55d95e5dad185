"""Gemma 2: Gemma's layout (GeGLU, (1 + w) RMSNorm, embeddings times sqrt(hidden_size), tied
LM head) with four norms per layer (the attention's and the MLP's outputs are normalised
too, before their residual adds), a sliding window on alternate layers, attention and final
logit soft-capping, and the attention scale ``query_pre_attn_scalar ** -0.5``."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.models.gemma import GemmaForCausalLM
from kiln.models.hf_config import hf_get, hf_sliding_window, rope_decoder_config
from kiln.models.registry import register_model


@register_model("Gemma2ForCausalLM")
class Gemma2ForCausalLM(GemmaForCausalLM):
    sublayer_norms = "pre_and_post"  # four norms a layer (kiln's post_layernorm: the attention output's)
    hf_key_map = {}  # LLaMA's names; the two feed-forward norms keep theirs

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("Gemma 2 config field 'use_bidirectional_attention' (an encoder) is not supported")
        layers = hf_get(hf, "num_hidden_layers")
        bias = bool(hf.get("attention_bias", False))
        return rope_decoder_config(
            hf, dtype, mapping, "Gemma2ForCausalLM", tied_default=True,
            hidden_act=hf_get(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
            extra={"attn_bias": bias, "dense_bias": bias,
                   "embedding_multiplier": float(hf_get(hf, "hidden_size")) ** 0.5,
                   "query_pre_attn_scalar": hf_get(hf, "query_pre_attn_scalar"),
                   "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
                   "final_logit_softcapping": hf.get("final_logit_softcapping"),
                   # Configs without layer_types: the even layers slide (0, 2, ...), as Gemma 2 always did.
                   **hf_sliding_window(hf, default_types=[
                       "full_attention" if i % 2 else "sliding_attention" for i in range(layers)])})
