"""EngineCore: an engine, its KV cache, a scheduler, and the three-call step.

Every front end (GenerationSession, LLM, and later the in-flight Executor) drives this::

    out = scheduler.schedule(); result = runner.execute(out); scheduler.update(out, result)
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from kiln.errors import CapacityError, RequestError
from kiln.runtime.block_pool import BlockPool
from kiln.models.base import torch_dtype
from kiln.runtime.engine import Engine
from kiln.runtime.kv_cache import available_memory_bytes, kv_bytes_per_token
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence


@dataclass
class StepStats:
    num_steps: int = 0
    num_tokens: int = 0  # tokens computed (prompt and generated)
    num_generated: int = 0
    seconds: float = 0.0


KV_CACHE_MEMORY_FRACTION = 0.3  # of the memory available at start-up, when no size is given


def default_num_blocks(engine: Engine, max_num_seqs: int) -> int:
    """Blocks for every sequence at full length, capped at a share of available memory."""
    build, config = engine.build_config, engine.config
    wanted = max_num_seqs * -(-build.max_seq_len // build.tokens_per_block)
    attention = next(iter(engine.model.transformer.layers.values())).attention
    per_block = build.tokens_per_block * kv_bytes_per_token(
        len(engine.model.transformer.layers), attention.num_kv_heads, attention.head_size, torch_dtype(config.dtype))
    affordable = int(available_memory_bytes() * KV_CACHE_MEMORY_FRACTION) // per_block
    return max(1, min(wanted, affordable))


class EngineCore:
    def __init__(self, engine: Engine, *, max_num_seqs: int | None = None, max_num_tokens: int | None = None,
                 num_blocks: int | None = None, attention_backend: str = "torch"):
        build = engine.build_config
        self.engine = engine
        self.max_num_seqs = min(max_num_seqs or build.max_batch_size, build.max_batch_size)
        self.max_num_tokens = min(max_num_tokens or build.max_num_tokens, build.max_num_tokens)
        block = build.tokens_per_block
        if num_blocks is None:
            num_blocks = default_num_blocks(engine, self.max_num_seqs)
        self.runner = ModelRunner(engine, num_blocks, attention_backend)
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(self.pool, block, self.max_num_seqs, self.max_num_tokens)
        self._ids = itertools.count()
        self.stats = StepStats()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, end_id: int | None) -> Sequence:
        """Validate and queue one request; returns its live Sequence."""
        build = self.engine.build_config
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_token_ids) > build.max_input_len:
            raise RequestError(f"prompt has {len(prompt_token_ids)} tokens, more than the engine's "
                               f"max_input_len {build.max_input_len}")
        if len(prompt_token_ids) >= build.max_seq_len:
            raise RequestError(f"prompt has {len(prompt_token_ids)} tokens, leaving no room under max_seq_len "
                               f"{build.max_seq_len}")
        vocab = self.engine.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        seq = Sequence(next(self._ids), list(prompt_token_ids), params, end_id, build.max_seq_len)
        self.scheduler.add(seq)
        return seq

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that received a token."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.chunks:
            raise CapacityError("no sequence could be scheduled: the KV cache is too small for the work queued")
        result = self.runner.execute(out)
        advanced = self.scheduler.update(out, result)
        s = self.stats
        s.num_steps += 1
        s.num_tokens += out.num_tokens
        s.num_generated += len(advanced)
        s.seconds += time.perf_counter() - started
        return advanced

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
