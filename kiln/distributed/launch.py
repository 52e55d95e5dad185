"""Local workers: run a function in ``world_size`` fresh processes on this machine, each with
the environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so the same code runs under either."""
from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Callable, Iterable

import torch
import torch.multiprocessing as mp


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for the world's meeting point)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_per_rank(local_ranks: int) -> int:
    """Compute threads for each of ``local_ranks`` processes sharing this machine's cores (more
    spinning threads than cores would take turns at every collective)."""
    return max(1, (os.cpu_count() or 1) // local_ranks)


def _worker(index: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(index), WORLD_SIZE=str(world_size), LOCAL_RANK=str(index),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    fn(*args)


def spawn_workers(fn: Callable, world_size: int, *args) -> None:
    """Run ``fn(*args)`` in ``world_size`` spawned processes (ranks 0..world_size-1) and wait
    for all; a worker's exception is raised here (``torch.multiprocessing.ProcessRaisedException``)
    after the others are stopped. ``fn`` must be importable (a module-level function)."""
    mp.start_processes(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True,
                       start_method="spawn")


def start_workers(fn: Callable, ranks: Iterable[int], world_size: int, port: int, *args) -> list:
    """Start ``fn(*args)`` as ranks ``ranks`` of a ``world_size`` world meeting at
    127.0.0.1:``port`` (daemon processes, not waited for: the caller is another rank)."""
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_worker, args=(rank, fn, world_size, port, args), daemon=True)
                 for rank in ranks]
    for process in processes:
        process.start()
    return processes
