"""Loading a model's weights: from a Hugging Face directory or GGUF file (through the loader's key
map), from a kiln checkpoint or engine, and the engine layout the builder writes (fused and
tile-ordered tensors). ``DecoderModelForCausalLM.from_hugging_face`` / ``from_checkpoint`` call
these; the model module holds the module tree only."""
from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from kiln import host_memory, kernels
from kiln.checkpoint.format import atomic_output_dir, rank_file, write_config, write_rank_weights
from kiln.checkpoint.gguf_source import GGUFSource
from kiln.checkpoint.loader import ModelWeightsLoader, check_file_tensors, fill_parameters, translate_key
from kiln.checkpoint.safetensors_io import SafetensorsReader
from kiln.checkpoint.sources import open_source
from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.linear import Linear
from kiln.mapping import Mapping
from kiln.quantization import use_weight_only_layout
from kiln.quantization.gguf import use_gguf_layout
from kiln.quantization.gptq import gptq_settings, use_gptq_layout
from kiln.quantization.weight_only import SMOOTHQUANT_ALGO


def load_hugging_face(model_cls: type, source, dtype: str | None = None, mapping=None,
                      customized_key_dict: dict | None = None, progress: bool = False,
                      config_overrides: dict | None = None) -> nn.Module:
    """Build this rank's model (``mapping.rank``) from a Hugging Face directory or GGUF file.

    ``config_overrides`` sets checkpoint config fields the Hugging Face config does not
    decide, such as ``use_parallel_embedding`` and ``embedding_sharding_dim``.
    """
    model, loader = prepare_hugging_face(model_cls, source, dtype, mapping, customized_key_dict, config_overrides)
    loader.fill(model, loader.generate_weights(model, progress=progress))
    return model


def prepare_hugging_face(model_cls: type, source, dtype: str | None = None, mapping=None,
                         customized_key_dict: dict | None = None,
                         config_overrides: dict | None = None) -> tuple[nn.Module, ModelWeightsLoader]:
    """This rank's model on the meta device, and the loader that reads its weights from a Hugging
    Face directory or GGUF file (``loader.iter_weights(model)``, one tensor at a time)."""
    source = open_source(source) if isinstance(source, (str, Path)) else source
    hf = source.hf_config()
    if hf is None:
        raise ConfigError(f"{source.path}: no Hugging Face config.json found next to the weights")
    external = set(source.keys())
    config = model_cls.config_for_keys(model_cls.config_from_hf(hf, dtype, mapping or Mapping()), external)
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    loader = ModelWeightsLoader(source, {**model_cls.key_map_for(external), **(customized_key_dict or {})})
    embedding = translate_key("transformer.vocab_embedding.weight", loader.key_map)[0]
    if embedding not in external and embedding.partition(".")[2] in external:
        # Some checkpoints (the original GPT-2 files) drop the top-level prefix.
        loader.key_map["transformer"] = ""
        embedding = embedding.partition(".")[2]
    with torch.device("meta"):
        model = model_cls(config)
    for module in model.modules():  # a layer whose tensors come in several layouts picks this checkpoint's
        if hasattr(module, "match_external_keys"):
            module.match_external_keys(external)
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and not model.shares_embedding_table:
        lm_head_key = translate_key("lm_head.weight", loader.key_map)[0]
        if lm_head_key not in external and (config.get("tie_word_embeddings") or config.share_embedding_table):
            # Tied weights stored once: the lm_head rows come from the embedding table.
            lm_head.external_key_map = {"lm_head": embedding.rpartition(".")[0]}
    gptq = gptq_settings(hf, str(source.path))
    if gptq is not None:  # pre-quantized linears load straight into kiln's W4A16 layout
        model.config = dataclasses.replace(model.config, quantization=use_gptq_layout(
            model, gptq, external, loader.key_map, str(source.path)))
    if isinstance(source, GGUFSource) and source.blocks:  # quantized GGUF linears keep their blocks
        loader.update_key_mapping(model)
        quant = use_gguf_layout(model, source, loader.translate)
        if quant is not None:
            model.config = dataclasses.replace(model.config, quantization=quant)
    return model, loader


def tile_packed_linears(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, Linear]]:
    """The linears whose weight an engine of ``dtype`` holds in the tile layout of
    ``kernels.pack_bf16`` (so loading is a plain read and the weight is held once): in a bf16
    engine, every float linear whose shape tiles, except one sharing its weight with another
    module (a tied lm_head: the embedding reads its rows)."""
    if dtype != torch.bfloat16:
        return []
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) and m.quant_bits is None and not m.fp8 and not m.act_quant
            and uses[id(m.weight)] == 1 and kernels.tile_packable(tuple(m.weight.shape))]


