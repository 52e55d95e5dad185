"""Engine: a built engine directory loaded for execution.

Loading does no conversion work: the model is created on the ``meta`` device and its tensors
are views of ``rank{N}.safetensors`` mapped copy-on-write (``kiln.models.loading.load_checkpoint``),
already in the kernels' layout (bf16 linear weights in the packed kernel's tiles); the few the
build leaves plain (a tied lm_head) are then packed once.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from kiln import host_memory, kernels
from kiln.checkpoint.format import ENGINE_FORMAT_VERSION, read_config_dict
from kiln.config import BuildConfig, PretrainedConfig
from kiln.distributed import world
from kiln.errors import ConfigError
from kiln.layers.linear import Linear
from kiln.layers.expert_linear import ExpertLinear
from kiln.mapping import Mapping
from kiln.models import get_model_class


class Engine:
    """A loaded engine: ``config``, ``build_config`` and the model of one rank."""

    def __init__(self, engine_dir: str | Path, rank: int | None = None):
        """Load ``engine_dir``; an engine built for several ranks loads this process's rank of
        the ``kiln.distributed`` world it runs in (``rank`` overrides it)."""
        self.engine_dir = Path(engine_dir)
        started = time.perf_counter()
        raw = read_config_dict(self.engine_dir)
        if "build_config" not in raw:
            raise ConfigError(f"{self.engine_dir / 'config.json'}: no build_config section; "
                              "this is a checkpoint, not an engine (run kiln build)")
        built_as = raw.get("engine_format", 1)
        if built_as != ENGINE_FORMAT_VERSION:
            raise ConfigError(f"{self.engine_dir}: engine format {built_as}, but this kiln runs format "
                              f"{ENGINE_FORMAT_VERSION} (its kernels' weight layout changed): rebuild the engine "
                              "from its checkpoint with kiln build")
        self.build_config = BuildConfig.from_dict(raw["build_config"])
        # LoRA settings of the build (max_lora_rank, lora_target_modules; kiln.build.lora), or None,
        # and the adapters built in, by name.
        self.lora_config: dict | None = raw.get("lora_config")
        names = (self.lora_config or {}).get("adapters", [])
        self.lora_adapter_dirs: dict[str, Path] = {name: self.engine_dir / "lora" / name for name in names}
        rank = _world_rank(self.engine_dir, Mapping.from_dict(raw.get("mapping")), rank)
        self.config = PretrainedConfig.from_dict(raw, rank=rank, source=str(self.engine_dir / "config.json"))
        model_cls = get_model_class(self.config.architecture, source=str(self.engine_dir / "config.json"))
        self.model = model_cls.from_checkpoint(self.engine_dir, rank, engine_layout=True)
        self.model.eval()
        _prepack_linear_weights(self.model)
        self.load_seconds = time.perf_counter() - started

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.engine_dir if (self.engine_dir / "tokenizer_config.json").is_file() else None


def _world_rank(engine_dir: Path, built: Mapping, rank: int | None) -> int:
    """The rank this process loads: 0 for a single-rank engine; in a world, its own, once the
    world is the shape the engine was built for."""
    current = world()
    if built.world_size == 1:
        if current is not None and current.mapping.world_size != 1:
            raise ConfigError(f"{engine_dir}: a single-rank engine, but this process is rank "
                              f"{current.mapping.rank} of a world of {current.mapping.world_size}")
        return 0
    if current is None:
        if rank is not None:  # loading one rank's weights to inspect them; running it needs the world
            return rank
        raise ConfigError(f"{engine_dir}: built for tp_size {built.tp_size} x pp_size {built.pp_size} ranks; run "
                          "it in that many processes (kiln --tp_size/--pp_size, torchrun, mpirun)")
    shape = (current.mapping.tp_size, current.mapping.pp_size)
    if shape != (built.tp_size, built.pp_size):
        raise ConfigError(f"{engine_dir}: built for tp_size {built.tp_size} x pp_size {built.pp_size}, but this world "
                          f"is tp_size {shape[0]} x pp_size {shape[1]}")
    return current.mapping.rank if rank is None else rank


def _prepack_linear_weights(model) -> None:
    """Pack the bf16 linear weights the build left plain (a tied lm_head, MoE experts) that the
    packed kernel takes now, into one huge-page arena: done lazily, the copies would land on
    4 KiB pages and in the first request's time."""
    linears = []
    for module in model.modules():
        if isinstance(module, Linear):
            linears.append(module)
        elif isinstance(module, ExpertLinear):  # each expert's matmul is a Linear viewing its slice
            linears.extend(module.expert_linears())
    linears = [m for m in linears if not m.tile_order and kernels.packed_supported(m.weight)]
    for linear, buffer in zip(linears, host_memory.empty_many([m.weight.numel() for m in linears], torch.bfloat16)):
        linear.packed_weight(out=buffer)
