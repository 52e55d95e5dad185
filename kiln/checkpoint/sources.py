"""Tensor sources: read named tensors, or just a slice of one, from weights files.

A source hides the file format. ``read(key, index)`` returns only the part of a tensor
that ``index`` selects; for safetensors this reads only those rows' bytes (a plain file read,
``kiln.checkpoint.safetensors_io``), for pickled torch files the file is memory-mapped so only
the touched pages are read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from kiln.checkpoint.gguf_source import GGUFSource
from kiln.checkpoint.safetensors_io import SafetensorsReader
from kiln.checkpoint.tensor_source import Index, TensorSource
from kiln.errors import CheckpointError

__all__ = ["Index", "TensorSource", "SafetensorsSource", "TorchFileSource", "GGUFSource", "open_source"]


def _hf_config_next_to(path: Path) -> dict | None:
    config = path / "config.json" if path.is_dir() else path.parent / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config}: not valid JSON ({e})") from None


class SafetensorsSource:
    """One ``.safetensors`` file or a sharded set described by ``*.safetensors.index.json``.

    Tensors are read with plain file reads (``SafetensorsReader``), not through a memory map, so
    a conversion holds only the tensor it works on."""

    def __init__(self, path: Path, files: list[Path]):
        self.path = path
        self._readers: dict[Path, SafetensorsReader] = {}
        self._file_of: dict[str, Path] = {}
        for file in files:
            self._readers[file] = reader = SafetensorsReader(file)
            for name in reader.keys():
                self._file_of[name] = file

    def keys(self) -> Iterable[str]:
        return self._file_of.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._readers[self._file_of[key]].shape(key)

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        file = self._file_of[key]
        try:
            return self._readers[file].read(key, index)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor {key!r} ({e})") from None

    def hf_config(self) -> dict | None:
        return _hf_config_next_to(self.path)


class TorchFileSource:
    """``*.bin`` / ``*.pth`` state dicts, loaded memory-mapped and without unpickling code."""

    def __init__(self, path: Path, files: list[Path]):
        self.path = path
        self._tensors: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except FileNotFoundError:
                raise CheckpointError(f"{file}: no such file") from None
            except Exception as e:
                raise CheckpointError(f"{file}: not a loadable torch state dict ({e})") from None
            if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
                state = state["state_dict"]
            if not isinstance(state, dict):
                raise CheckpointError(f"{file}: expected a dict of tensors, found {type(state).__name__}")
            for name, tensor in state.items():
                if isinstance(tensor, torch.Tensor):
                    self._tensors[name] = tensor

    def keys(self) -> Iterable[str]:
        return self._tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        tensor = self._tensors[key]
        # Copy the slice out of the memory map so the caller owns plain memory.
        return (tensor if index is None else tensor[index]).clone()

    def hf_config(self) -> dict | None:
        return _hf_config_next_to(self.path)


def _files_from_index(index_file: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_file}: not a valid weights index ({e})") from None
    return [index_file.parent / name for name in sorted(set(weight_map.values()))]


def open_source(path: str | Path) -> TensorSource:
    """Open the weights at ``path``: a file, or a directory holding one weights format.

    Preference in a directory: safetensors (index, then files), then ``*.bin``, then
    ``*.pth``, then a single ``*.gguf``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file():
        suffix = path.suffix
        if path.name.endswith(".safetensors.index.json"):
            return SafetensorsSource(path.parent, _files_from_index(path))
        if suffix == ".safetensors":
            return SafetensorsSource(path, [path])
        if suffix in (".bin", ".pth", ".pt"):
            return TorchFileSource(path, [path])
        if suffix == ".gguf":
            return GGUFSource(path)
        raise CheckpointError(f"{path}: unknown weights format (expected .safetensors, .bin, .pth or .gguf)")

    for pattern in ("*.safetensors.index.json", "*.bin.index.json"):
        indexes = sorted(path.glob(pattern))
        if indexes:
            files = _files_from_index(indexes[0])
            cls = SafetensorsSource if pattern.startswith("*.safetensors") else TorchFileSource
            return cls(path, files)
    for pattern, cls in (("*.safetensors", SafetensorsSource), ("*.bin", TorchFileSource),
                         ("*.pth", TorchFileSource)):
        files = sorted(path.glob(pattern))
        if files:
            return cls(path, files)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFSource(ggufs[0])
    if len(ggufs) > 1:
        raise CheckpointError(f"{path}: holds several .gguf files {[g.name for g in ggufs]}; name one")
    raise CheckpointError(f"{path}: no weights found (*.safetensors, *.bin, *.pth or *.gguf)")
