"""Qwen3.5 (text), dense and MoE: three Gated DeltaNet layers (``kiln.layers.gated_delta_net``)
before every full-attention layer (``layer_types``, or ``full_attention_interval``).

* Attention: gated (each head's query rows followed by an output gate's: ``o * sigmoid(gate)``
  before ``o_proj``), per-head q/k norms, rotary on a quarter of each 256-wide head
  (``partial_rotary_factor``; the multimodal release's interleaved M-RoPE is plain rotary for
  text, where its three position ids are equal).
* Norms: ``(1 + w)`` RMSNorms (the Gemma form) everywhere but inside Gated DeltaNet, whose
  per-head output norm has a plain weight.
* MoE (``qwen3_5_moe_text``): Qwen2-MoE's block on every layer: ``num_experts`` experts, top
  ``num_experts_per_tok`` renormalised, and a shared expert scaled by ``sigmoid(shared_expert_gate)``.

``Qwen3_5ForConditionalGeneration`` checkpoints (the released models) hold the same language model
under ``model.language_model`` beside a vision tower, which is not read. A checkpoint's
multi-token-prediction layer (``mtp.*``: ``kiln.models.mtp``) is loaded when it has one, for
speculative decoding's ``mtp`` method.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.gated_delta_net import GatedDeltaNet
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.gemma import GemmaRmsNorm
from kiln.models.hf_config import hf_get, hf_partial_rotary, nested_text_config, rope_decoder_config
from kiln.models.hybrid import HybridModel
from kiln.models.key_maps import NestedLanguageModel
from kiln.models.mtp import MTP_KEY_MAP, MultiTokenPredictor, mtp_layer_count
from kiln.models.qwen2_moe import Qwen2MoeForCausalLM, qwen_moe_fields
from kiln.models.registry import register_model


def qwen3_5_config(hf: dict, dtype: str | None, mapping: Mapping, architecture: str, extra: dict) -> PretrainedConfig:
    layers = hf_get(hf, "num_hidden_layers")
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                      for i in range(layers)]
    bias = bool(hf.get("attention_bias", False))
    return rope_decoder_config(hf, dtype, mapping, architecture, extra={
        "attn_bias": bias, "dense_bias": bias, "qk_norm": True, "attn_output_gate": True, "layer_types": list(types),
        "rotary_pct": hf_partial_rotary({"partial_rotary_factor": 0.25, **hf}),
        "linear_num_key_heads": hf_get(hf, "linear_num_key_heads"),
        "linear_num_value_heads": hf_get(hf, "linear_num_value_heads"),
        "linear_key_head_dim": hf_get(hf, "linear_key_head_dim"),
        "linear_value_head_dim": hf_get(hf, "linear_value_head_dim"),
        "linear_conv_kernel_dim": hf_get(hf, "linear_conv_kernel_dim"),
        # llama.cpp's files order the value heads tiled, not grouped by key head (kiln.checkpoint.gguf_hybrid)
        "linear_value_heads_tiled": bool(hf.get("linear_value_heads_tiled", False)), **extra})


class Qwen3_5Layers(HybridModel):
    """What the dense and MoE families share: the norms, the key map, the Gated DeltaNet layers."""

    norm_class = GemmaRmsNorm
    hf_key_map = {"mixer": "linear_attn", **MTP_KEY_MAP}  # LLaMA's names elsewhere

    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__(config, engine_layout)
        if config.get("mtp_num_layers") and config.mapping.is_last_pp_rank:  # beside the LM head it feeds
            self.mtp = MultiTokenPredictor(type(self), config, self.transformer.rotary, engine_layout)

    @classmethod
    def config_for_keys(cls, config: PretrainedConfig, external_keys: set[str]) -> PretrainedConfig:
        """With the checkpoint's MTP layer (``mtp_num_layers``; the released models have one)."""
        count = mtp_layer_count(external_keys)
        if count > 1:
            raise ConfigError(f"{config.architecture}: the checkpoint has {count} multi-token-prediction layers; "
                              "kiln runs one (as Qwen3.5 and Qwen3-Next have)")
        return dataclasses.replace(config, extra={**config.extra, "mtp_num_layers": count}) if count else config

    @classmethod
    def make_mixer(cls, config: PretrainedConfig, layer_idx: int, kind: str) -> nn.Module:
        if kind != "linear_attention":
            return super().make_mixer(config, layer_idx, kind)
        return GatedDeltaNet(
            layer_idx, config.hidden_size, num_key_heads=config.linear_num_key_heads,
            num_value_heads=config.linear_num_value_heads, key_dim=config.linear_key_head_dim,
            value_dim=config.linear_value_head_dim, kernel_size=config.linear_conv_kernel_dim,
            eps=config.norm_epsilon, dtype=torch_dtype(config.dtype),
            value_heads_tiled=bool(config.get("linear_value_heads_tiled", False)))


@register_model("Qwen3_5ForCausalLM")
class Qwen3_5ForCausalLM(Qwen3_5Layers, DecoderModelForCausalLM):
    gated_mlp = True

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return qwen3_5_config(hf, dtype, mapping, "Qwen3_5ForCausalLM", {})


@register_model("Qwen3_5MoeForCausalLM")
class Qwen3_5MoeForCausalLM(Qwen3_5Layers, Qwen2MoeForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return qwen3_5_config(hf, dtype, mapping, "Qwen3_5MoeForCausalLM", {
            **qwen_moe_fields({**hf, "norm_topk_prob": True}, mapping),
            "shared_expert_intermediate_size": hf_get(hf, "shared_expert_intermediate_size")})


@register_model("Qwen3_5ForConditionalGeneration")
class Qwen3_5LanguageModel(NestedLanguageModel, Qwen3_5ForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return nested_text_config(super().config_from_hf, hf, dtype, mapping, "Qwen3_5ForConditionalGeneration")


@register_model("Qwen3_5MoeForConditionalGeneration")
class Qwen3_5MoeLanguageModel(NestedLanguageModel, Qwen3_5MoeForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return nested_text_config(super().config_from_hf, hf, dtype, mapping, "Qwen3_5MoeForConditionalGeneration")
