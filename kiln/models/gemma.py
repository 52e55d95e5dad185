"""Gemma (v1): the LLaMA layout with GeGLU, RMSNorm scaled by (1 + weight), and the token
embeddings multiplied by sqrt(hidden_size); multi-query attention and a wide head in the
released sizes, the LM head tied to the embedding table."""
from __future__ import annotations

import torch

from kiln.config import PretrainedConfig
from kiln.layers.normalization import RmsNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_dtype, hf_get, hf_rope
from kiln.models.registry import register_model


class GemmaRmsNorm(RmsNorm):
    """Gemma's RMSNorm, ``x / rms(x) * (1 + w)``, kept in kiln as the weight ``1 + w`` so the
    ordinary RMSNorm (and its kernels) computes it: the offset is added once, on conversion."""

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        return {key: weights[0].float() + 1.0}


@register_model("GemmaForCausalLM")
class GemmaForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # LLaMA's names

    @classmethod
    def make_norm(cls, config: PretrainedConfig, dtype: torch.dtype) -> RmsNorm:
        return GemmaRmsNorm(config.hidden_size, config.norm_epsilon, dtype=dtype)

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        heads, hidden = hf_get(hf, "num_attention_heads"), hf_get(hf, "hidden_size")
        theta, scaling = hf_rope(hf)
        return PretrainedConfig(
            architecture="GemmaForCausalLM",
            dtype=hf_dtype(hf, dtype),
            vocab_size=hf_get(hf, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=hf_get(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=hf_get(hf, "num_key_value_heads", default=heads),
            head_size=hf_get(hf, "head_dim", default=hidden // heads),
            # Gemma's own field wins: its released configs say hidden_act "gelu" but run the tanh form.
            hidden_act=hf_get(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
            intermediate_size=hf_get(hf, "intermediate_size"),
            norm_epsilon=float(hf_get(hf, "rms_norm_eps", default=1e-6)),
            max_position_embeddings=hf_get(hf, "max_position_embeddings", default=None),
            position_embedding_type="rope_gpt_neox",
            mapping=mapping,
            share_embedding_table=bool(hf.get("tie_word_embeddings", True)),
            extra={
                "rotary_base": theta,
                "rotary_scaling": scaling,
                "attn_bias": bool(hf.get("attention_bias", False)),
                "dense_bias": bool(hf.get("attention_bias", False)),
                "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
                "embedding_multiplier": float(hidden) ** 0.5,
            },
        )
