"""Hybrid models: recurrent layers beside attention layers (LFM2, Qwen3.5, Granite 4, ...).

``layer_types`` names each layer's kind: an attention kind (``full_attention``,
``sliding_attention``: a ``DecoderLayer``) or a recurrent one (``conv``: LFM2's short convolution;
``linear_attention``: Gated DeltaNet; ``mamba``: Mamba2, ``mamba_mixer``), built by
``RecurrentDecoderLayer`` around the mixer the family makes (``make_mixer``). A recurrent layer's
cache is its state tensors (``kiln.step.state_cache``), not K/V blocks. A family with another
layer shape (Nemotron-H: one block a layer) marks the layers that keep no K/V ``keeps_state``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.mamba2 import Mamba2
from kiln.layers.rotary import RotaryEmbedding
from kiln.models.decoder import RECURRENT_LAYER_TYPES, DecoderLayer, layer_type, positive_field


def is_recurrent(layer: nn.Module) -> bool:
    """Whether a decoder layer keeps a recurrent state (its cache: the parts ``state_spec()``
    lists, none for a layer with neither attention nor a state) instead of K/V."""
    return bool(getattr(layer, "keeps_state", False))


def attention_modules(layers) -> list[nn.Module]:
    """The attention modules of ``layers`` (decoder layers, in order), recurrent layers skipped:
    the layers that keep K/V."""
    return [layer.attention for layer in layers if not is_recurrent(layer)]


def recurrent_layer_ids(config: PretrainedConfig) -> list[int]:
    """The indices of the config's recurrent layers (none for a pure transformer)."""
    if config.get("layer_types") is None:
        return []
    return [i for i in range(config.num_hidden_layers) if layer_type(config, i) in RECURRENT_LAYER_TYPES]


class RecurrentDecoderLayer(nn.Module):
    """A pre-norm layer around a recurrent mixer: ``h += mixer(ln1(h)); h += mlp(ln2(h))``.

    ``mixer`` is what ``model_cls.make_mixer(config, layer_idx, kind)`` returns: a module with
    ``state_spec()`` (its state parts per sequence) and ``forward(hidden, positions, metadata,
    state)``. ``residual_multiplier`` (Granite) scales both blocks' outputs before their adds."""

    native_decode_shape = False  # the native decode step has no recurrent kernels yet
    keeps_state = True

    def __init__(self, model_cls: type, config: PretrainedConfig, layer_idx: int,
                 rotary: RotaryEmbedding | None, engine_layout: bool):
        super().__init__()
        dtype = torch_dtype(config.dtype)
        self.layer_idx = layer_idx
        self.kind = layer_type(config, layer_idx)
        self.input_layernorm = model_cls.make_norm(config, dtype)
        self.mixer = model_cls.make_mixer(config, layer_idx, self.kind)
        self.post_layernorm = model_cls.make_norm(config, dtype)
        self.mlp = model_cls.make_mlp(config, layer_idx, engine_layout)
        self.residual_multiplier = positive_field(config, "residual_multiplier")

    def state_spec(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return self.mixer.state_spec()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, state) -> torch.Tensor:
        hidden = hidden + self._scaled(self.mixer(self.input_layernorm(hidden), positions, metadata, state))
        return hidden + self._scaled(self.mlp(self.post_layernorm(hidden), metadata.lora))

    _scaled = DecoderLayer._scaled


def hybrid_layer(model_cls: type, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding | None,
                 engine_layout: bool) -> nn.Module:
    """Layer ``layer_idx`` of a hybrid model: a ``RecurrentDecoderLayer`` for a recurrent kind,
    else the family's attention layer (``model_cls.attention_layer``)."""
    if layer_type(config, layer_idx) in RECURRENT_LAYER_TYPES:
        return RecurrentDecoderLayer(model_cls, config, layer_idx, rotary, engine_layout)
    return model_cls.attention_layer(model_cls, config, layer_idx, rotary, engine_layout)


class HybridModel:
    """Mixin (listed before ``DecoderModelForCausalLM``) for a family with recurrent layers: its
    layers are made by ``hybrid_layer``; the family defines ``make_mixer``."""

    decoder_layer = staticmethod(hybrid_layer)
    attention_layer = DecoderLayer

    @classmethod
    def make_mixer(cls, config: PretrainedConfig, layer_idx: int, kind: str) -> nn.Module:
        raise ConfigError(f"{cls.__name__} has no {kind!r} layers (config field 'layer_types')")


def mamba_mixer(config: PretrainedConfig, layer_idx: int) -> Mamba2:
    """Layer ``layer_idx``'s Mamba2 mixer from the config's ``mamba_*`` fields (Granite 4 hybrids,
    Nemotron-H): ``mamba_time_step_limit`` is ``[min, max]``, a null max for none."""
    low, high = config.get("mamba_time_step_limit") or (0.0, None)
    return Mamba2(layer_idx, config.hidden_size, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
                  state_size=config.mamba_state_size, groups=config.mamba_groups,
                  kernel_size=config.mamba_conv_kernel, conv_bias=bool(config.mamba_conv_bias),
                  proj_bias=bool(config.mamba_proj_bias), eps=config.norm_epsilon, dtype=torch_dtype(config.dtype),
                  time_step_limit=(float(low), math.inf if high is None else float(high)))
