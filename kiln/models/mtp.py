"""Multi-token prediction (MTP) layers: the extra decoder layer Qwen3.5 and Qwen3-Next checkpoints
carry (``mtp.*``) to guess the token after the next one, used as speculative decoding's draft
(``speculative_config={"method": "mtp"}``; ``kiln.runtime.mtp`` runs it).

Row ``i`` of the MTP takes the target's final hidden state at position ``i`` (after its final
norm) and the embedding of token ``i + 1`` (the one sampled from that state), normalises each,
concatenates them (embedding first), projects back to the hidden width (Hugging Face's
``mtp.fc``), runs one full-attention decoder layer of the family (with its own K/V at position
``i``) and a final norm; the target's LM head turns that into the guess for token ``i + 2``. A
further guess feeds the MTP its own output as the hidden state.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.linear import Linear
from kiln.layers.rotary import RotaryEmbedding

# kiln's names for the MTP tensors Hugging Face names otherwise (``mtp.fc``: "fc" is the MLP's).
MTP_KEY_MAP = {"eh_proj": "fc"}


def mtp_layer_count(external_keys: set[str]) -> int:
    """The MTP layers a checkpoint holds (``mtp.layers.{i}.*``); 0 without."""
    ids = {key.split(".")[2] for key in external_keys if key.startswith("mtp.layers.")}
    return len(ids)


class MultiTokenPredictor(nn.Module):
    """One MTP layer of a model ``model_cls`` with ``config``: its layer is the family's
    attention layer, numbered after the model's own (``num_hidden_layers``)."""

    def __init__(self, model_cls: type, config: PretrainedConfig, rotary: RotaryEmbedding | None,
                 engine_layout: bool):
        super().__init__()
        dtype, n = torch_dtype(config.dtype), config.num_hidden_layers
        extra = dict(config.extra)
        if extra.get("layer_types") is not None:
            extra["layer_types"] = [*extra["layer_types"], "full_attention"]
        layer_config = dataclasses.replace(config, num_hidden_layers=n + 1, extra=extra)
        self.pre_fc_norm_embedding = model_cls.make_norm(config, dtype)
        self.pre_fc_norm_hidden = model_cls.make_norm(config, dtype)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False, dtype=dtype)
        self.layers = nn.ModuleDict({"0": model_cls.attention_layer(model_cls, layer_config, n, rotary, engine_layout)})
        self.norm = model_cls.make_norm(config, dtype)

    @property
    def attention(self) -> nn.Module:
        """The attention module of the MTP layer (the one that keeps K/V)."""
        return self.layers["0"].attention

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, metadata,
                kv_cache) -> torch.Tensor:
        """The MTP's output ``[rows, hidden]`` (for the LM head) from the next tokens' embeddings
        and the hidden states they were sampled from, one row per position."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.layers["0"](self.eh_proj(x), positions, metadata, kv_cache)
        return self.norm(x)


def mtp_attention(model: nn.Module) -> nn.Module:
    """The attention module of ``model``'s MTP layer (its K/V cache is allocated beside the
    model's); a ConfigError naming the option when the model has none."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        raise ConfigError(f"speculative_config.method 'mtp': this {model.config.architecture} engine has no "
                          "multi-token-prediction layer (its checkpoint had no mtp.* tensors)")
    if model.config.mapping.world_size > 1:
        raise ConfigError("speculative_config.method 'mtp' runs on one rank (tp_size and pp_size 1)")
    return mtp.attention
