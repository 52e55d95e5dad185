"""The ranks of a world other than the scheduler's.

Rank 0 runs the engine core (scheduler, sampling, the executor and server above it); every
other rank calls ``follow`` and computes its part of each step rank 0 schedules. Rank 0's
``Leader`` broadcasts, over the whole world, first the KV cache settings (every rank then
sizes its cache to the world's minimum), then each step as plain data
(``kiln.runtime.model_runner.StepInputs``) with the LoRA adapters the other ranks have not seen
(each shards them for itself, reference 004's rule), and finally a stop. Every broadcast has
the world's timeout, so a rank that dies ends the others' waits with an error.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

from kiln.distributed.comm import guarded
from kiln.errors import KilnError, WorldError
from kiln.runtime.engine import Engine
from kiln.runtime.lora_cache import parse_adapter
from kiln.runtime.model_runner import ModelRunner, StepInputs


def _broadcast(message=None):
    """Rank 0's ``message`` on every rank."""
    box = [message]
    with guarded("rank 0's step broadcast"):
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """What every rank needs to size its KV cache as rank 0's engine core does."""

    max_num_seqs: int
    memory_fraction: float
    num_blocks: int | None
    attention_backend: str


class Leader:
    """Rank 0's side: sends the cache settings once, then every step, then a stop."""

    def __init__(self, settings: CacheSettings):
        _broadcast(("init", settings))
        self._sent: set = set()  # adapter keys the other ranks hold
        self._dropped: list = []  # keys of adapters since garbage-collected here
        self.stopped = False

    def send_step(self, step: StepInputs) -> None:
        """Broadcast ``step``, with the reference tensors of its adapters the others lack."""
        new = {}
        for adapter, _ in step.lora:
            key = adapter.key
            if key not in self._sent:
                source = getattr(adapter, "source", None)
                if source is None:
                    raise KilnError("a LoRA adapter made without its reference tensors cannot be shared with the "
                                    "other ranks (load it through LoraConfig, a directory or a name)")
                new[key] = source
                self._sent.add(key)
                weakref.finalize(adapter, self._dropped.append, key)
        dropped, self._dropped = self._dropped, []
        self._sent.difference_update(dropped)
        plain = dataclasses.replace(step, lora=[(adapter.key, rows) for adapter, rows in step.lora])
        _broadcast(("step", plain, new, dropped))

    def stop(self) -> None:
        """Release the other ranks (nothing to release when the world already broke)."""
        if not self.stopped:
            self.stopped = True
            try:
                _broadcast(("stop",))
            except WorldError:
                pass


def follow(engine: Engine) -> None:
    """Compute this rank's part of every step rank 0 schedules, until rank 0 stops (every
    rank but 0 of a world calls this with its ``Engine``)."""
    from kiln.runtime.engine_core import agreed_num_blocks

    kind, settings = _broadcast()
    if kind != "init":
        raise KilnError(f"rank 0 sent {kind!r} before the cache settings")
    runner = ModelRunner(engine, agreed_num_blocks(engine, settings), settings.attention_backend)
    adapters: dict = {}
    while True:
        message = _broadcast()
        if message[0] == "stop":
            return
        _, step, new, dropped = message
        for key in dropped:
            adapters.pop(key, None)
        for key, (weights, config) in new.items():
            adapters[key] = parse_adapter(weights, config, engine.config, engine.lora_config, "lora")
        step.lora = [(adapters[key], rows) for key, rows in step.lora]
        runner.run_step(step)
