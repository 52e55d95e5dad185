"""Gemma 4 (text): Gemma 3's layer (four norms, GeGLU, embeddings times sqrt(hidden_size)) with
plain ``x * w`` RMSNorms (no ``1 + w``), per-head q/k norms and a weightless v norm, attention
scale 1, sliding and full layers (``layer_types``) each with their own rotary (full layers:
"proportional" rotary, only the first quarter of the frequency pairs turning) and their own
head size and KV heads (``global_head_dim``, ``num_global_key_value_heads``; with
``attention_k_eq_v`` the full layers' values are their key projection), the last
``num_kv_shared_layers`` layers reading the KV cache of the last earlier layer of their kind
(double-wide MLPs there with ``use_double_wide_mlp``), per-layer input embeddings (PLE:
``hidden_size_per_layer_input``), a learned scalar on each layer's output and final logit
soft-capping. Each of these is a general kiln config field (``layer_overrides``,
``per_layer_input_size``, ``layer_scalar``, ``v_norm``; see kiln.models.decoder). The 26B-A4B
(``enable_moe_block``) adds routed GeGLU experts beside each layer's dense MLP
(``Gemma4DecoderLayer``).

``Gemma4ForConditionalGeneration`` checkpoints hold the same language model under
``model.language_model`` beside vision and audio towers, which are not read (the engine takes
token ids, as for Gemma 3 and LLaVA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln import distributed
from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.moe import MixtureOfExperts, check_expert_config
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.decoder import DecoderLayer
from kiln.models.hf_config import hf_get, nested_text_config, rope_decoder_config
from kiln.models.key_maps import NestedLanguageModel
from kiln.models.registry import register_model

# transformers' defaults where a config leaves these out (configuration_gemma4.py).
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
DEFAULT_GLOBAL_HEAD_DIM = 512
# The fields a layer's entry of transformers' ``per_layer_config`` may override, and kiln's names.
PER_LAYER_FIELDS = {"head_dim": "head_size", "num_key_value_heads": "num_key_value_heads"}


def kv_sources(layer_types: list[str], shared: int) -> dict[int, int]:
    """Each KV-shared layer (the last ``shared``) -> the layer whose KV it reads: the last layer
    of its kind before them (transformers' ``kv_sharing_modes``)."""
    layers = len(layer_types)
    if not 0 <= shared < layers:
        raise ConfigError(f"Gemma 4 config field 'num_kv_shared_layers' must be below num_hidden_layers "
                          f"({layers}), got {shared}")
    first = layers - shared
    producers = {kind: i for i, kind in enumerate(layer_types[:first])}  # the last of each kind wins
    sources = {}
    for i in range(first, layers):
        if layer_types[i] not in producers:
            raise ConfigError(f"Gemma 4 config field 'num_kv_shared_layers' ({shared}) leaves no "
                              f"{layer_types[i]} layer to share its KV cache with layer {i}")
        sources[i] = producers[layer_types[i]]
    return sources


def layer_overrides(hf: dict, layer_types: list[str]) -> list[dict]:
    """kiln's ``layer_overrides`` (one dict per layer) from a Gemma 4 text config: the full
    layers' head size and KV heads (``per_layer_config`` where transformers wrote it, else
    ``global_head_dim`` / ``num_global_key_value_heads``), values from keys, KV sources and
    double-wide MLPs."""
    layers, k_eq_v = len(layer_types), bool(hf.get("attention_k_eq_v", False))
    overrides: list[dict] = [{} for _ in range(layers)]
    per_layer = hf.get("per_layer_config")
    if per_layer is not None:
        for key, fields in per_layer.items():
            index = int(key)
            if not 0 <= index < layers or not isinstance(fields, dict):
                raise ConfigError(f"Gemma 4 config field 'per_layer_config' has an entry {key!r}: {fields!r}")
            unknown = set(fields) - set(PER_LAYER_FIELDS)
            if unknown:
                raise ConfigError(f"Gemma 4 config field 'per_layer_config' overrides {sorted(unknown)} on layer "
                                  f"{index}; kiln takes only {sorted(PER_LAYER_FIELDS)} per layer")
            overrides[index].update({PER_LAYER_FIELDS[name]: value for name, value in fields.items()})
    else:
        full = {"head_size": hf.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM}
        if k_eq_v and hf.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = hf["num_global_key_value_heads"]
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                overrides[i].update(full)
    sources = kv_sources(layer_types, int(hf.get("num_kv_shared_layers") or 0))
    wide = 2 * hf_get(hf, "intermediate_size") if hf.get("use_double_wide_mlp") else None
    for i, kind in enumerate(layer_types):
        if k_eq_v and kind == "full_attention" and i not in sources:
            overrides[i]["value_from_key"] = True
        if i in sources:
            overrides[i]["kv_source"] = sources[i]
            if wide is not None:
                overrides[i]["intermediate_size"] = wide
    return overrides


class Gemma4Experts(MixtureOfExperts):
    """Gemma 4's experts (the 26B-A4B's 128, top 8): GeGLU experts from transformers' fused
    ``experts.gate_up_proj`` / ``experts.down_proj`` directly under the layer, routed from the
    layer's residual stream (not the experts' input): ``proj(rms(h) * scale / sqrt(hidden))``,
    softmax, top-k renormalised, each chosen weight times its expert's ``per_expert_scale``."""

    def __init__(self, *args, eps: float, **kwargs):
        super().__init__(*args, **kwargs)
        dtype = self.router.weight.dtype
        self.eps = eps
        self.router_scale = nn.Parameter(torch.empty(self.hidden_size, dtype=dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(self.num_experts, dtype=dtype), requires_grad=False)
        # Under the layer, not under an mlp block: kiln's "experts" section has no external name.
        self.external_key_map = {"experts": "", "router_scale": "router.scale",
                                 "per_expert_scale": "router.per_expert_scale"}

    def use_external_layout(self, layout: str) -> None:
        super().use_external_layout(layout)
        self.router.external_key_map = {"experts": "", "router": "router.proj"}
        for module in () if self.fused else (self.fc, self.gate, self.proj):
            module.external_key_map = {**{k: v for k, v in module.external_key_map.items() if k != "mlp"},
                                       "experts": ""}

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """The experts' output for their input ``x``, routed by the layer's ``residual`` stream."""
        shape = x.shape
        x, residual = x.reshape(-1, self.hidden_size), residual.reshape(-1, self.hidden_size)
        normed = F.rms_norm(residual.float(), (self.hidden_size,), None, self.eps).to(residual.dtype)
        weights, experts = self.route(self.router(normed * self.router_scale * self.hidden_size ** -0.5))
        weights = weights * self.per_expert_scale.float()[experts]
        return distributed.all_reduce(self.routed(x, weights, experts), self.tp_size).view(shape)


class Gemma4DecoderLayer(DecoderLayer):
    """Gemma 4's layer; with ``num_experts`` (``enable_moe_block``) its feed-forward block is the
    dense MLP and the experts side by side, each output normalised, then summed and normalised
    again: ``h += post_ff(post_ff_1(mlp(pre_ff(h))) + post_ff_2(experts(pre_ff_2(h), routed by h)))``."""

    def __init__(self, model_cls: type, config: PretrainedConfig, layer_idx: int, rotary, engine_layout: bool):
        super().__init__(model_cls, config, layer_idx, rotary, engine_layout)
        self.experts = None
        if config.get("num_experts"):
            dtype, tp = torch_dtype(config.dtype), config.mapping
            self.post_feedforward_layernorm_1 = model_cls.make_norm(config, dtype)
            self.pre_feedforward_layernorm_2 = model_cls.make_norm(config, dtype)
            self.post_feedforward_layernorm_2 = model_cls.make_norm(config, dtype)
            self.experts = Gemma4Experts(
                config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                config.hidden_act, normalize_top_k=True, eps=config.norm_epsilon, dtype=dtype,
                tp_size=tp.tp_size, tp_rank=tp.tp_rank, fused=engine_layout)

    def _blocks(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, kv_cache) -> torch.Tensor:
        if self.experts is None:
            return super()._blocks(hidden, positions, metadata, kv_cache)
        hidden = hidden + self.post_layernorm(self.attention(self.input_layernorm(hidden), positions, metadata,
                                                             kv_cache))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(hidden), metadata.lora))
        routed = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(hidden), hidden))
        return hidden + self.post_feedforward_layernorm(dense + routed)


