"""GGUF files at their own precision: each linear whose GGUF tensors are quantized keeps its
blocks' codes, scales and offsets (``kiln.quantization.gguf_blocks``) in a weight-only kiln
format with 32 weights a group (Q6_K's 16), recorded per linear in a ``MIXED_PRECISION`` quantization config
(``QuantConfig.quantized_layers``), since one file mixes types (Q4_K_M: Q4_K, Q6_K, ...):

* Q4_0 -> W4A16 (zero point 8); Q4_1, Q4_K -> W4A16 with offsets; Q8_0, Q5_0 -> W8A16 with
  group scales; Q5_1, Q5_K -> W8A16 with offsets: the file's values exactly (K-quants keep their
  6-bit scale and minimum codes under each super-block's float16 ``d`` and ``dmin``:
  ``super_scales``);
* Q6_K -> W6A16: its 6-bit codes, int8 scales of 16 weights and float16 ``d`` as they are; in a
  fused linear beside other types (Q4_K_M's attn_v in qkv), W8A16 rounded as below;
* any other quantized type (Q2_K, Q3_K, IQ*) -> W8A16 with group scales, rounded to nearest from
  the dequantized values;
* float tensors (F32, F16, BF16) and the embedding stay float; a head tied to a quantized
  embedding gets codes of its own in the table's format (as llama.cpp's output matmul reads the
  table's blocks): Q8_0 SmolLM2-135M's head is 28 MB of codes a decode step reads instead of
  57 MB of bf16, on a 135M model nearly half of what the step reads.

A fused linear (q, k and v; an engine's gate and up) whose parts come in different types takes
the finest of their formats, which holds each part exactly (8-bit codes hold 4- and 5-bit
groups); one float part leaves the whole linear float. Layers the kernels cannot tile (out
features not a multiple of 16) stay float too.

Every architecture ``GGUFSource`` reads works alike (q/k rows un-permuted where llama.cpp's
converter permuted them: llama, mistral, smollm3, granite), and so do linears picking whole rows
of one tensor (Qwen3-Next's ``in_proj_ba``: ``Linear.source_rows``). Linears that read only part of a
tensor or reorder its rows on loading (Phi-3's and GLM-4's fused ``gate_up_proj``, ERNIE 4.5's
and GLM-4's adjacent rotary pairs, DeepSeek-V2's latent attention's rotary rows) stay float.

Stacked experts (the 3-D ``ffn_{gate,up,down}_exps`` of Qwen3-MoE, gpt-oss and DeepSeek-V2
files) import the same way, expert by expert, into :class:`ExpertLinear`'s expert-major
parameters; an expert's gate and up projections share the finer of their formats, as a gated
MLP's do (an engine fuses them).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from kiln import kernels
from kiln.checkpoint.gguf_source import BLOCKS, FLOAT_TYPES, GGUFSource
from kiln.config import LayerQuant, QuantConfig
from kiln.config.quant_algos import LAYER_ALGOS, MIXED_PRECISION
from kiln.layers.expert_linear import ExpertLinear
from kiln.layers.linear import Linear
from kiln.layers.mlp import GatedMLP
from kiln.layers.moe import MixtureOfExperts
from kiln.quantization.gguf_blocks import GROUP, Native, decode, finest, native, to_format

log = logging.getLogger(__name__)

EXPERT_RUN_BYTES = 1 << 25  # raw blocks of stacked experts decoded at once (32 MB: ~60M weights at 4 bits)


def _format(linear: Linear | ExpertLinear, types: list) -> Native | None:
    """The kiln format of a linear (or stacked experts) made of GGUF tensors of ``types`` (None: float)."""
    plain = not (linear.source_transposed or linear.fused_part is not None
                 or getattr(linear, "interleaved_part", None) is not None or getattr(linear, "mxfp4_source", False)
                 or getattr(linear, "interleaved_heads", False) or getattr(linear, "adjacent_rotary_dims", 0))
    if not plain or any(t in FLOAT_TYPES for t in types):
        return None
    f = finest([native(t) for t in types])
    return f if kernels.quant_shape_tiles(linear.out_features, linear.in_features, f.bits, f.group) else None


def _untie_head(model: nn.Module, source: GGUFSource, embedding: str) -> Native | None:
    """The format of a ``lm_head`` sharing a quantized embedding table ``embedding``, now untied
    (the config records ``share_embedding_table`` false) to read the table's blocks; None when
    there is no such head."""
    head = getattr(model, "lm_head", None)
    if head is None or not getattr(model, "shares_embedding_table", False) or embedding not in source.keys():
        return None
    f = _format(head, [source.tensor_type(embedding)])
    if f is not None:
        model.config = dataclasses.replace(model.config, share_embedding_table=False)
        head.weight = nn.Parameter(torch.empty_like(head.weight), requires_grad=False)  # no longer the table
        head.external_key_map = {"lm_head": embedding.rpartition(".")[0]}
    return f


def _plan(model: nn.Module, source: GGUFSource,
          translate) -> dict[str, tuple[Linear | ExpertLinear, list, Native]]:
    """Each linear to import natively -> (module, its GGUF tensors' types, its format)."""
    embedding, external = set(translate("transformer.vocab_embedding.weight")), set(source.keys())
    plan = {}
    head = _untie_head(model, source, min(embedding)) if len(embedding) == 1 else None
    if head is not None:
        plan["lm_head"] = (model.lm_head, [source.tensor_type(min(embedding))], head)
    for name, linear in model.named_modules():
        if not isinstance(linear, (Linear, ExpertLinear)) or name in plan:
            continue
        keys = translate(f"{name}.weight")
        if embedding & set(keys) or not external.issuperset(keys):
            continue  # a head tied to a float embedding stays float, as the table does
        types = [source.tensor_type(k) for k in keys]
        f = _format(linear, types)
        if f is not None:
            plan[name] = (linear, types, f)
    # An engine fuses a gated MLP's (or gated experts') fc and gate into one linear: they share the finer format.
    for name, mlp in model.named_modules():
        if isinstance(mlp, (GatedMLP, MixtureOfExperts)) and not mlp.fused and getattr(mlp, "gated", True):
            pair = [f"{name}.fc", f"{name}.gate"]
            if not all(p in plan for p in pair):
                for p in pair:
                    plan.pop(p, None)
                continue
            shared = finest([plan[p][2] for p in pair])
            for p in pair:
                plan[p] = (*plan[p][:2], shared)
    return plan


def use_gguf_layout(model: nn.Module, source: GGUFSource, translate) -> QuantConfig | None:
    """Switch the linears of a meta-device ``model`` whose GGUF tensors are quantized to their
    weight-only parameters, loaded from the tensors' raw blocks (``source`` opened with
    ``blocks=True``; ``translate``: the loader's kiln name -> external names); returns the
    ``MIXED_PRECISION`` config to record, or None when every linear stays float."""
    plan = _plan(model, source, translate)
    layers = {}
    for name, (linear, types, f) in plan.items():
        algo = next(name for name, bits in LAYER_ALGOS.items() if bits == f.bits)
        layers[name] = LayerQuant(algo, f.group, has_offset=f.offset, codebook=f.codebook, super_scales=f.super_scales)
        linear.use_weight_only(f.bits, f.group, False, has_offset=f.offset, codebook=f.codebook,
                               super_scales=f.super_scales)
        linear.external_key_map = {**(getattr(linear, "external_key_map", None) or {}), "weight": BLOCKS}
        linear.weight_postprocess = (_experts_postprocess_for(types[0], f) if isinstance(linear, ExpertLinear)
                                     else _postprocess_for(types, f, getattr(linear, "source_rows", None)))
        if not f.exact:
            log.info("%s: GGUF %s rounded to nearest into 8-bit codes (a scale per %d weights)", name,
                     "/".join(t.name for t in types), GROUP)
    if not layers:
        return None
    return QuantConfig(quant_algo=MIXED_PRECISION, group_size=GROUP, quantized_layers=layers)


def _postprocess_for(types: list, f: Native, rows: torch.Tensor | None = None):
    """A ``Linear.weight_postprocess``: the raw blocks of the linear's GGUF tensors (q, k and v
    one after another) -> its kiln tensors in format ``f``; with ``rows`` (``Linear.source_rows``),
    just those rows of the one tensor (a row's blocks are its own, so picking them is exact)."""

    def postprocess(key: str, weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        stem = key.rpartition(".")[0]
        if rows is not None:
            weights = [weights[0].index_select(0, rows)]
        tensors = to_format([decode(raw, t, f.group) for raw, t in zip(weights, types)], f.bits, f.offset,
                            f.codebook, f.super_scales)
        return {f"{stem}.{name}": tensor for name, tensor in tensors.items()}

    return postprocess


def _experts_postprocess_for(qtype, f: Native):
    """An ``ExpertLinear.weight_postprocess``: a stacked GGUF tensor's raw blocks ``[E, rows,
    bytes]`` -> the experts' kiln tensors in format ``f``, stacked expert-major."""

    def postprocess(key: str, weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        stem, raw = key.rpartition(".")[0], weights[0]
        experts, rows = raw.shape[:2]
        # Every step is row by row: a run of experts decodes at once (a few hundred MB of
        # intermediates at most: 128 experts at once took 3.8 GB for Qwen3-30B-A3B's shapes).
        run = max(1, EXPERT_RUN_BYTES // raw[0].numel())
        parts = [to_format([decode(raw[e:e + run].flatten(0, 1), qtype, f.group)], f.bits, f.offset, f.codebook,
                           f.super_scales)
                 for e in range(0, experts, run)]
        return {f"{stem}.{name}": torch.cat([p[name] for p in parts]).view(experts, rows, -1) for name in parts[0]}

    return postprocess
