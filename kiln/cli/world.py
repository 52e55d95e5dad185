"""Running a CLI command on an engine of several ranks.

``with rank_zero(engine_dir):`` around a command's work: for a single-rank engine it does
nothing. For a multi-rank engine it makes the world: under a launcher (``torchrun``,
``mpirun``: every rank runs the same command) it joins it, and every rank but 0 follows rank
0's steps (``kiln.runtime.worker.follow``) and exits; run directly, it spawns the other ranks
on this machine as follower processes. Only rank 0 runs the command's body.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from kiln.checkpoint.format import read_config_dict
from kiln.distributed import init_world, launch_env, shutdown_world
from kiln.distributed.launch import free_port, start_workers, threads_per_rank
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.runtime.engine import Engine
from kiln.runtime.worker import follow


def add_world_flags(parser) -> None:
    g = parser.add_argument_group("parallelism (engines of several ranks)")
    g.add_argument("--tp_size", type=int,
                   help="tensor-parallel ranks: converts an HF dir / GGUF with this split; an engine must have been "
                        "built with it (default: the engine's)")
    g.add_argument("--pp_size", type=int,
                   help="pipeline-parallel stages, as --tp_size (default: the engine's)")


def engine_world(engine_dir: str | Path, tp_size: int | None = None, pp_size: int | None = None) -> tuple[int, int]:
    """(tp_size, pp_size) the engine was built for, checked against the flags given."""
    built = Mapping.from_dict(read_config_dict(engine_dir).get("mapping"))
    for flag, given, have in (("--tp_size", tp_size, built.tp_size), ("--pp_size", pp_size, built.pp_size)):
        if given is not None and given != have:
            raise ConfigError(f"{flag} {given}: {engine_dir} was built for {have} (convert and build it again, or "
                              f"drop the flag)")
    return built.tp_size, built.pp_size


def _follow(engine_dir: str | Path) -> None:
    """This rank (not 0) of the initialised world: follow rank 0's steps, then leave."""
    try:
        follow(Engine(engine_dir))
    finally:
        shutdown_world()


def _spawned_follower(engine_dir: str, tp_size: int, pp_size: int) -> None:
    init_world(tp_size, pp_size)  # rank and meeting point from the environment start_workers set
    _follow(engine_dir)


@contextmanager
def rank_zero(engine_dir: str | Path, tp_size: int | None = None, pp_size: int | None = None):
    """Run the block on rank 0 of the engine's world (see the module docstring)."""
    tp, pp = engine_world(engine_dir, tp_size, pp_size)
    if tp * pp == 1:
        yield
        return
    followers = []
    if launch_env() is not None:  # a launcher started every rank: join them
        if init_world(tp, pp).mapping.rank != 0:
            _follow(engine_dir)
            sys.exit(0)
    else:  # this process is rank 0; the others start here, sharing the cores
        port = free_port()
        followers = start_workers(_spawned_follower, range(1, tp * pp), tp * pp, port, str(engine_dir), tp, pp)
        torch.set_num_threads(threads_per_rank(tp * pp))
        init_world(tp, pp, rank=0, master_addr="127.0.0.1", master_port=port)
    try:
        yield
    finally:
        shutdown_world()
        for process in followers:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
