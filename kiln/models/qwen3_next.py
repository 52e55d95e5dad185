"""Qwen3-Next: Qwen3.5-MoE's layers (Gated DeltaNet before every gated full-attention layer, (1 + w)
norms, experts with a sigmoid-gated shared expert; ``kiln.models.qwen3_5``) with the Gated DeltaNet
projections fused as Hugging Face stores them: ``in_proj_qkvz`` holds, for each key head in turn,
its q and k rows and its value heads' v and z rows; ``in_proj_ba`` its value heads' b then a rows.
Loading picks each of kiln's four projections' rows out of them (``Linear.source_rows``). A
checkpoint holding ``in_proj_qkvz`` already split as Qwen3.5 names it (``in_proj_qkv``: all q, all
k, all v; ``in_proj_z``: llama.cpp's GGUF files, ``kiln.checkpoint.gguf_hybrid``) loads those two
as they are. Dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.hf_config import hf_get
from kiln.models.qwen2_moe import qwen_moe_fields
from kiln.models.qwen3_5 import Qwen3_5MoeForCausalLM, qwen3_5_config
from kiln.models.registry import register_model


def fused_rows(config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The rows of ``in_proj_qkvz`` / ``in_proj_ba`` each of kiln's projections takes (on the CPU:
    models are made on the meta device)."""
    groups, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    per_group = config.linear_num_value_heads // groups
    values = per_group * config.linear_value_head_dim  # a key head's value (and z) rows
    width = 2 * key_dim + 2 * values
    starts = torch.arange(groups, device="cpu") * width

    def part(offset: int, size: int, starts: torch.Tensor = starts) -> torch.Tensor:
        return (starts[:, None] + offset + torch.arange(size, device="cpu")).flatten()

    ba = torch.arange(groups, device="cpu") * 2 * per_group
    return {"in_proj_qkv": torch.cat([part(0, key_dim), part(key_dim, key_dim), part(2 * key_dim, values)]),
            "in_proj_z": part(2 * key_dim + values, values),
            "in_proj_b": part(0, per_group, ba), "in_proj_a": part(per_group, per_group, ba)}


@register_model("Qwen3NextForCausalLM")
class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    @classmethod
    def config_for_keys(cls, config: PretrainedConfig, external_keys: set[str]) -> PretrainedConfig:
        """Whether ``in_proj_qkvz`` comes whole (Hugging Face) or split in two (GGUF)."""
        config = super().config_for_keys(config, external_keys)
        split = any(key.endswith("linear_attn.in_proj_qkv.weight") for key in external_keys)
        return dataclasses.replace(config, extra={**config.extra, "in_proj_qkvz_split": split})

    @classmethod
    def make_mixer(cls, config: PretrainedConfig, layer_idx: int, kind: str) -> nn.Module:
        mixer = super().make_mixer(config, layer_idx, kind)
        if kind != "linear_attention":
            return mixer
        split = bool(config.get("in_proj_qkvz_split", False))
        for name, rows in fused_rows(config).items():
            if split and name in ("in_proj_qkv", "in_proj_z"):
                continue  # stored as kiln holds it
            linear = getattr(mixer, name)
            linear.source_rows = rows
            linear.external_key_map = {name: "in_proj_qkvz" if name in ("in_proj_qkv", "in_proj_z") else "in_proj_ba"}
        return mixer

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return qwen3_5_config(hf, dtype, mapping, "Qwen3NextForCausalLM", {
            **qwen_moe_fields({"norm_topk_prob": True, **hf}, mapping),
            "shared_expert_intermediate_size": hf_get(hf, "shared_expert_intermediate_size")})