def load_checkpoint(model_cls: type, config: PretrainedConfig, checkpoint_dir: str | Path, rank: int = 0,
                    engine_layout: bool = False) -> nn.Module:
    """Rank ``rank`` of the kiln checkpoint (or, with ``engine_layout``, engine) at ``checkpoint_dir``."""
    with torch.device("meta"):
        model = model_cls(config, engine_layout=engine_layout)
        use_weight_only_layout(model, config.quantization, tile_order=engine_layout)
    tiled = tile_packed_linears(model, torch_dtype(config.dtype)) if engine_layout else []
    for _, linear in tiled:
        linear.tile_order = True
    with SafetensorsReader(rank_file(checkpoint_dir, rank)) as reader:
        check_file_tensors(model, reader)
        if engine_layout:
            # An engine's tensors are already in the kernels' layout: mapped, not read (loading
            # takes no time and the page cache holds the only copy; bf16 tiles and int8 codes
            # decode as fast from file pages). 4-bit codes decode ~16% slower from 4 KiB pages
            # than from huge pages (SmolLM2-1.7B shape, docs/benchmark-log.md): those are read.
            weights = reader.mapped()
            read = [f"{name}.weight" for name, m in model.named_modules()
                    if isinstance(m, Linear) and m.quant_bits in (4, 6)]  # nibbles
        else:  # a checkpoint's are read, for the conversions that rewrite them
            weights, read = {}, [name for name, _ in model.named_parameters()]
        weights.update(_read_to_huge_pages(reader, read))
    fill_parameters(model, weights, source=str(rank_file(checkpoint_dir, rank)))
    if tiled and not kernels.packed_linear_available():  # no bf16 tile kernel here: plain weights for oneDNN
        for _, linear in tiled:
            linear.weight = nn.Parameter(kernels.unpack_bf16(linear.weight), requires_grad=False)
            linear.tile_order = False
    return model


def _read_to_huge_pages(reader: SafetensorsReader, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors ``names`` read once, straight into their places in a huge-page arena per dtype
    (kiln.host_memory)."""
    out = {}
    for dtype in {reader.dtype(name) for name in names}:
        group = [name for name in names if reader.dtype(name) == dtype]
        slots = host_memory.empty_many([torch.Size(reader.shape(name)).numel() for name in group], dtype)
        out.update((name, reader.read_into(name, slot)) for name, slot in zip(group, slots))
    return out


def save_checkpoint(model: nn.Module, checkpoint_dir: str | Path) -> None:
    """Write a single-rank model as a checkpoint (config.json + rank0.safetensors), atomically."""
    if model.config.mapping.world_size != 1:
        raise ConfigError("save_checkpoint writes one rank; use kiln.convert for a multi-rank checkpoint")
    with atomic_output_dir(checkpoint_dir) as tmp:
        write_config(tmp, model.config.to_dict())
        write_rank_weights(tmp, 0, model.checkpoint_weights())


def engine_layout_weights(model: nn.Module, weights: dict[str, torch.Tensor],
                          modules: list[tuple[str, nn.Module]] | None = None) -> dict[str, torch.Tensor]:
    """Rewrite checkpoint tensors into this model's engine layout (fusions done once).
    ``modules``: the modules ``weights`` belong to (default: all), to rewrite one layer at a time."""
    weights = dict(weights)
    for key in [k for k, w in weights.items() if k.endswith(".weight") and w.dtype == torch.float8_e4m3fn]:
        # FP8: the per-tensor weight scale repeated per output column, so a fused pair keeps both.
        scale_key = f"{key[:-6]}weights_scaling_factor"
        weights[scale_key] = weights[scale_key].expand(weights[key].shape[0]).contiguous()
    for name, module in model.named_modules() if modules is None else modules:
        rewrite = getattr(module, "engine_weights", None)
        if rewrite is not None and module is not model:
            weights.update(rewrite(f"{name}.", weights))
    # Quantized codes (int8 and e4m3: one a byte; uint8: 4-bit pairs) go into the kernel's tile order;
    # SmoothQuant W8A8 codes stay row-major for torch._int_mm.

    if model.config.quantization.quant_algo == SMOOTHQUANT_ALGO:
        return weights
    for key in [k for k in weights if k.endswith(".weight") and f"{k[:-6]}weights_scaling_factor" in weights]:
        prefix = key[:-6]
        names = (key, f"{prefix}weights_scaling_factor", f"{prefix}zero", f"{prefix}weights_offset",
                 f"{prefix}weights_super_scale", f"{prefix}weights_super_offset")
        parts = [weights.pop(name, None) for name in names]
        # uint8 codes are 4-bit pairs; int8 ones 8-bit, but for W6A16's (GGUF's Q6_K), the only
        # format with groups of 16 (under super-block scales); e4m3 are FP8's
        codes, scales, super_scale = parts[0], parts[1], parts[4]
        bits = 4 if codes.dtype == torch.uint8 else \
            6 if super_scale is not None and codes.shape[-1] == 16 * scales.shape[-1] else 8
        if parts[0].dim() == 3:  # stacked experts: each packed on its own, kept expert-major
            packed = [_packed_quantized(bits, *(None if t is None else t[e] for t in parts))
                      for e in range(len(parts[0]))]
            packed = tuple(None if packed[0][i] is None else torch.stack([p[i] for p in packed]) for i in range(3))
        else:
            packed = _packed_quantized(bits, *parts)
        for name, tensor in zip((key, f"{prefix}weights_scaling_factor", f"{prefix}weights_offset"), packed):
            if tensor is not None:
                weights[name] = tensor
    return weights


def _packed_quantized(bits: int, codes: torch.Tensor, scales: torch.Tensor, zero: torch.Tensor | None,
                      offsets: torch.Tensor | None, super_scale: torch.Tensor | None = None,
                      super_offset: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One quantized linear's checkpoint tensors in the kernels' layout: (codes, scales, offsets)."""
    packed_scales, packed_offsets = kernels.quant_pack_scales(scales, zero, offsets, super_scale, super_offset)
    return kernels.quant_pack(codes, bits), packed_scales, packed_offsets
