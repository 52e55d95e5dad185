"""Checkpoint -> engine: validate against the build limits, fuse once, write atomically."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from kiln import kernels
from kiln.build.lora import lora_build, write_adapters
from kiln.checkpoint.format import (ENGINE_FORMAT_VERSION, atomic_output_dir, copy_tokenizer_files,
                                    rank_file, read_config, read_config_dict, write_config)
from kiln.checkpoint.loader import check_file_tensors
from kiln.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter
from kiln.config import BuildConfig, PretrainedConfig
from kiln.dtypes import DTYPES, torch_dtype
from kiln.errors import BuildError
from kiln.kernels.library import cpu_flags
from kiln.models import get_model_class
from kiln.models.loading import engine_layout_weights, tile_packed_linears
from kiln.quantization import use_weight_only_layout
from kiln.quantization.weight_only import BF16_ENGINE_ALGOS


def validate_limits(config: PretrainedConfig, build: BuildConfig) -> None:
    if config.position_embedding_type == "learned_absolute" and config.max_position_embeddings \
            and build.max_seq_len > config.max_position_embeddings:
        raise BuildError(f"max_seq_len {build.max_seq_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings} (learned positions cannot extrapolate)")
    limit = config.get("max_seq_len_limit")
    if limit and build.max_seq_len > limit:
        raise BuildError(f"max_seq_len {build.max_seq_len} exceeds {limit}, the longest context kiln computes "
                         f"{config.architecture} exactly")
    if build.max_num_tokens < build.max_batch_size:
        raise BuildError(f"max_num_tokens ({build.max_num_tokens}) must be at least max_batch_size "
                         f"({build.max_batch_size}) so every sequence can advance each step")


def resolve_build_config(config: PretrainedConfig, **options: int | None) -> BuildConfig:
    """The build limits: the options given, defaults for the rest.

    Unset ``max_seq_len`` is 4096 capped at the model's ``max_position_embeddings``; unset
    ``max_input_len`` is 2048 capped at ``max_seq_len``.
    """
    given = {k: v for k, v in options.items() if v is not None}
    defaults = BuildConfig()
    if "max_seq_len" not in given:
        given["max_seq_len"] = min(defaults.max_seq_len, config.max_position_embeddings or defaults.max_seq_len,
                                   config.get("max_seq_len_limit") or defaults.max_seq_len)
    if "max_input_len" not in given:
        given["max_input_len"] = min(defaults.max_input_len, given["max_seq_len"])
    return BuildConfig(**given)


ENGINE_DTYPES = tuple(DTYPES)
# Quantization parameters keep their own dtype (float32, or the kernels' float16) in any engine dtype.
QUANT_FLOAT32 = (".weights_scaling_factor", ".zero", ".weights_offset", ".weights_super_scale",
                 ".weights_super_offset", ".prequant_scaling_factor",
                 ".activation_scaling_factor", ".kv_cache_scaling_factor")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), so bf16 matmuls run
    at several times the fp32 rate instead of being emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_engine_dtype(requested: str | None, config: PretrainedConfig) -> str:
    """The engine's compute dtype for ``requested``: a dtype is taken as given; ``"auto"`` (or
    None) is kiln's one rule, the same for ``kiln build``, ``LLM(...)``, ``kiln run`` and
    ``kiln serve``: bfloat16 for a weight-only/FP8 checkpoint (its kernels compute in bf16);
    the checkpoint's dtype when the user chose it at convert time (``keep_dtype``); bfloat16
    for a float32/bfloat16 checkpoint on a CPU with native bf16; else the checkpoint's."""
    if requested not in (None, "auto"):
        if requested not in ENGINE_DTYPES:
            raise BuildError(f"dtype {requested!r} is not one of auto, {', '.join(ENGINE_DTYPES)}")
        return requested
    if config.quantization.quant_algo in BF16_ENGINE_ALGOS:
        return "bfloat16"
    if config.get("keep_dtype"):
        return config.dtype
    if config.dtype in ("float32", "bfloat16") and cpu_has_native_bf16():
        return "bfloat16"
    return config.dtype


