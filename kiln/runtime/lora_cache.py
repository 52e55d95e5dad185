"""The two-level LoRA cache of reference 004, keyed by task id.

A request's first use of a task id carries the adapter (``LoraConfig.weights`` and
``config``); later requests may carry the task id alone. The host level keeps parsed adapters
up to ``host_cache_bytes``; the device level holds the adapters running sequences use, at most
``device_cache_slots`` of them (on a GPU, the copies the LoRA kernels read; on this CPU both
levels are host memory, but the slots still bound how many adapters a step mixes). Each
level evicts its least recently used adapter that no running request holds; a request whose
adapter cannot get a slot waits, and a task id the cache does not know is an error for that
request alone. Registered adapters (a server's named ones) keep their tensors beside the
cache and come back into the host level whenever a request needs them after an eviction.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from kiln.checkpoint.lora import engine_lora_shapes, parse_lora_tensors, shard_lora_module
from kiln.errors import CheckpointError, ConfigError, RequestError
from kiln.layers.lora import LoraAdapter
from kiln.models.lora_targets import lora_module_shapes


@dataclass
class LoraConfig:
    """A request's adapter (reference 004): ``task_id``, and on its first use ``weights``
    ``[rows, D x Hi + Ho x D]`` and ``config`` ``[rows, 3]`` (NumPy arrays or tensors)."""

    task_id: int
    weights: object = None
    config: object = None


def parse_adapter(weights, config, model_config, engine_lora: dict | None, where: str) -> LoraAdapter:
    """An adapter from reference tensors, checked against the model and the engine's build-time
    bounds (``Engine.lora_config``: modules, rank, DoRA; None takes any), and sharded for this
    rank of a tensor-parallel engine (``shard_lora_module``); a rejection is a
    RequestError starting with ``where``."""
    try:
        shapes = engine_lora_shapes(lora_module_shapes(model_config), engine_lora)
        modules = parse_lora_tensors(weights, config, shapes,
                                     model_config.num_hidden_layers, (engine_lora or {}).get("max_lora_rank"),
                                     dora=engine_lora is None or engine_lora.get("dora", False))
        mapping = model_config.mapping
        if mapping.tp_size > 1:  # this rank's share, by reference 004's rule
            modules = [shard_lora_module(m, model_config, mapping.tp_size, mapping.tp_rank) for m in modules]
        adapter = LoraAdapter(modules)
    except (CheckpointError, ConfigError) as e:  # a malformed adapter, or a family that takes none
        raise RequestError(f"{where}: {e}") from None
    adapter.source = (weights, config)  # what the other ranks of a world shard for themselves
    return adapter


@dataclass
class LoraCacheConfig:
    host_cache_bytes: int = 1 << 30  # parsed adapters kept for later requests (float32 bytes)
    device_cache_slots: int = 8  # adapters running requests may use at once


@dataclass
class LoraCacheStats:
    host_adapters: int
    host_bytes: int
    device_adapters: int
    device_slots: int
    hits: int  # task ids found in the host level
    misses: int  # task ids sent with weights (loaded) or unknown
    evictions: int


class LoraCache:
    """Adapters by task id for one engine (``model_config``: its PretrainedConfig)."""

    def __init__(self, model_config, config: LoraCacheConfig | None = None, engine_lora: dict | None = None):
        """``engine_lora``: the engine's build-time LoRA settings (``Engine.lora_config``), which
        bound the rank and the modules adapters may have; None takes any."""
        self.config = config or LoraCacheConfig()
        if self.config.host_cache_bytes <= 0 or self.config.device_cache_slots <= 0:
            raise ConfigError("lora cache: host_cache_bytes and device_cache_slots must be positive")
        self._model_config, self._engine_lora = model_config, engine_lora
        self._host: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()  # LRU first
        self._device: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()
        self._users: collections.Counter[int] = collections.Counter()  # running requests per task id
        self._registered: dict[int, tuple] = {}  # task id -> (weights, config), reloaded after eviction
        self.hits = self.misses = self.evictions = 0

    # -- the host level -----------------------------------------------------------------------

    def put(self, task_id: int, weights, config) -> LoraAdapter:
        """Parse and keep an adapter under ``task_id`` (replacing an idle one of that id)."""
        self._check_id(task_id)
        adapter = parse_adapter(weights, config, self._model_config, self._engine_lora,
                                f"lora_config (task_id {task_id})")
        if adapter.nbytes > self.config.host_cache_bytes:
            raise RequestError(f"lora_config (task_id {task_id}): the adapter takes {adapter.nbytes} bytes, more "
                               f"than the whole host cache ({self.config.host_cache_bytes})")
        if self._users[task_id]:
            raise RequestError(f"lora_config (task_id {task_id}): running requests use this task id; new weights "
                               "for it must wait until they finish")
        self.misses += 1
        self._drop(task_id)
        while self.host_bytes + adapter.nbytes > self.config.host_cache_bytes:
            if not self._evict(self._host):
                raise RequestError(f"lora_config (task_id {task_id}): the host cache ({self.config.host_cache_bytes} "
                                   "bytes) is full of adapters running requests use")
        self._host[task_id] = adapter
        return adapter

    def register(self, task_id: int, weights, config) -> None:
        """Keep an adapter's tensors under ``task_id`` for good (checked now): requests may name
        it by task id alone whatever the cache evicts. Safe from another thread (one dict store)."""
        self._check_id(task_id)
        parse_adapter(weights, config, self._model_config, self._engine_lora, f"lora adapter (task_id {task_id})")
        self._registered[task_id] = (weights, config)

    def get(self, task_id: int) -> LoraAdapter:
        """The adapter of ``task_id`` (now the most recently used)."""
        self._check_id(task_id)
        adapter = self._host.get(task_id)
        if adapter is None and task_id in self._registered:
            return self.put(task_id, *self._registered[task_id])
        if adapter is None:
            self.misses += 1
            raise RequestError(f"lora_config: task_id {task_id} is not in the LoRA cache (never loaded, or evicted): "
                               "send its weights and config with the request")
        self.hits += 1
        self._host.move_to_end(task_id)
        return adapter

    # -- the device level ---------------------------------------------------------------------

    def acquire(self, task_id: int) -> LoraAdapter | None:
        """Hold ``task_id``'s adapter in a device slot for one running request; None when every
        slot is held (the request waits)."""
        adapter = self.get(task_id)
        if task_id not in self._device:
            if len(self._device) >= self.config.device_cache_slots and not self._evict(self._device):
                return None
            self._device[task_id] = adapter
        self._device.move_to_end(task_id)
        self._users[task_id] += 1
        return adapter

    def release(self, task_id: int) -> None:
        """One running request of ``task_id`` has finished."""
        if self._users[task_id] > 0:
            self._users[task_id] -= 1

    # -- stats and helpers --------------------------------------------------------------------

    @property
    def host_bytes(self) -> int:
        return sum(a.nbytes for a in self._host.values())

    def stats(self) -> LoraCacheStats:
        return LoraCacheStats(len(self._host), self.host_bytes, len(self._device), self.config.device_cache_slots,
                              self.hits, self.misses, self.evictions)

    def _evict(self, level: collections.OrderedDict) -> bool:
        """Drop ``level``'s least recently used adapter no running request holds."""
        for task_id in level:
            if not self._users[task_id]:
                if level is self._host:
                    self._drop(task_id)
                else:
                    del level[task_id]
                self.evictions += 1
                return True
        return False

    def _drop(self, task_id: int) -> None:
        self._host.pop(task_id, None)
        self._device.pop(task_id, None)

    @staticmethod
    def _check_id(task_id) -> None:
        if not isinstance(task_id, int) or isinstance(task_id, bool) or task_id < 0:
            raise RequestError(f"lora_config.task_id must be an integer >= 0, got {task_id!r}")
