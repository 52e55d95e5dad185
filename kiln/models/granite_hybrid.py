"""Granite 4 hybrids (``GraniteMoeHybridForCausalLM``): Mamba2 layers (``kiln.layers.mamba2``)
beside a few attention layers, each layer followed by a SiLU-gated feed-forward block.

* ``layer_types`` (or ``layers_block_type``): ``mamba`` / ``attention`` in the released configs,
  ``linear_attention`` / ``full_attention`` as transformers 5 writes them.
* Feed-forward: ``shared_mlp`` (``input_linear`` holds the gate rows then the up rows,
  ``output_linear``) on every layer; with ``num_local_experts`` > 0 also experts
  (``block_sparse_moe``: ``router.layer``, ``input_linear`` ``[E, 2 I, hidden]``,
  ``output_linear``), top ``num_experts_per_tok`` of a softmax renormalised, the shared MLP added.
* Granite's multipliers (``kiln.models.granite``): embeddings, attention scale, each block's
  output before its residual add (Mamba2 blocks too), logits divided by ``logits_scaling``.
* Positions: rotary where ``position_embedding_type`` is ``rope``; none otherwise (the released
  4.0-H models: NoPE).
"""
from __future__ import annotations

import dataclasses
import math

from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.mlp import GatedMLP
from kiln.layers.moe import MixtureOfExperts, check_expert_config, external_layout
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.hybrid import HybridModel, mamba_mixer
from kiln.models.registry import register_model

# Layer kinds by the names Granite's configs use.
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
          "full_attention": "full_attention"}


class GraniteExperts(MixtureOfExperts):
    """Granite's experts as its checkpoints hold them: under ``block_sparse_moe``, the router
    ``router.layer``, each expert's gate and up rows in one stacked ``input_linear``
    ``[E, 2 I, hidden]``, ``output_linear`` ``[E, hidden, I]``; or, from a GGUF file, each
    projection stacked on its own (``per_projection``, as other GGUF MoE files)."""

    def match_external_keys(self, external: set[str]) -> None:
        if external_layout(external, self.names) == "per_projection":
            super().match_external_keys(external)
            return
        self.router.external_key_map = {"mlp": "block_sparse_moe", "router": "router.layer"}
        if self.fused:  # an engine loads kiln's own names only
            return
        for module, name, source, part in ((self.fc, "fc", "input_linear", (0, 2)),
                                           (self.gate, "gate", "input_linear", (1, 2)),
                                           (self.proj, "proj", "output_linear", None)):
            module.fused_part, module.stacked_source = part, True
            module.external_key_map = {"mlp": "block_sparse_moe", name: source}


def _split_shared_mlp(external_keys: set[str]) -> bool:
    return any(k.endswith(".shared_mlp.gate_proj.weight") for k in external_keys)


def time_step_limit(hf: dict, *names: str) -> list:
    """``[min, max]`` of Mamba2's time step (a null max for none) from the first of ``names``
    the config has; transformers writes infinity as ``{"__float__": "Infinity"}``."""
    value = hf_get(hf, *names, default=None) or (0.0, math.inf)

    def number(v) -> float:
        return math.inf if v is None else float(v["__float__"]) if isinstance(v, dict) else float(v)

    low, high = (number(v) for v in value)
    return [low, None if math.isinf(high) else high]


