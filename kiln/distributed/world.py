"""The world a rank runs in: which process it is, its pipeline stage and tensor-parallel group.

A world is ``tp_size * pp_size`` processes (reference 003's world configuration), numbered
tp-major inside a stage (``kiln.mapping.Mapping``). Each process calls ``init_world`` once;
it reads its rank and the world size from the launcher's environment when not given:
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), Open MPI's ``mpirun``
(``OMPI_COMM_WORLD_*``) or a PMI launcher (MPICH, Slurm: ``PMI_RANK``, ``PMI_SIZE``), and
meets the others at ``MASTER_ADDR:MASTER_PORT`` over TCP. The backend is gloo on CPU and NCCL
on CUDA; every collective has a timeout, so a dead rank ends the others' waits with an error
instead of a hang.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from kiln.errors import ConfigError
from kiln.mapping import Mapping

DEFAULT_TIMEOUT_S = 120.0  # the longest any rank waits in a collective before giving up
# How long a rank waits for rank 0's next step: a server may sit idle for days. A rank 0 that
# dies still ends the wait at once (gloo sees its connection close).
CONTROL_TIMEOUT = timedelta(days=365)

# (launcher, rank, world size, local rank) environment variables, in the order they are tried.
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI (MPICH, Slurm)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher told this process: its rank, the world size, its rank on this machine."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int


def launch_env(environ: dict | None = None) -> LaunchEnv | None:
    """This process's place in the world from a launcher's environment, or None when no
    launcher set one."""
    environ = os.environ if environ is None else environ
    for launcher, rank_key, size_key, local_key in LAUNCHERS:
        if rank_key in environ and size_key in environ:
            try:
                rank, size = int(environ[rank_key]), int(environ[size_key])
                local = int(environ.get(local_key, rank))
            except ValueError:
                raise ConfigError(f"{launcher}: {rank_key}={environ[rank_key]!r} / {size_key}={environ[size_key]!r} "
                                  "are not whole numbers") from None
            return LaunchEnv(launcher, rank, size, local)
    return None


@dataclass
class World:
    """An initialised world: this rank's ``mapping``, the process group of its stage's
    tensor-parallel ranks (None with one) and the group rank 0's steps reach the others
    over (every rank; no timeout to speak of, see ``CONTROL_TIMEOUT``)."""

    mapping: Mapping
    tp_group: object
    backend: str
    timeout_s: float
    control_group: object = None


_WORLD: World | None = None


def world() -> World | None:
    """The world this process runs in, or None outside one (a single-process run)."""
    return _WORLD


def init_world(tp_size: int = 1, pp_size: int = 1, *, rank: int | None = None, gpus_per_node: int = 8,
               master_addr: str | None = None, master_port: int | None = None, backend: str | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join the world of ``tp_size * pp_size`` ranks as ``rank`` (default: the launcher's) and
    make this stage's tensor-parallel group. Every rank of the world calls it."""
    global _WORLD
    if _WORLD is not None:
        raise ConfigError("this process is already in a kiln world (kiln.distributed.shutdown_world first)")
    size = tp_size * pp_size
    env = launch_env()
    if rank is None:
        if env is None:
            raise ConfigError(f"a world of {size} ranks: no rank given and no launcher environment "
                              f"({', '.join(name for name, *_ in LAUNCHERS)}) to read it from")
        rank = env.rank
    if env is not None and env.world_size != size:
        raise ConfigError(f"{env.launcher} started {env.world_size} processes, but tp_size {tp_size} x pp_size "
                          f"{pp_size} needs {size}")
    mapping = Mapping(world_size=size, tp_size=tp_size, pp_size=pp_size, rank=rank, gpus_per_node=gpus_per_node)
    addr = master_addr or os.environ.get("MASTER_ADDR")
    port = master_port or os.environ.get("MASTER_PORT")
    if addr is None or port is None:
        raise ConfigError("a world needs a meeting point: set MASTER_ADDR and MASTER_PORT (torchrun sets them), "
                          "or pass master_addr / master_port")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(mapping.device)
    torch.distributed.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                                         timeout=timedelta(seconds=timeout_s))
    tp_group = None
    for stage in range(pp_size):  # every rank creates every group, in the same order
        group = torch.distributed.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)),
                                            timeout=timedelta(seconds=timeout_s))
        if stage == mapping.pp_rank:
            tp_group = group
    control_group = torch.distributed.new_group(list(range(size)), timeout=CONTROL_TIMEOUT)
    _WORLD = World(mapping, tp_group if tp_size > 1 else None, backend, timeout_s, control_group)
    return _WORLD


def shutdown_world() -> None:
    """Leave the world (a no-op outside one)."""
    global _WORLD
    if _WORLD is not None:
        torch.distributed.destroy_process_group()
        _WORLD = None
