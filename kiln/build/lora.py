"""LoRA at build time (reference 004's ``--lora_dir``, ``--max_lora_rank``, ``--lora_target_modules``,
``--dora_plugin``).

The engine records which modules take adapters, the largest rank and whether DoRA adapters
are taken in a ``lora_config`` section of its config.json, and keeps the adapters given at build time under
``lora/NAME/`` (NAME: the adapter directory's name) in the reference's tensor files, where
``LLM(...).generate(lora="NAME")`` and ``kiln serve`` find them by name. Every adapter is
checked against the model, the targets and the rank here, so a bad one fails the build.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.checkpoint.lora import (LORA_MODULE_IDS, LORA_MODULE_NAMES, engine_lora_shapes, module_names,
                                 parse_lora_tensors)
from kiln.checkpoint.peft import CONFIG_FILE, WEIGHTS_FILE, read_adapter
from kiln.errors import BuildError, CheckpointError, ConfigError
from kiln.models.lora_targets import lora_module_shapes

ADAPTERS_DIR = "lora"


def lora_build(model_config, lora_dirs: list[str | Path], max_lora_rank: int | None,
               target_modules: list[str] | None, dora: bool = False) -> tuple[dict, dict[str, tuple]]:
    """The engine's ``lora_config`` section and its adapters ``{name: (weights, config)}``."""
    try:
        shapes = lora_module_shapes(model_config)
    except ConfigError as e:
        raise BuildError(f"LoRA: {e}") from None
    for name in target_modules or []:
        if name not in module_names(shapes):
            raise BuildError(f"--lora_target_modules {name!r}: this model takes {module_names(shapes)}")
    if max_lora_rank is not None and max_lora_rank < 1:
        raise BuildError(f"--max_lora_rank must be at least 1, got {max_lora_rank}")
    allowed = engine_lora_shapes(shapes, {"lora_target_modules": target_modules})
    adapters, used, ranks = {}, set(), []
    for directory in lora_dirs:
        name = Path(directory).name
        if name in adapters:
            raise BuildError(f"--lora_dir {directory}: another adapter is already named {name!r} (its directory name)")
        try:
            weights, config = read_adapter(directory)
            modules = parse_lora_tensors(weights, config, allowed, model_config.num_hidden_layers, max_lora_rank,
                                         dora=dora)
        except CheckpointError as e:
            raise BuildError(f"--lora_dir {directory}: {e}") from None
        adapters[name] = (np.asarray(weights), np.asarray(config))
        used |= {m.module_id for m in modules}
        ranks += [m.rank for m in modules]
    if max_lora_rank is None and not ranks:
        raise BuildError("LoRA: give --max_lora_rank, or adapters with --lora_dir to take it from")
    targets = target_modules or [LORA_MODULE_NAMES[i] for i in sorted(used)]
    section = {"max_lora_rank": max_lora_rank or max(ranks), "dora": dora,
               "lora_target_modules": sorted(targets, key=LORA_MODULE_IDS.get), "adapters": sorted(adapters)}
    return section, adapters


def write_adapters(engine_dir: Path, adapters: dict[str, tuple]) -> None:
    for name, (weights, config) in adapters.items():
        directory = engine_dir / ADAPTERS_DIR / name
        directory.mkdir(parents=True)
        np.save(directory / WEIGHTS_FILE, weights)
        np.save(directory / CONFIG_FILE, config)
