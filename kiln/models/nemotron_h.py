"""Nemotron-H (``NemotronHForCausalLM``): every layer is one block with its own pre-norm and
residual, ``h += block(norm(h))``, the block being what ``hybrid_override_pattern`` (or
transformers 5's ``layers_block_type``) says for it:

    M  mamba               Mamba2 (kiln.layers.mamba2): keeps a state, no K/V
    *  full_attention      grouped-query attention without positions (NoPE): keeps K/V
    -  mlp                 up_proj -> relu^2 -> down_proj (no gate): keeps nothing

Hugging Face names every block ``mixer`` under ``backbone.layers.N`` beside its ``norm``; the
embedding is ``backbone.embeddings``, the final norm ``backbone.norm_f``. The mixture-of-experts
blocks (``E``, Nemotron 3) are not supported yet.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.attention import Attention
from kiln.layers.mlp import MLP
from kiln.layers.rotary import RotaryEmbedding
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.decoder import attention_settings, layer_type
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.hybrid import mamba_mixer
from kiln.models.registry import register_model

_PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}
# Layer kinds by the names transformers 5 (and the converter's older configs) use.
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
          "full_attention": "full_attention", "mlp": "mlp", "moe": "moe"}


class NemotronHLayer(nn.Module):
    """One Nemotron-H layer: ``h + block(input_layernorm(h))``, the block a Mamba2 ``mixer``, an
    ``attention`` or an ``mlp`` by the layer's kind (the others None). A Mamba2 layer keeps its
    state, a feed-forward layer an empty one (``keeps_state``: neither keeps K/V)."""

    native_decode_shape = False

    def __init__(self, model_cls: type, config: PretrainedConfig, layer_idx: int,
                 rotary: RotaryEmbedding | None, engine_layout: bool):
        super().__init__()
        dtype, tp = torch_dtype(config.dtype), config.mapping
        self.kind = layer_type(config, layer_idx)
        self.keeps_state = self.kind != "full_attention"
        self.input_layernorm = model_cls.make_norm(config, dtype)
        self.mixer = mamba_mixer(config, layer_idx) if self.kind == "mamba" else None
        self.mlp = self.attention = None
        if self.kind == "mlp":
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           bool(config.get("mlp_bias", False)), dtype=dtype, tp_size=tp.tp_size, tp_rank=tp.tp_rank)
        elif self.kind == "full_attention":
            bias = bool(config.get("attn_bias", False))
            self.attention = Attention(layer_idx, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, config.head_size, qkv_bias=bias, dense_bias=bias,
                                       rotary=None, dtype=dtype, tp_size=tp.tp_size, tp_rank=tp.tp_rank,
                                       **attention_settings(config, layer_idx))

    def state_spec(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Its state parts per sequence: the mixer's, or none."""
        return self.mixer.state_spec() if self.mixer is not None else []

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, cache) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.mixer is not None:
            return hidden + self.mixer(normed, positions, metadata, cache)
        if self.attention is not None:
            return hidden + self.attention(normed, positions, metadata, cache)
        return hidden + self.mlp(normed, metadata.lora)


def nemotron_h_layer_types(hf: dict) -> list[str]:
    """Each layer's kind from ``hybrid_override_pattern`` (a character a layer) or
    ``layers_block_type``; mixture-of-experts layers are refused."""
    pattern = hf.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if set(pattern) - set(_PATTERN):
            raise ConfigError(f"hybrid_override_pattern {pattern!r} holds characters other than {sorted(_PATTERN)}")
        kinds = [_PATTERN[c] for c in pattern]
    else:
        names = hf_get(hf, "layers_block_type", "layer_types")
        if not isinstance(names, list) or any(n not in _KINDS for n in names):
            raise ConfigError(f"layers_block_type must list one of {sorted(_KINDS)} per layer, got {names!r}")
        kinds = [_KINDS[n] for n in names]
    if "moe" in kinds:
        raise ConfigError("Nemotron-H mixture-of-experts layers ('E' / 'moe') are not supported yet")
    return kinds


@register_model("NemotronHForCausalLM")
class NemotronHForCausalLM(DecoderModelForCausalLM):
    gated_mlp = False
    decoder_layer = NemotronHLayer
    hf_key_map = {"transformer": "backbone", "vocab_embedding": "embeddings", "ln_f": "norm_f",
                  "input_layernorm": "norm", "attention": "mixer", "mlp": "mixer", "fc": "up_proj",
                  "proj": "down_proj"}

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        kinds = nemotron_h_layer_types(hf)  # (residual_in_fp32: Hugging Face's blocks do not read it either)
        heads = hf_get(hf, "mamba_num_heads")
        head_dim = hf_get(hf, "head_dim", "attention_head_dim", default=hf["hidden_size"] // hf["num_attention_heads"])
        bias = bool(hf.get("attention_bias", False))
        fields = {**hf, "num_hidden_layers": len(kinds), "head_dim": head_dim}
        return rope_decoder_config(
            fields, dtype, mapping, "NemotronHForCausalLM", hidden_act=hf.get("mlp_hidden_act") or "relu2",
            norm_epsilon=float(hf_get(hf, "layer_norm_epsilon", default=1e-5)), extra={
                "attn_bias": bias, "dense_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False)),
                "layer_types": kinds, "nope_layers": list(range(len(kinds))),
                "mamba_num_heads": heads, "mamba_head_dim": hf_get(hf, "mamba_head_dim"),
                "mamba_state_size": hf_get(hf, "ssm_state_size"),
                "mamba_groups": hf_get(hf, "n_groups", "mamba_n_groups", default=1),
                "mamba_conv_kernel": hf_get(hf, "conv_kernel", "mamba_d_conv", default=4),
                "mamba_conv_bias": bool(hf_get(hf, "use_conv_bias", "mamba_conv_bias", default=True)),
                "mamba_proj_bias": bool(hf.get("use_bias", False)),
                # Hugging Face's mixer: the lower limit is time_step_min, whatever time_step_limit says
                "mamba_time_step_limit": [float(hf_get(hf, "time_step_min", "mamba_dt_min", default=0.001)), None]})
