"""Resolve what the user points at (HF dir, GGUF file, checkpoint, engine) to an engine dir.

Anything that is not already an engine is converted and built into a cache directory
(default ``~/.cache/kiln``, or ``$KILN_CACHE_DIR``) keyed by the source's identity (path,
file sizes and modification times) and the options. A second call reuses the engine;
two processes racing serialise on a lock file, and the engine appears atomically.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

from kiln import env
from kiln.build import build_engine, resolve_build_config
from kiln.build.builder import cpu_has_native_bf16
from kiln.checkpoint.format import ENGINE_FORMAT_VERSION, read_config, read_config_dict
from kiln.config import BuildConfig, QuantConfig
from kiln.config.quant_algos import ALGOS
from kiln.config.engine_args import EngineArgs
from kiln.config.speculative import SpeculativeConfig
from kiln.convert import convert_checkpoint
from kiln.errors import CheckpointError, ConfigError



def default_cache_dir() -> Path:
    return env.cache_dir()


def classify(path: Path) -> str:
    """'engine', 'checkpoint' or 'external' (Hugging Face dir or GGUF file)."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        try:
            d = json.loads(config.read_text())
        except json.JSONDecodeError:
            d = {}
        if "build_config" in d and "architecture" in d:
            return "engine"
        if "architecture" in d and (path / "rank0.safetensors").is_file():
            return "checkpoint"
    return "external"


def _source_identity(path: Path) -> list:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


# Bumped when conversion builds a different engine from the same source and options, so cached
# engines built the old way are rebuilt. 2: a GGUF's head tied to a quantized table keeps codes.
CONVERSION_REVISION = 2


