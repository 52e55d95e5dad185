"""Which LoRA modules each linear of a decoder holds, and so which modules each layer takes.

An adapter row names a module (``kiln.checkpoint.lora.LORA_MODULE_IDS``) of a layer; this marks
every linear with the modules whose deltas land in its output columns (``Linear.lora_targets``):

    attention      qkv: attn_qkv, attn_q, attn_k, attn_v (a KV-shared layer's: attn_q only);
                   dense: attn_dense
    MLP            fc (the activated branch): mlp_h_to_4h; gate (up): mlp_gate; both fused or kept
                   as two halves: mlp_gate_up; proj: mlp_4h_to_h
    short conv,    in_proj: mixer_in; out_proj: mixer_out
    Mamba2
    Gated DeltaNet in_proj_qkv / _z / _b / _a: linear_attn_qkv / _z / _b / _a, and (Qwen3-Next)
                   their rows of linear_attn_qkvz / linear_attn_ba; out_proj: mixer_out (value
                   heads in llama.cpp's tiled order take the adapter's rows and columns in it)

A mixture-of-experts block takes none (experts, router and shared expert run fused). Shapes and
validation come from the same marks (``lora_module_shapes``), so an adapter row for a module a
layer lacks is refused, never silently dropped.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kiln.checkpoint.gguf_hybrid import tiled_delta_net_order
from kiln.checkpoint.lora import LORA_MODULE_IDS, ModuleShapes
from kiln.config import PretrainedConfig
from kiln.layers.gated_delta_net import GatedDeltaNet
from kiln.layers.linear import Linear
from kiln.layers.lora import LoraTarget
from kiln.layers.mamba2 import Mamba2
from kiln.layers.mlp import MLP, GatedMLP
from kiln.layers.short_conv import ShortConv
from kiln.mapping import Mapping
from kiln.models.registry import get_model_class

# Gated DeltaNet's projections: their own module, and (Qwen3-Next) the fused one they come from.
_DELTA_NET = {"in_proj_qkv": ("linear_attn_qkv", "linear_attn_qkvz"),
              "in_proj_z": ("linear_attn_z", "linear_attn_qkvz"),
              "in_proj_b": ("linear_attn_b", "linear_attn_ba"), "in_proj_a": ("linear_attn_a", "linear_attn_ba")}


def assign_lora_targets(layers: dict[str, nn.Module]) -> None:
    """Mark the linears of ``layers`` (the decoder's, by index) with the modules they hold.
    Column ranges are this rank's: its adapters are sharded to match (kiln.runtime.lora_cache)."""
    for key, layer in layers.items():
        i = int(key)

        def target(name: str, start: int, stop: int, rows: torch.Tensor | None = None,
                   columns: torch.Tensor | None = None) -> LoraTarget:
            return LoraTarget(i, LORA_MODULE_IDS[name], start, stop, rows, columns)

        attn, mixer, mlp = (getattr(layer, name, None) for name in ("attention", "mixer", "mlp"))
        if attn is not None:
            _attention(attn, target)
        if mixer is not None:
            _mixer(mixer, target)
        if isinstance(mlp, (MLP, GatedMLP)):
            _mlp(mlp, target)


def _attention(attn: nn.Module, target) -> None:
    q = attn.qkv.q_size // attn.qkv.tp_size  # this rank's query rows (with their gates, Qwen3.5)
    if attn.kv_source is not None:  # a KV-shared layer projects queries only
        attn.qkv.lora_targets = (target("attn_q", 0, q),)
    else:
        kv = attn.qkv.kv_size // attn.qkv.kv_tp_size
        attn.qkv.lora_targets = (target("attn_qkv", 0, q + 2 * kv), target("attn_q", 0, q),
                                 target("attn_k", q, q + kv), target("attn_v", q + kv, q + 2 * kv))
    attn.dense.lora_targets = (target("attn_dense", 0, attn.dense.out_features),)


def _mlp(mlp: nn.Module, target) -> None:
    inter = mlp.proj.in_features
    mlp.proj.lora_targets = (target("mlp_4h_to_h", 0, mlp.proj.out_features),)
    if isinstance(mlp, GatedMLP) and mlp.fused:
        mlp.fused_fc.lora_targets = (target("mlp_gate_up", 0, 2 * inter), target("mlp_h_to_4h", 0, inter),
                                     target("mlp_gate", inter, 2 * inter))
    elif isinstance(mlp, GatedMLP):  # two linears: each takes its half of mlp_gate_up's rows
        mlp.fc.lora_targets = (target("mlp_h_to_4h", 0, inter), target("mlp_gate_up", 0, inter, torch.arange(inter)))
        mlp.gate.lora_targets = (target("mlp_gate", 0, inter),
                                 target("mlp_gate_up", 0, inter, torch.arange(inter, 2 * inter)))
    else:
        mlp.fc.lora_targets = (target("mlp_h_to_4h", 0, inter),)


def _mixer(mixer: nn.Module, target) -> None:
    if isinstance(mixer, (ShortConv, Mamba2)):
        mixer.in_proj.lora_targets = (target("mixer_in", 0, mixer.in_proj.out_features),)
        mixer.out_proj.lora_targets = (target("mixer_out", 0, mixer.out_proj.out_features),)
    elif isinstance(mixer, GatedDeltaNet):
        _delta_net(mixer, target)


def _delta_net(mixer: GatedDeltaNet, target) -> None:
    # value heads in llama.cpp's tiled order: the adapter's rows and columns taken in that order
    tiled = mixer.value_heads_tiled and mixer.num_value_heads != mixer.num_key_heads
    order = (tiled_delta_net_order(mixer.num_key_heads, mixer.num_value_heads, mixer.key_dim, mixer.value_dim)
             if tiled else {})
    for name, (own, fused) in _DELTA_NET.items():
        linear: Linear = getattr(mixer, name)
        rows = getattr(linear, "source_rows", None)  # Qwen3-Next: its rows of the fused projection
        linear.lora_targets = ((target(own, 0, linear.out_features, order.get(name, (None, None))[0]),)
                               + (() if rows is None else (target(fused, 0, linear.out_features, rows),)))
    columns = order.get("out_proj", (None, None))[1]
    mixer.out_proj.lora_targets = (target("mixer_out", 0, mixer.out_proj.out_features, columns=columns),)


def lora_targets_shapes(model: nn.Module) -> ModuleShapes:
    """(layer, module id) -> (in, out) features of every module the linears of ``model`` hold
    (once marked), by layer then module id: a module split over linears counts each one's rows."""
    shapes: dict[tuple[int, int], tuple[int, int]] = {}
    for linear in model.modules():
        for t in getattr(linear, "lora_targets", ()):
            size_in, size_out = shapes.get((t.layer, t.module_id), (linear.in_features, 0))
            rows = t.stop - t.start if t.rows is None else t.rows.numel()
            shapes[t.layer, t.module_id] = (size_in, size_out + rows)
    return dict(sorted(shapes.items()))


_SHAPES: dict[str, ModuleShapes] = {}  # by the config's repr (a config is not hashable): a few per process


def lora_module_shapes(config: PretrainedConfig) -> ModuleShapes:
    """The modules a model of ``config`` takes adapters on, layer by layer, at their whole
    (single-rank) sizes: what adapters are checked against before they are sharded. Raises
    ConfigError for a family that takes no adapters."""
    key = repr(config)
    if key not in _SHAPES:
        with torch.device("meta"):  # no memory: only the structure matters
            model = get_model_class(config.architecture)(dataclasses.replace(config, mapping=Mapping()))
        model.assign_lora_targets()
        if len(_SHAPES) >= 16:
            _SHAPES.pop(next(iter(_SHAPES)))
        _SHAPES[key] = lora_targets_shapes(model)
    return _SHAPES[key]
