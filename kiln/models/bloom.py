"""BLOOM: ALiBi instead of positions (a per-head linear bias on the attention scores),
a LayerNorm right after the token embedding, LayerNorm elsewhere, biases everywhere, a
tanh-GELU MLP, the LM head tied to the embedding table, and a fused ``query_key_value``
whose rows are ordered per head (as GPT-NeoX's)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.layers.normalization import LayerNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.key_maps import GPT2_LAYOUT, MEGATRON_NAMES
from kiln.models.hf_config import hf_dtype, hf_get
from kiln.models.registry import register_model


@register_model("BloomForCausalLM")
class BloomForCausalLM(DecoderModelForCausalLM):
    norm_class = LayerNorm
    gated_mlp = False
    hf_key_map = {**GPT2_LAYOUT, **MEGATRON_NAMES, "vocab_embedding": "word_embeddings",
                  "ln_embed": "word_embeddings_layernorm", "attention": "self_attention",
                  "post_layernorm": "post_attention_layernorm"}

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        if hf.get("apply_residual_connection_post_layernorm"):
            raise ConfigError("BLOOM config field 'apply_residual_connection_post_layernorm' (residuals taken "
                              "after the norms) is not supported")
        hidden = hf_get(hf, "hidden_size", "n_embed")
        heads = hf_get(hf, "n_head", "num_attention_heads")
        if hidden % heads:
            raise ConfigError(f"BLOOM config field 'hidden_size' ({hidden}) is not a multiple of n_head ({heads})")
        tied = bool(hf.get("tie_word_embeddings", True))
        return PretrainedConfig(
            architecture="BloomForCausalLM",
            dtype=hf_dtype(hf, dtype),
            vocab_size=hf_get(hf, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=hf_get(hf, "n_layer", "num_hidden_layers"),
            num_attention_heads=heads,
            # bloom_gelu_forward is the tanh approximation (its constant rounded to 8 digits).
            hidden_act="gelu_pytorch_tanh",
            intermediate_size=4 * hidden,
            norm_epsilon=float(hf_get(hf, "layer_norm_epsilon", default=1e-5)),
            position_embedding_type="alibi",
            mapping=mapping,
            share_embedding_table=tied,
            extra={"attn_bias": True, "dense_bias": True, "mlp_bias": True, "embedding_layernorm": True, "qkv_per_head": True,
                   "tie_word_embeddings": tied},
        )
