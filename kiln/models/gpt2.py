"""GPT-2: learned absolute positions, LayerNorm, gelu_new, Conv1D weights, tied lm_head."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.layers.normalization import LayerNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.key_maps import GPT2_NAMES
from kiln.models.hf_config import hf_dtype, hf_get
from kiln.models.registry import register_model


@register_model("GPT2LMHeadModel", "GPT2ForCausalLM")
class GPT2ForCausalLM(DecoderModelForCausalLM):
    norm_class = LayerNorm
    gated_mlp = False
    source_transposed = True  # Conv1D stores (in, out)
    hf_key_map = {**GPT2_NAMES, "position_embedding": "wpe", "qkv": "c_attn", "dense": "c_proj",
                  "post_layernorm": "ln_2", "fc": "c_fc", "proj": "c_proj"}

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ConfigError("GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn "
                              "are not supported")
        if hf.get("scale_attn_weights") is False:
            raise ConfigError("GPT-2 with scale_attn_weights=false is not supported")
        hidden = hf_get(hf, "n_embd", "hidden_size")
        return PretrainedConfig(
            architecture="GPT2LMHeadModel",
            dtype=hf_dtype(hf, dtype),
            vocab_size=hf_get(hf, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=hf_get(hf, "n_layer", "num_hidden_layers"),
            num_attention_heads=hf_get(hf, "n_head", "num_attention_heads"),
            hidden_act=hf_get(hf, "activation_function", default="gelu_new"),
            intermediate_size=hf_get(hf, "n_inner", default=4 * hidden),
            norm_epsilon=float(hf_get(hf, "layer_norm_epsilon", default=1e-5)),
            max_position_embeddings=hf_get(hf, "n_positions", "max_position_embeddings"),
            position_embedding_type="learned_absolute",
            mapping=mapping,
            share_embedding_table=bool(hf.get("tie_word_embeddings", True)),
            extra={"attn_bias": True, "dense_bias": True, "mlp_bias": True,
                   "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True))},
        )
