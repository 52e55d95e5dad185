"""What every weights format offers the loader: named tensors, read whole or a slice at a time."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol

import torch

Index = tuple[slice, ...]


class TensorSource(Protocol):
    """What the weights loader needs from a weights format."""

    path: Path

    def keys(self) -> Iterable[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, index: Index | None = None) -> torch.Tensor: ...

    def hf_config(self) -> dict | None:
        """The Hugging Face style config the weights come with, if the format carries one."""
        ...
