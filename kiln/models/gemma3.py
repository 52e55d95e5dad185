"""Gemma 3 (text): Gemma 2's layer (four norms, (1 + w) RMSNorms, GeGLU, embeddings times
sqrt(hidden_size), ``query_pre_attn_scalar``) with per-head q/k norms of the same kind, five
sliding-window layers to one global (``layer_types``), each kind with its own rotary settings
(local base 10k; global 1M with linear scaling), and no soft-capping unless the config asks.

``Gemma3ForConditionalGeneration`` checkpoints (the 4B-27B releases) hold the same language
model under ``language_model.model`` (or ``model.language_model``) beside a vision tower, which is not read: kiln serves the
text model (the engine takes token ids, as for LLaVA; see docs/models.md).
"""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.models.gemma import GemmaForCausalLM
from kiln.models.hf_config import hf_get, hf_sliding_window, nested_text_config, rope_decoder_config
from kiln.models.key_maps import NestedLanguageModel
from kiln.models.registry import register_model


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(GemmaForCausalLM):
    sublayer_norms = "pre_and_post"
    hf_key_map = {}  # LLaMA's names; the feed-forward norms and q/k norms keep theirs

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("Gemma 3 config field 'use_bidirectional_attention' (an encoder) is not supported")
        layers, pattern = hf_get(hf, "num_hidden_layers"), hf.get("sliding_window_pattern", 6)
        bias = bool(hf.get("attention_bias", False))
        return rope_decoder_config(
            hf, dtype, mapping, "Gemma3ForCausalLM", tied_default=True,
            hidden_act=hf_get(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
            extra={"attn_bias": bias, "dense_bias": bias, "qk_norm": True, "sublayer_norms": "pre_and_post",
                   "embedding_multiplier": float(hf_get(hf, "hidden_size")) ** 0.5,
                   "query_pre_attn_scalar": hf_get(hf, "query_pre_attn_scalar"),
                   "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
                   "final_logit_softcapping": hf.get("final_logit_softcapping"),
                   **hf_sliding_window(hf, default_types=[
                       "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)])})


@register_model("Gemma3ForConditionalGeneration")
class Gemma3LanguageModel(NestedLanguageModel, Gemma3ForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return nested_text_config(super().config_from_hf, hf, dtype, mapping, "Gemma3ForConditionalGeneration")