def cache_key(path: Path, options: dict) -> str:
    blob = json.dumps({"v": ENGINE_FORMAT_VERSION, "conv": CONVERSION_REVISION, "src": _source_identity(path),
                       "opts": options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


CALIBRATION_OPTIONS = ("calib_dataset", "calib_size", "calib_max_len", "smoothquant_alpha", "gptq_act_order",
                       "awq_gptq")


def split_quantization(quantization) -> tuple[dict | None, dict]:
    """``quantization`` as given to ``LLM`` (an algorithm name, a ``QuantConfig``, or a dict of
    QuantConfig fields plus calibration options) -> (QuantConfig fields, convert options)."""
    if quantization is None:
        return None, {}
    if isinstance(quantization, str):
        quantization = {"quant_algo": quantization}
    elif isinstance(quantization, QuantConfig):
        quantization = asdict(quantization)
    elif not isinstance(quantization, dict):
        raise ConfigError(f"quantization: expected an algorithm name, a QuantConfig or a dict, got "
                          f"{type(quantization).__name__}")
    if quantization.get("quant_algo") in ALGOS and "group_size" not in quantization:
        quantization = {**quantization, "group_size": ALGOS[quantization["quant_algo"]].group_size}
    # Every field spelled out (one cache key per setting, however it was given); an unknown
    # field or algorithm is named now, before any work.
    fields = QuantConfig.from_dict({k: v for k, v in quantization.items() if k not in CALIBRATION_OPTIONS}).to_dict()
    return fields, {k: v for k, v in quantization.items() if k in CALIBRATION_OPTIONS}


# Build limits of the engines the cache builds, where they differ from kiln build's defaults:
# every path that builds through the cache (LLM, kiln run, kiln serve, kiln bench) gets the same
# engine for the same source, and it can serve beam search.
CACHE_BUILD_DEFAULTS = {"max_beam_width": 8}


def resolve_engine(model: str | Path, *, dtype: str | None = "auto", build_options: dict | None = None,
                   cache_dir: str | Path | None = None, progress: bool = True, quantization=None,
                   tp_size: int | None = None, pp_size: int | None = None) -> Path:
    """The engine directory for ``model``, converting and building into the cache if needed.

    ``dtype``: the engine's compute dtype, ``"auto"`` (None too) for the rule ``kiln build
    --dtype auto`` follows (``kiln.build.builder.resolve_engine_dtype``); an explicit dtype is
    also the converted checkpoint's. ``build_options``: limits over ``CACHE_BUILD_DEFAULTS`` and
    kiln build's defaults. The cache key holds every resolved setting.

    ``quantization`` (an external model only: an algorithm name such as ``"W8A16"``, a
    ``QuantConfig``, or a dict of its fields plus ``calib_dataset`` / ``calib_size`` /
    ``calib_max_len`` / ``smoothquant_alpha`` / ``gptq_act_order`` / ``awq_gptq``) is applied when
    converting, and so are ``tp_size`` / ``pp_size`` (an external model only: a checkpoint or
    engine keeps the split it was made with).
    """
    path = Path(model).expanduser().absolute()
    kind = classify(path)
    quant_fields, convert_options = split_quantization(quantization)
    if quant_fields is not None and kind != "external":
        raise ConfigError(f"{path} is a kiln {kind}, quantized (or not) when it was converted; pass quantization "
                          "with a Hugging Face directory or GGUF file")
    if kind == "engine":
        return path
    build_options = {**CACHE_BUILD_DEFAULTS, **{k: v for k, v in (build_options or {}).items() if v is not None}}
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    dtype = dtype or "auto"
    # "auto" resolves by the checkpoint and this CPU: the CPU's part goes into the key.
    machine = {"native_bf16": cpu_has_native_bf16()} if dtype == "auto" else {}
    options = {"dtype": dtype, **machine, "kind": kind, **build_options}
    # A checkpoint keeps its split (kiln.cli.world checks it against the flags after the build).
    split = {k: v for k, v in (("tp_size", tp_size), ("pp_size", pp_size))
             if v not in (None, 1) and kind == "external"}
    options.update(split)
    if quant_fields is not None:
        options.update(quantization=quant_fields, **convert_options)
    key = cache_key(path, options)
    engine_dir = cache / f"{path.stem}-{key}"
    if (engine_dir / "config.json").is_file():
        return engine_dir
    with open(cache / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same engine
        if (engine_dir / "config.json").is_file():
            return engine_dir
        checkpoint = path
        if kind == "external":
            checkpoint = cache / f"{path.stem}-{key}.checkpoint"
            quant = QuantConfig.from_dict(quant_fields) if quant_fields is not None else None
            convert_checkpoint(path, checkpoint, dtype=None if dtype == "auto" else dtype, progress=progress,
                               quantization=quant, **split, **convert_options)
        try:
            build_engine(checkpoint, engine_dir, resolve_build_config(read_config(checkpoint), **build_options),
                         progress=progress, dtype=dtype)
        finally:
            if checkpoint != path:
                shutil.rmtree(checkpoint, ignore_errors=True)
    return engine_dir


def engine_for(args: EngineArgs, *, progress: bool = True, tp_size: int | None = None,
               pp_size: int | None = None) -> Path:
    """The engine directory ``args.model`` names: a prebuilt engine after checking it serves
    ``args`` (``EngineArgs.check_engine``), else the cached engine built from the source with
    ``args``' dtype, quantization and build options (``EngineArgs.build_options``)."""
    path = Path(args.model).expanduser().absolute()
    if classify(path) == "engine":
        raw = read_config_dict(path)
        args.check_engine(path, BuildConfig.from_dict(raw["build_config"]), raw["dtype"])
    return resolve_engine(path, dtype=args.dtype, build_options=args.build_options(), cache_dir=args.cache_dir,
                          progress=progress, quantization=args.quantization, tp_size=tp_size, pp_size=pp_size)


def draft_engine_for(config: SpeculativeConfig | dict | str | None, cache_dir: str | Path | None = None,
                     progress: bool = True) -> SpeculativeConfig | None:
    """``config`` with its draft model (``method`` draft_model) resolved to an engine directory: a
    source is converted and built into the cache like the target (quantized with the config's
    ``quantization``, for a quantized copy of the target as its own draft)."""
    config = SpeculativeConfig.parse(config)
    if config is None or config.model is None:
        return config
    args = EngineArgs(model=config.model, cache_dir=cache_dir, quantization=config.quantization)
    return dataclasses.replace(config, model=str(engine_for(args, progress=progress)), quantization=None)
