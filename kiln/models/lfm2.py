"""LFM2 (Liquid AI): short-convolution blocks (``kiln.layers.short_conv``) on most layers,
grouped-query attention with per-head q/k RMSNorm on the layers ``layer_types`` (or
``full_attn_idxs``) names, a SwiGLU feed-forward on every layer, and the final norm Hugging Face
calls ``embedding_norm``. The feed-forward width is ``block_ff_dim`` adjusted as the checkpoint
says (``block_auto_adjust_ff_dim``: two thirds, times ``block_ffn_dim_multiplier``, rounded up to
``block_multiple_of``)."""
from __future__ import annotations

from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.layers.short_conv import ShortConv
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.hybrid import HybridModel
from kiln.models.registry import register_model


def lfm2_intermediate_size(hf: dict) -> int:
    """The feed-forward width the checkpoint's weights have."""
    size = hf_get(hf, "block_ff_dim", "intermediate_size")
    if hf.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            size = int(multiplier * size)
            multiple = hf.get("block_multiple_of", 256)
            size = multiple * -(-size // multiple)
    return size


@register_model("Lfm2ForCausalLM")
class Lfm2ForCausalLM(HybridModel, DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {"input_layernorm": "operator_norm", "post_layernorm": "ffn_norm", "ln_f": "embedding_norm",
                  "dense": "out_proj", "q_norm": "q_layernorm", "k_norm": "k_layernorm", "mlp": "feed_forward",
                  "fc": "w1", "gate": "w3", "proj": "w2", "mixer": "conv"}

    @classmethod
    def make_mixer(cls, config: PretrainedConfig, layer_idx: int, kind: str) -> nn.Module:
        if kind != "conv":
            return super().make_mixer(config, layer_idx, kind)
        return ShortConv(layer_idx, config.hidden_size, config.conv_kernel_size, config.conv_bias,
                         dtype=torch_dtype(config.dtype))

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        layers = hf_get(hf, "num_hidden_layers")
        types = hf.get("layer_types")
        if types is None:
            attention = hf.get("full_attn_idxs")
            attention = set(range(layers) if attention is None else attention)
            types = ["full_attention" if i in attention else "conv" for i in range(layers)]
        tied = bool(hf.get("tie_embedding", hf.get("tie_word_embeddings", True)))
        return rope_decoder_config(
            {**hf, "intermediate_size": lfm2_intermediate_size(hf), "tie_word_embeddings": tied}, dtype, mapping,
            "Lfm2ForCausalLM", norm_epsilon=float(hf_get(hf, "norm_eps", default=1e-5)),
            extra={"qk_norm": True, "layer_types": list(types), "conv_kernel_size": hf_get(hf, "conv_L_cache"),
                   "conv_bias": bool(hf.get("conv_bias", False))})
