"""Falcon: LayerNorm, rotary, exact GELU, optional biases (``bias``) and three layer shapes:

* 7B-style (``parallel_attn``): attention and MLP in parallel off one ``input_layernorm``,
  multi-query (``multi_query``: one KV head) with ``query_key_value`` laid out [all q; k; v];
* 40B/180B-style (``new_decoder_architecture``): ``num_kv_heads`` KV groups, two parallel norms
  (``ln_attn`` / ``ln_mlp``, or one with ``num_ln_in_parallel_attn`` 1), and
  ``query_key_value`` laid out per group [the group's q heads; its k; its v];
* sequential (``parallel_attn`` false): ``input_layernorm`` then ``post_attention_layernorm``;
* Falcon-RW (``alibi``): ALiBi biases instead of rotary. Its reference rounds each bias
  (slope × position) to bfloat16, which kiln's float32 biases match exactly where the slopes
  are powers of two (a power-of-two head count, up to 256 positions) and to about 2^-9 of the
  bias otherwise.

Without multi-query or the new architecture the fused rows are per head [q; k; v], as
GPT-NeoX's. Per-group and per-head layouts are reordered to kiln's [q; k; v] and split by
heads over tensor-parallel ranks on conversion (``QKVColumnLinear.interleaved_heads``).
"""
from __future__ import annotations

import dataclasses

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.layers.normalization import LayerNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.key_maps import GPT2_LAYOUT, MEGATRON_NAMES
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.registry import register_model


@register_model("FalconForCausalLM")
class FalconForCausalLM(DecoderModelForCausalLM):
    norm_class = LayerNorm
    gated_mlp = False
    hf_key_map = {**GPT2_LAYOUT, **MEGATRON_NAMES, "vocab_embedding": "word_embeddings",
                  "attention": "self_attention"}

    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__(config, engine_layout)
        two_norms = config.get("parallel_residual") and not config.get("shared_layernorm")
        for layer in self.transformer.layers.values():
            slopes = layer.attention.alibi_slopes
            if slopes is not None:
                # Falcon-RW adds the biases before scaling the scores (BLOOM after), from slopes
                # rounded to bfloat16: the same biases as BLOOM's formula, rounded and scaled.
                slopes.copy_(slopes.bfloat16().float() * layer.attention.scale)
            if two_norms:  # the new architecture's parallel norms
                layer.external_key_map = {"input_layernorm": "ln_attn", "post_layernorm": "ln_mlp"}

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        if hf.get("apply_residual_connection_post_layernorm"):
            raise ConfigError("Falcon with apply_residual_connection_post_layernorm=true is not supported")
        heads = hf_get(hf, "num_attention_heads", "n_head")
        hidden = hf_get(hf, "hidden_size", "n_embed")
        parallel = bool(hf.get("parallel_attn", True))
        if hf.get("new_decoder_architecture"):
            if not parallel:  # Hugging Face's layer would read norms it never creates
                raise ConfigError("Falcon with new_decoder_architecture=true and parallel_attn=false is not supported")
            kv_heads = hf_get(hf, "num_kv_heads", "n_head_kv", default=heads)
            shared_norm = (hf.get("num_ln_in_parallel_attn") or 2) == 1
            per_group = True
        elif hf.get("multi_query", True):
            kv_heads, shared_norm, per_group = 1, parallel, False
        else:  # per head [q; k; v]: groups of one query head
            kv_heads, shared_norm, per_group = heads, parallel, True
        bias = bool(hf.get("bias", False))
        named = {**hf, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                 "head_dim": hidden // heads, "num_hidden_layers": hf_get(hf, "num_hidden_layers", "n_layer"),
                 "intermediate_size": hf.get("ffn_hidden_size") or 4 * hidden,
                 "max_position_embeddings": hf.get("max_position_embeddings", 2048)}
        config = rope_decoder_config(
            named, dtype, mapping, "FalconForCausalLM", tied_default=True,
            hidden_act=hf_get(hf, "activation", default="gelu"),
            norm_epsilon=float(hf_get(hf, "layer_norm_epsilon", default=1e-5)),
            extra={"attn_bias": bias, "dense_bias": bias, "mlp_bias": bias, "parallel_residual": parallel,
                   "shared_layernorm": shared_norm, "qkv_per_head": per_group})
        # Falcon-RW: ALiBi biases instead of rotary positions.
        return dataclasses.replace(config, position_embedding_type="alibi") if hf.get("alibi") else config
