"""The ranks of a world other than the scheduler's.

Rank 0 runs the engine core (scheduler, the executor and server above it); every other rank
calls ``follow`` and computes its part of each step rank 0 schedules. Rank 0's ``Leader``
sends every other rank, point to point (so a rank still busy with an earlier step does not
hold rank 0 up), first the KV cache settings (every rank then sizes its cache to the world's
minimum), then each step as plain data (``kiln.runtime.model_runner.StepInputs``) with the
LoRA adapters the other ranks have not seen (each shards them for itself, reference 004's
rule), and finally a stop.

With pipeline stages the last stage's first rank samples (its ``Sampler``): the leader also
sends it what sampling reads of each sequence — new sequences whole (parameters, tokens,
random generator state), known ones their tokens since — and it returns each step's
``RunnerOutput`` (the tokens; logits only where a request asked for them).
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

from kiln.distributed import world
from kiln.distributed.comm import recv_object, send_object, wait_sends
from kiln.errors import KilnError, WorldError
from kiln.runtime.engine import Engine
from kiln.runtime.kv_blocks import agreed_num_blocks
from kiln.runtime.lora_cache import parse_adapter
from kiln.runtime.model_runner import ModelRunner, StepInputs
from kiln.runtime.scheduler import RunnerOutput
from kiln.runtime.sequence import Sequence

CONTROL_TAG, SAMPLING_TAG, RESULTS_TAG = 1, 3, 4


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """What every rank needs to size its KV cache as rank 0's engine core does."""

    max_num_seqs: int
    memory_fraction: float
    num_blocks: int | None
    attention_backend: str


@dataclasses.dataclass
class SamplingSync:
    """What the sampling rank needs of one step's sequences, in the step's order: ``sampled``
    and ``context`` seq ids; ``new``: copies of sequences it has not seen (or whose tokens were
    rewritten); ``appended``: ``{seq_id: (tokens since last sent, current top-p)}``;
    ``released``: seq ids to forget."""

    sampled: list[int]
    context: list[int]
    new: list[Sequence]
    appended: dict[int, tuple[list[int], float]]
    released: list[int]


def _control_group():
    return world().control_group


def sampler_rank(mapping) -> int:
    """The rank that samples: the first of the last pipeline stage."""
    return (mapping.pp_size - 1) * mapping.tp_size


class Leader:
    """Rank 0's side: sends the cache settings once, then every step, then a stop."""

    def __init__(self, settings: CacheSettings):
        mapping = world().mapping
        self._others = list(range(1, mapping.world_size))
        self._sampler = sampler_rank(mapping) if mapping.pp_size > 1 else None
        self._send(("init", settings))
        self._sent: set = set()  # adapter keys the other ranks hold
        self._dropped: list = []  # keys of adapters since garbage-collected here
        self._mirrored: dict[int, int] = {}  # seq_id -> tokens the sampling rank holds
        self._released: list[int] = []
        self.stopped = False

    def _send(self, message) -> None:
        send_object(message, self._others, CONTROL_TAG, _control_group())

    def send_step(self, step: StepInputs, sampled: list[Sequence], context: list[Sequence]) -> None:
        """Send ``step``, with the reference tensors of its adapters the others lack (and, to
        the sampling rank, what it needs of the ``sampled`` and ``context`` sequences)."""
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
        self._send(("step", plain, new, dropped))
        if self._sampler is not None:
            send_object(self._sampling_sync(sampled, context), self._sampler, SAMPLING_TAG, _control_group())

    def _sampling_sync(self, sampled: list[Sequence], context: list[Sequence]) -> SamplingSync:
        sync = SamplingSync([s.seq_id for s in sampled], [s.seq_id for s in context], [], {}, self._released)
        self._released = []
        for seq in {s.seq_id: s for s in (*sampled, *context)}.values():
            known = self._mirrored.get(seq.seq_id)
            if known is None:
                copy = Sequence(seq.seq_id, list(seq.token_ids), seq.params, seq.end_id, seq.max_seq_len)
                copy.num_prompt_tokens = seq.num_prompt_tokens
                copy.current_top_p = seq.current_top_p
                copy.return_generation_logits = seq.return_generation_logits
                copy.prompt_table = True if seq.prompt_table is not None else None  # all TokenHistory asks
                copy.generator = seq.generator  # pickled with its state; only the sampling rank draws from it
                sync.new.append(copy)
            elif known < seq.num_tokens:
                sync.appended[seq.seq_id] = (seq.token_ids[known:], seq.current_top_p)
            self._mirrored[seq.seq_id] = seq.num_tokens
        return sync

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished, or its tokens were rewritten: the sampling rank drops its copy."""
        if self._mirrored.pop(seq.seq_id, None) is not None:
            self._released.append(seq.seq_id)

    def receive_result(self) -> RunnerOutput:
        """The sampling rank's results of the oldest step not yet received."""
        return recv_object(self._sampler, RESULTS_TAG)

    def stop(self) -> None:
        """Release the other ranks (nothing to release when the world already broke)."""
        if not self.stopped:
            self.stopped = True
            try:
                self._send(("stop",))
                wait_sends()
            except WorldError:
                pass


class Sampler:
    """The sampling rank's copies of the sequences it samples, kept in step with rank 0's."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seqs: dict[int, Sequence] = {}

    def apply(self, sync: SamplingSync) -> tuple[list[Sequence], list[Sequence]]:
        """Bring the copies up to date; the step's sampled and context sequences."""
        for seq_id in sync.released:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.runner.release(seq)
        for seq in sync.new:
            if seq.seq_id in self.seqs:  # rewritten (a beam re-formed): start its history again
                self.runner.release(self.seqs[seq.seq_id])
            self.seqs[seq.seq_id] = seq
        for seq_id, (tokens, top_p) in sync.appended.items():
            seq = self.seqs[seq_id]
            seq.token_ids.extend(tokens)
            seq.current_top_p = top_p
        return [self.seqs[i] for i in sync.sampled], [self.seqs[i] for i in sync.context]


def follow(engine: Engine) -> None:
    """Compute this rank's part of every step rank 0 schedules, until rank 0 stops (every
    rank but 0 of a world calls this with its ``Engine``)."""
    group = _control_group()
    kind, settings = recv_object(0, CONTROL_TAG, group)
    if kind != "init":
        raise KilnError(f"rank 0 sent {kind!r} before the cache settings")
    num_blocks = agreed_num_blocks(engine, settings.num_blocks, settings.max_num_seqs, settings.memory_fraction)
    runner = ModelRunner(engine, num_blocks, settings.attention_backend, settings.max_num_seqs)
    mapping = engine.config.mapping
    sampler = Sampler(runner) if mapping.pp_size > 1 and mapping.rank == sampler_rank(mapping) else None
    adapters: dict = {}
    with torch.inference_mode():
        while True:
            message = recv_object(0, CONTROL_TAG, group)
            if message[0] == "stop":
                wait_sends()
                return
            _, step, new, dropped = message
            for key in dropped:
                adapters.pop(key, None)
            for key, (weights, config) in new.items():
                adapters[key] = parse_adapter(weights, config, engine.config, engine.lora_config, "lora")
            step.lora = [(adapters[key], rows) for key, rows in step.lora]
            if sampler is None:
                runner.run_step(step)
                continue
            sampled, context = sampler.apply(recv_object(0, SAMPLING_TAG, group))
            logits, context_logits = runner.run_step(step)
            send_object(runner.finish_step(logits, context_logits, sampled, context), 0, RESULTS_TAG)
