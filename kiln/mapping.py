"""Mapping: how a model is split over ranks (tensor and pipeline parallelism)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kiln.errors import ConfigError


@dataclass(frozen=True)
class Mapping:
    """The world a model runs in: ``world_size = tp_size * pp_size`` ranks.

    Rank numbering is tp-major inside a pipeline stage: ``rank = pp_rank * tp_size + tp_rank``.
    """

    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"mapping.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.world_size != self.tp_size * self.pp_size:
            raise ConfigError(
                f"mapping.world_size ({self.world_size}) must equal tp_size ({self.tp_size}) "
                f"* pp_size ({self.pp_size})"
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"mapping.rank {self.rank} is outside [0, {self.world_size})")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def local_rank(self) -> int:
        """This rank's index on its machine (``gpus_per_node`` ranks a machine)."""
        return self.rank % self.gpus_per_node

    @property
    def device(self) -> str:
        """Where this rank computes: its machine's GPU ``local_rank`` when CUDA is there, else the CPU."""
        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"

    def pp_layers(self, num_layers: int) -> range:
        """The global indices of the layers this rank's pipeline stage holds.

        Layers are split as evenly as possible; earlier stages take the remainder.
        """
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))

    def with_rank(self, rank: int) -> "Mapping":
        return Mapping(self.world_size, self.tp_size, self.pp_size, rank, self.gpus_per_node)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("rank")  # a checkpoint describes the world, not one rank of it
        return d

    @classmethod
    def from_dict(cls, d: dict | None, rank: int = 0) -> "Mapping":
        d = dict(d or {})
        d.pop("rank", None)
        unknown = set(d) - {"world_size", "tp_size", "pp_size", "gpus_per_node"}
        if unknown:
            raise ConfigError(f"mapping has unknown fields {sorted(unknown)}")
        if "tp_size" not in d and "pp_size" not in d:
            d["tp_size"] = d.get("world_size", 1)  # a bare world_size means tensor parallelism
        tp, pp = d.get("tp_size", 1), d.get("pp_size", 1)
        return cls(world_size=d.get("world_size", tp * pp), tp_size=tp, pp_size=pp, rank=rank,
                   gpus_per_node=d.get("gpus_per_node", 8))
