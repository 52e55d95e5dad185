"""Gemma (v1): the LLaMA layout with GeGLU, RMSNorm scaled by (1 + weight), and the token
embeddings multiplied by sqrt(hidden_size); multi-query attention and a wide head in the
released sizes, the LM head tied to the embedding table."""
from __future__ import annotations

import torch

from kiln.config import PretrainedConfig
from kiln.layers.normalization import RmsNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.registry import register_model


class GemmaRmsNorm(RmsNorm):
    """Gemma's RMSNorm, ``x / rms(x) * (1 + w)``, kept in kiln as the weight ``1 + w`` so the
    ordinary RMSNorm (and its kernels) computes it: the offset is added once, on conversion."""

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        return {key: weights[0].float() + 1.0}


@register_model("GemmaForCausalLM")
class GemmaForCausalLM(DecoderModelForCausalLM):
    norm_class = GemmaRmsNorm
    gated_mlp = True
    hf_key_map = {}  # LLaMA's names

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        bias = bool(hf.get("attention_bias", False))
        return rope_decoder_config(
            hf, dtype, mapping, "GemmaForCausalLM", tied_default=True,
            # Gemma's own field wins: its released configs say hidden_act "gelu" but run the tanh form.
            hidden_act=hf_get(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
            extra={"attn_bias": bias, "dense_bias": bias,
                   "embedding_multiplier": float(hf_get(hf, "hidden_size")) ** 0.5})