@register_model("Gemma4ForCausalLM")
class Gemma4ForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    sublayer_norms = "pre_and_post"
    decoder_layer = Gemma4DecoderLayer
    hf_key_map = {}  # LLaMA's names; the norms, per-layer-input modules and layer_scalar keep theirs

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("Gemma 4 config field 'use_bidirectional_attention' "
                              f"({hf['use_bidirectional_attention']!r}) is not supported")
        layers = hf_get(hf, "num_hidden_layers")
        types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                               for i in range(layers)])
        types[-1] = "full_attention"  # as transformers: the last layer is always full attention
        hf = {**hf, "layer_types": types, "rope_parameters": hf.get("rope_parameters") or DEFAULT_ROPE}
        bias = bool(hf.get("attention_bias", False))
        ple = hf.get("hidden_size_per_layer_input") or None
        return rope_decoder_config(
            hf, dtype, mapping, "Gemma4ForCausalLM", tied_default=True,
            hidden_act=hf_get(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
            extra={"attn_bias": bias, "dense_bias": bias, "qk_norm": True, "v_norm": True,
                   "sublayer_norms": "pre_and_post", "attention_multiplier": 1.0, "layer_scalar": True,
                   "embedding_multiplier": float(hf_get(hf, "hidden_size")) ** 0.5,
                   "final_logit_softcapping": hf.get("final_logit_softcapping"),
                   "sliding_window": hf_get(hf, "sliding_window"), "layer_types": types,
                   "layer_overrides": layer_overrides(hf, types), **moe_fields(hf, mapping),
                   **({"per_layer_input_size": ple,
                       "per_layer_vocab_size": hf_get(hf, "vocab_size_per_layer_input")} if ple else {})})


def moe_fields(hf: dict, mapping: Mapping) -> dict:
    """The experts' config fields where ``enable_moe_block`` is set (every layer has them), checked."""
    if not hf.get("enable_moe_block"):
        return {}
    experts, top_k = hf_get(hf, "num_experts"), hf_get(hf, "top_k_experts")
    inter = hf_get(hf, "moe_intermediate_size")
    check_expert_config(experts, top_k, inter, mapping.tp_size, experts_field="num_experts",
                        top_k_field="top_k_experts", intermediate_field="moe_intermediate_size")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter}


@register_model("Gemma4ForConditionalGeneration")
class Gemma4LanguageModel(NestedLanguageModel, Gemma4ForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        return nested_text_config(super().config_from_hf, hf, dtype, mapping, "Gemma4ForConditionalGeneration")
