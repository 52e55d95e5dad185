"""Checkpoint and engine directories: ``config.json`` plus ``rank{N}.safetensors`` per rank.

Writes are atomic: everything goes into a temporary sibling directory that is renamed
into place only when complete, so a failure leaves no half-written output behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.config import PretrainedConfig
from kiln.errors import CheckpointError, ConfigError

# The layout of the tensors ``kiln build`` writes (an engine records it as ``engine_format``;
# Engine refuses others). 2: 4-bit codes in panels of two blocks (kiln/kernels/quant_linear.c);
# 3 (never released alone): float16 group offsets (weights_offset) instead of uint8 zero points,
# or bf16 linear weights in tiles; 4: both, and tensors on cache lines for mapping; 5: latent
# attention's kv_b_proj as per-head keys (transposed) and values.
ENGINE_FORMAT_VERSION = 5

CONFIG_NAME = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
                   "added_tokens.json")


def rank_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.safetensors"


@contextlib.contextmanager
def atomic_output_dir(output_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``output_dir`` when the block succeeds."""
    output_dir = Path(output_dir).absolute()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        yield tmp
        if output_dir.exists():
            # Move the old output aside first so the new one appears in a single rename.
            old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
            os.replace(output_dir, old / "x")
            os.replace(tmp, output_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_config(directory: Path, config_dict: dict) -> None:
    (directory / CONFIG_NAME).write_text(json.dumps(config_dict, indent=2, sort_keys=False) + "\n")


def read_config_dict(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (is {directory} a kiln checkpoint or engine?)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def read_config(directory: str | Path, rank: int = 0) -> PretrainedConfig:
    path = Path(directory) / CONFIG_NAME
    return PretrainedConfig.from_dict(read_config_dict(directory), rank=rank, source=str(path))


def write_rank_weights(directory: Path, rank: int, weights: dict[str, torch.Tensor]) -> None:
    tensors = {name: t.detach().contiguous() for name, t in weights.items()}
    save_file(tensors, str(rank_file(directory, rank)), metadata={"format": "pt"})


def read_rank_weights(directory: str | Path, rank: int) -> dict[str, torch.Tensor]:
    """All tensors of one rank file, memory-mapped (no copy until a page is touched)."""
    path = rank_file(directory, rank)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer and generation-config files found in ``src`` into ``dst``."""
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(src) / name
        if path.is_file():
            shutil.copy2(path, Path(dst) / name)
            copied.append(name)
    return copied
