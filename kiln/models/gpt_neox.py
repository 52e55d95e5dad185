"""GPT-NeoX / Pythia: LayerNorm, partial rotary, biases everywhere, a GELU MLP, attention and
MLP in parallel off the layer's input (``use_parallel_residual``), and a fused
``query_key_value`` whose rows are ordered per head (q, k, v of head 0, then of head 1...)."""
from __future__ import annotations

import torch

from kiln.config import PretrainedConfig
from kiln.layers.normalization import LayerNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_dtype, hf_get, hf_partial_rotary, hf_rope
from kiln.models.registry import register_model


@register_model("GPTNeoXForCausalLM")
class GPTNeoXForCausalLM(DecoderModelForCausalLM):
    gated_mlp = False
    hf_key_map = {
        "transformer": "gpt_neox",
        "vocab_embedding": "embed_in",
        "attention": "attention",
        "qkv": "query_key_value",
        "dense": "dense",
        "fc": "dense_h_to_4h",
        "proj": "dense_4h_to_h",
        "ln_f": "final_layer_norm",
        "lm_head": "embed_out",
    }

    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__(config, engine_layout)
        for layer in self.transformer.layers.values():
            layer.attention.qkv.interleaved_heads = True

    @classmethod
    def make_norm(cls, config: PretrainedConfig, dtype: torch.dtype) -> LayerNorm:
        return LayerNorm(config.hidden_size, config.norm_epsilon, dtype=dtype)

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        heads, hidden = hf_get(hf, "num_attention_heads"), hf_get(hf, "hidden_size")
        theta, scaling = hf_rope(hf)
        bias = bool(hf.get("attention_bias", True))
        tied = bool(hf.get("tie_word_embeddings", False))
        return PretrainedConfig(
            architecture="GPTNeoXForCausalLM",
            dtype=hf_dtype(hf, dtype),
            vocab_size=hf_get(hf, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=hf_get(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            hidden_act=hf_get(hf, "hidden_act", default="gelu"),
            intermediate_size=hf_get(hf, "intermediate_size"),
            norm_epsilon=float(hf_get(hf, "layer_norm_eps", default=1e-5)),
            max_position_embeddings=hf_get(hf, "max_position_embeddings", default=None),
            position_embedding_type="rope_gpt_neox",
            mapping=mapping,
            share_embedding_table=tied,
            extra={
                "rotary_base": float(hf.get("rotary_emb_base") or theta),
                "rotary_scaling": scaling,
                "rotary_pct": hf_partial_rotary(hf),
                "attn_bias": bias,
                "dense_bias": True,
                "mlp_bias": True,
                "parallel_residual": bool(hf.get("use_parallel_residual", True)),
                "tie_word_embeddings": tied,
            },
        )
