"""Collectives used by tensor-parallel layers, and the point-to-point messages of a world.

Layers call these explicitly in ``forward``. With ``tp_size == 1`` they are no-ops; with
more ranks they run over the tensor-parallel group of this rank's pipeline stage
(``kiln.distributed.world``), which needs an initialised ``torch.distributed`` world.
"""
from __future__ import annotations

import pickle
from contextlib import contextmanager

import torch

from kiln.distributed.world import world
from kiln.errors import KilnError, WorldError


@contextmanager
def guarded(what: str):
    """Turn a collective's failure (a peer gone: connection closed, or the world's timeout)
    into a WorldError saying so."""
    try:
        yield
    except RuntimeError as e:  # torch.distributed.DistBackendError and gloo's errors are RuntimeErrors
        raise WorldError(f"{what}: a rank of the world died or stopped answering ({e})") from e


def _tp_group(tp_size: int):
    current = world()
    if current is None:
        raise KilnError(f"this model is split over tp_size={tp_size} ranks, but no kiln world is initialised; "
                        "run one process per rank (kiln.distributed.init_world, or kiln's --tp_size launch)")
    if current.mapping.tp_size != tp_size:
        raise KilnError(f"a layer split over tp_size={tp_size} ranks runs in a world of tp_size "
                        f"{current.mapping.tp_size}")
    return current.tp_group


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group (in place).

    On gloo with a power-of-two group this is recursive doubling over point-to-point sends:
    partners swap partial sums and add (log2(tp) exchanges; every rank ends with the same bits,
    addition being commutative). gloo's own all-reduce took 0.5-1.9 ms for a decode step's
    hidden states on this machine, a swap 0.1-0.3 ms (``benchmarks/parallel_scaling.py``)."""
    if tp_size == 1:
        return x
    group = _tp_group(tp_size)
    with guarded("tensor-parallel all-reduce"):
        if _swaps_apply(x, tp_size):
            _swap_all_reduce(x, tp_size, group)
        else:
            torch.distributed.all_reduce(x, group=group)
    return x


def _swaps_apply(x: torch.Tensor, tp_size: int) -> bool:
    return world().backend == "gloo" and tp_size & (tp_size - 1) == 0 and x.is_contiguous()


def _swap_all_reduce(x: torch.Tensor, tp_size: int, group) -> None:
    mapping = world().mapping
    first = mapping.pp_rank * tp_size  # the group's ranks: this stage's, tp-major
    partial = torch.empty_like(x)
    step = 1
    while step < tp_size:
        peer = first + (mapping.tp_rank ^ step)
        sending = torch.distributed.isend(x, peer, group=group)
        torch.distributed.recv(partial, peer, group=group)
        sending.wait()
        x += partial
        step *= 2


def all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate the tensor-parallel group's ``x`` along ``dim``, in tp-rank order."""
    if tp_size == 1:
        return x
    group = _tp_group(tp_size)
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    with guarded("tensor-parallel all-gather"):
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def world_min(value: int) -> int:
    """The smallest of every rank's ``value`` (``value`` itself outside a world): for settings
    each rank derives from its own machine, such as a KV cache sized by free memory, which all
    ranks must share to schedule in lockstep."""
    if world() is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    with guarded("agreeing on a setting"):
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t)


# -- point to point: rank 0's steps, activations between pipeline stages, sampled tokens --------

# Sends in progress, with the tensors they read (freed only once sent).
_SENDS: list[tuple[object, torch.Tensor]] = []


def send_tensor(x: torch.Tensor, dst: int, tag: int, group=None) -> None:
    """Start sending ``x`` to rank ``dst`` and return at once (the receiver may still be busy
    with an earlier step: that is what lets pipeline stages overlap)."""
    x = x.contiguous()
    with guarded(f"sending to rank {dst}"):
        work = torch.distributed.isend(x, dst, group=group, tag=tag)
    _SENDS.append((work, x))
    _SENDS[:] = [(w, t) for w, t in _SENDS if not w.is_completed()]


def recv_tensor(shape, dtype: torch.dtype, src: int, tag: int, group=None) -> torch.Tensor:
    """Wait for the tensor rank ``src`` sends with ``tag``."""
    x = torch.empty(shape, dtype=dtype)
    with guarded(f"waiting for rank {src}"):
        torch.distributed.recv(x, src, group=group, tag=tag)
    return x


def send_object(obj, dsts: int | list[int], tag: int, group=None) -> None:
    """Start sending a picklable ``obj`` to rank ``dsts`` (or each of a list: pickled once),
    its length, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    for dst in [dsts] if isinstance(dsts, int) else dsts:
        send_tensor(size, dst, tag, group)
        send_tensor(data, dst, tag, group)


def recv_object(src: int, tag: int, group=None):
    """Wait for the object rank ``src`` sends with ``tag``."""
    size = int(recv_tensor((1,), torch.int64, src, tag, group))
    return pickle.loads(recv_tensor((size,), torch.uint8, src, tag, group).numpy().tobytes())


def wait_sends() -> None:
    """Wait until every send started here has left (before leaving the world)."""
    with guarded("finishing sends"):
        for work, _ in _SENDS:
            work.wait()
    _SENDS.clear()