@register_model("GraniteMoeHybridForCausalLM")
class GraniteMoeHybridForCausalLM(HybridModel, DecoderModelForCausalLM):
    gated_mlp = True
    # (the shared MLP's fc and gate are the halves of input_linear: make_mlp)
    hf_key_map = {"mixer": "mamba", "mlp": "shared_mlp", "shared_expert": "", "fc": "input_linear",
                  "gate": "input_linear", "proj": "output_linear"}
    # A GGUF file's shared MLP: its halves as separate projections (kiln.checkpoint.gguf_mamba)
    split_key_map = {**hf_key_map, "fc": "gate_proj", "gate": "up_proj", "proj": "down_proj"}

    @classmethod
    def key_map_for(cls, external_keys: set[str]) -> dict:
        return cls.split_key_map if _split_shared_mlp(external_keys) else cls.hf_key_map

    @classmethod
    def config_for_keys(cls, config: PretrainedConfig, external_keys: set[str]) -> PretrainedConfig:
        """Whether the shared MLP comes as halves of ``input_linear`` (HF) or split (GGUF)."""
        return dataclasses.replace(config, extra={**config.extra,
                                                  "shared_mlp_split": _split_shared_mlp(external_keys)})

    @classmethod
    def make_mixer(cls, config: PretrainedConfig, layer_idx: int, kind: str) -> nn.Module:
        if kind != "mamba":
            return super().make_mixer(config, layer_idx, kind)
        return mamba_mixer(config, layer_idx)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, engine_layout: bool) -> nn.Module:
        if not config.num_experts:
            mlp = super().make_mlp(config, layer_idx, engine_layout)
            shared = mlp
        else:
            tp = config.mapping
            mlp = GraniteExperts(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, config.hidden_act, normalize_top_k=True,
                                 shared_intermediate_size=config.intermediate_size, dtype=torch_dtype(config.dtype),
                                 tp_size=tp.tp_size, tp_rank=tp.tp_rank, fused=engine_layout)
            shared = mlp.shared_expert
        if isinstance(shared, GatedMLP) and not shared.fused and not config.get("shared_mlp_split"):
            # from an HF checkpoint: the halves of input_linear
            shared.fc.fused_part, shared.gate.fused_part = (0, 2), (1, 2)
        return mlp

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        layers = hf_get(hf, "num_hidden_layers")
        types = hf_get(hf, "layer_types", "layers_block_type")
        if len(types) != layers or any(t not in _KINDS for t in types):
            raise ConfigError(f"layer_types must name one of {sorted(_KINDS)} for each of the {layers} layers, "
                              f"got {types!r}")
        position = hf.get("position_embedding_type") or "nope"
        if position not in ("rope", "nope"):
            raise ConfigError(f"position_embedding_type {position!r} is not supported (rope, nope or null)")
        experts = int(hf.get("num_local_experts") or 0)
        if experts:
            check_expert_config(experts, hf_get(hf, "num_experts_per_tok"), hf_get(hf, "intermediate_size"),
                                mapping.tp_size, experts_field="num_local_experts", top_k_field="num_experts_per_tok",
                                intermediate_field="intermediate_size")

        def multiplier(name: str) -> float | None:  # 1 is no multiplier at all
            value = float(hf.get(name, 1.0))
            return None if value == 1.0 else value

        hidden, heads = hf_get(hf, "hidden_size"), hf_get(hf, "mamba_n_heads")
        inner = hf_get(hf, "mamba_expand", default=2) * hidden
        head_dim = hf_get(hf, "mamba_d_head", default="auto")
        bias = bool(hf.get("attention_bias", False))
        return rope_decoder_config({**hf, "intermediate_size": hf_get(hf, "shared_intermediate_size")}, dtype,
                                   mapping, "GraniteMoeHybridForCausalLM", extra={
            "attn_bias": bias, "dense_bias": bias, "layer_types": [_KINDS[t] for t in types],
            "nope_layers": [] if position == "rope" else list(range(layers)),
            "embedding_multiplier": multiplier("embedding_multiplier"),
            "attention_multiplier": float(hf.get("attention_multiplier", 1.0)),
            "residual_multiplier": multiplier("residual_multiplier"), "logits_scaling": multiplier("logits_scaling"),
            "num_experts": experts, "num_experts_per_tok": hf.get("num_experts_per_tok"),
            "moe_intermediate_size": hf_get(hf, "intermediate_size"),
            "mamba_num_heads": heads, "mamba_head_dim": inner // heads if head_dim == "auto" else head_dim,
            "mamba_state_size": hf_get(hf, "mamba_d_state"), "mamba_groups": hf_get(hf, "mamba_n_groups", default=1),
            "mamba_conv_kernel": hf_get(hf, "mamba_d_conv"), "mamba_conv_bias": bool(hf.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(hf.get("mamba_proj_bias", False)),
            "mamba_time_step_limit": time_step_limit(hf, "time_step_limit")})