def build_engine(checkpoint_dir: str | Path, output_dir: str | Path, build_config: BuildConfig | None = None,
                 progress: bool = True, dtype: str | None = "auto", lora_dirs: list[str | Path] | None = None,
                 max_lora_rank: int | None = None, lora_target_modules: list[str] | None = None,
                 dora: bool = False) -> Path:
    """Validate ``checkpoint_dir`` and write an engine to ``output_dir``.

    Without ``build_config`` the limits come from :func:`resolve_build_config`. The engine
    computes in ``dtype`` (its floating-point weights are cast to it): a dtype name, or
    ``"auto"`` (None too) for :func:`resolve_engine_dtype`'s rule. ``lora_dirs`` /
    ``max_lora_rank`` / ``lora_target_modules`` / ``dora``: LoRA settings and adapters kept in
    the engine (kiln.build.lora).
    """
    checkpoint_dir = Path(checkpoint_dir)
    config = read_config(checkpoint_dir)
    build_config = build_config or resolve_build_config(config)
    validate_limits(config, build_config)
    lora_section, lora_adapters = None, {}
    if lora_dirs or max_lora_rank is not None or lora_target_modules or dora:
        lora_section, lora_adapters = lora_build(config, list(lora_dirs or []), max_lora_rank, lora_target_modules,
                                                 dora)
    dtype = resolve_engine_dtype(dtype, config)
    # Weight-only and FP8 kernels compute in bf16; SmoothQuant W8A8 (int8 matmul, float32 scales) in any dtype.
    bf16_only = config.quantization.quant_algo in BF16_ENGINE_ALGOS
    if bf16_only and dtype != "bfloat16":
        raise BuildError(f"a {config.quantization.quant_algo} checkpoint builds into a bfloat16 engine (its kernels "
                         f"compute in bf16); got dtype {dtype}")
    cast = getattr(torch, dtype) if dtype != config.dtype else None
    model_cls = get_model_class(config.architecture, source=str(checkpoint_dir / "config.json"))
    raw = read_config_dict(checkpoint_dir)
    with atomic_output_dir(output_dir) as tmp:
        for rank in tqdm(range(config.mapping.world_size), desc="building ranks",
                         disable=not progress or config.mapping.world_size == 1):
            build_rank(checkpoint_dir, tmp, rank, model_cls, cast, progress)
        dtype_field = {"dtype": dtype} if cast is not None else {}
        lora_field = {"lora_config": lora_section} if lora_section else {}
        write_config(tmp, {**raw, **dtype_field, "build_config": build_config.to_dict(),
                           "engine_format": ENGINE_FORMAT_VERSION, **lora_field})
        write_adapters(tmp, lora_adapters)
        copy_tokenizer_files(checkpoint_dir, tmp)
    return Path(output_dir)


def build_rank(checkpoint_dir: Path, out: Path, rank: int, model_cls: type, cast: torch.dtype | None,
               progress: bool = False) -> None:
    """Write rank ``rank``'s engine file from its checkpoint file one decoder layer at a time:
    read the layer's tensors, rewrite them into the engine layout (fusions, the kernels' tile
    order), cast, write, so a build never holds more than one layer. Quantization scales and
    zeros stay float32, FP8 codes e4m3; a bf16 engine's float linear weights go into the tiles
    of ``kernels.pack_bf16`` (``tile_packed_linears``)."""
    config = read_config(checkpoint_dir, rank)
    with torch.device("meta"):
        model = model_cls(config)
        use_weight_only_layout(model, config.quantization, tile_order=False)
        engine_model = model_cls(config, engine_layout=True)
        use_weight_only_layout(engine_model, config.quantization, tile_order=True)

    # Parameters a module holds in float32 in any model dtype (attention sinks) stay float32 too.
    kept = {f"{m}.{p}" for m, module in engine_model.named_modules() if getattr(module, "keeps_float32", False)
            for p, _ in module.named_parameters(recurse=False)}

    def target(name: str, dtype: torch.dtype) -> torch.dtype:
        floating = dtype.is_floating_point and torch.empty((), dtype=dtype).element_size() > 1
        keeps = not floating or name.endswith(QUANT_FLOAT32) or name in kept
        return dtype if cast is None or keeps else cast

    def layer_of(name: str) -> str | None:  # a decoder layer's prefix, or None for the rest
        parts = name.split(".")
        return ".".join(parts[:3]) + "." if parts[:2] == ["transformer", "layers"] and len(parts) > 3 else None

    entries = {name: (target(name, p.dtype), tuple(p.shape)) for name, p in engine_model.named_parameters()}
    tiled = {f"{name}.weight" for name, _ in tile_packed_linears(engine_model, cast or torch_dtype(config.dtype))}
    modules = list(model.named_modules())
    with SafetensorsReader(rank_file(checkpoint_dir, rank)) as reader, \
            SafetensorsWriter(rank_file(out, rank), entries, metadata={"format": "pt"}) as writer:
        check_file_tensors(model, reader)
        groups: dict[str | None, list[str]] = {}
        for name in reader.keys():
            groups.setdefault(layer_of(name), []).append(name)
        for prefix, names in tqdm(groups.items(), desc="building layers", disable=not progress, leave=False):
            weights = {name: reader.read(name) for name in names}
            owned = [(n, m) for n, m in modules if layer_of(n + ".x") == prefix]
            for name, tensor in engine_layout_weights(model, weights, owned).items():
                if name not in entries:
                    raise BuildError(f"engine layout mismatch for rank {rank}: {name!r} is not an engine tensor")
                tensor = tensor.to(entries[name][0])
                writer.write(name, kernels.pack_bf16(tensor) if name in tiled else tensor)
