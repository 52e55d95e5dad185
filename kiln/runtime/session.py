"""GenerationSession: the static-batch API of reference 003 (setup, then generate).

``setup(batch_size, beam_width, max_seq_len)`` sizes the KV cache; ``generate`` takes a
:class:`GenerationInput` (packed or padded ids plus lengths) and a :class:`SamplingConfig`
and returns ids shaped ``[batch, beam, max_input_len + max_new_tokens]``: a copy of the
input, then the generated tokens, then ``pad_id``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence as Seq

import torch

from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling import SamplingParams


@dataclass
class SamplingConfig:
    """Sampling controls of reference 003. Each field is a scalar or one value per sequence.

    ``top_k == 0`` and ``top_p == 0`` (the defaults) mean greedy search.
    """

    beam_width: int = 1
    temperature: float | list[float] = 1.0
    top_k: int | list[int] = 0
    top_p: float | list[float] = 0.0
    random_seed: int | list[int] = 0

    def per_sequence(self, batch_size: int) -> list[SamplingParams]:
        def pick(name: str, i: int):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                if len(value) not in (1, batch_size):
                    raise RequestError(f"SamplingConfig.{name} has {len(value)} values for a batch of {batch_size}")
                return value[0] if len(value) == 1 else value[i]
            return value

        params = []
        for i in range(batch_size):
            top_k, top_p = pick("top_k", i), pick("top_p", i)
            greedy = top_k == 0 and top_p == 0
            params.append(SamplingParams(
                max_tokens=1, temperature=0.0 if greedy else pick("temperature", i),
                top_k=top_k, top_p=top_p if top_p > 0 else 1.0, seed=pick("random_seed", i)))
        return params


@dataclass
class GenerationInput:
    end_id: int
    pad_id: int
    ids: torch.Tensor  # [num_tokens] when packed, [batch, max_input_len] when padded
    lengths: torch.Tensor  # [batch]
    packed: bool = True
    max_new_tokens: int | None = None


@dataclass
class GenerationOutput:
    ids: torch.Tensor  # [batch, beam, max_input_len + max_new_tokens]
    lengths: torch.Tensor  # [batch, beam]: input + generated tokens
    finish_reasons: list[str] = field(default_factory=list)


class GenerationSession:
    """Runs batches of prompts to completion on one engine."""

    def __init__(self, engine: Engine | str | Path):
        self.engine = engine if isinstance(engine, Engine) else Engine(engine)
        self._core: EngineCore | None = None

    def setup(self, batch_size: int, beam_width: int = 1, max_seq_len: int | None = None) -> None:
        build = self.engine.build_config
        max_seq_len = max_seq_len or build.max_seq_len
        if beam_width != 1:
            raise RequestError("beam_width > 1: beam search is not available in this kiln version yet")
        if not 1 <= batch_size <= build.max_batch_size:
            raise RequestError(f"batch_size {batch_size} is outside [1, max_batch_size={build.max_batch_size}]")
        if max_seq_len > build.max_seq_len:
            raise RequestError(f"max_seq_len {max_seq_len} exceeds the engine's max_seq_len {build.max_seq_len}")
        self.batch_size, self.beam_width, self.max_seq_len = batch_size, beam_width, max_seq_len
        blocks = batch_size * -(-max_seq_len // build.tokens_per_block)
        self._core = EngineCore(self.engine, max_num_seqs=batch_size, num_blocks=blocks)

    def generate(self, inputs: GenerationInput, sampling_config: SamplingConfig | None = None,
                 on_token_generated: Callable[[torch.Tensor, int, bool], None] | None = None) -> GenerationOutput:
        """Generate for every sequence until each hits ``end_id`` or ``max_new_tokens``.

        ``on_token_generated(ids, step, finished)`` is called after each step with the output
        ids so far (streaming).
        """
        if self._core is None:
            raise RequestError("call setup() before generate()")
        prompts = self._split_prompts(inputs)
        if len(prompts) > self.batch_size:
            raise RequestError(f"{len(prompts)} sequences given, setup() was for batch_size {self.batch_size}")
        max_input = max(len(p) for p in prompts)
        max_new = inputs.max_new_tokens or (self.max_seq_len - max_input)
        if max_input + max_new > self.max_seq_len:
            raise RequestError(f"max input length {max_input} + max_new_tokens {max_new} exceeds "
                               f"max_seq_len {self.max_seq_len}")
        params = (sampling_config or SamplingConfig()).per_sequence(len(prompts))
        seqs = []
        try:
            for prompt, p in zip(prompts, params):
                p.max_tokens = max_new
                seqs.append(self._core.add_request(prompt, p, inputs.end_id))
        except Exception:
            for seq in seqs:  # one bad prompt rejects the batch: leave nothing queued
                self._core.abort(seq)
            raise
        total = max_input + max_new
        ids = torch.full((len(prompts), 1, total), inputs.pad_id, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            ids[b, 0, : len(prompt)] = torch.tensor(prompt)
        step = 0
        while self._core.has_unfinished:
            for seq in self._core.step():
                b = seqs.index(seq)
                ids[b, 0, seq.num_tokens - 1] = seq.token_ids[-1]
            step += 1
            if on_token_generated is not None:
                on_token_generated(ids, step, not self._core.has_unfinished)
        lengths = torch.tensor([[s.num_tokens] for s in seqs])
        # Tokens after end_id are padding, as the reference output shows.
        return GenerationOutput(ids=ids, lengths=lengths, finish_reasons=[s.finish_reason.value for s in seqs])

    @staticmethod
    def _split_prompts(inputs: GenerationInput) -> list[list[int]]:
        lengths = [int(n) for n in inputs.lengths.reshape(-1).tolist()]
        if any(n <= 0 for n in lengths):
            raise RequestError(f"GenerationInput.lengths must be positive, got {lengths}")
        ids = inputs.ids
        if inputs.packed:
            flat = ids.reshape(-1).tolist()
            if len(flat) != sum(lengths):
                raise RequestError(f"packed ids hold {len(flat)} tokens but lengths sum to {sum(lengths)}")
            out, start = [], 0
            for n in lengths:
                out.append(flat[start:start + n])
                start += n
            return out
        if ids.dim() != 2 or ids.shape[0] != len(lengths) or max(lengths) > ids.shape[1]:
            raise RequestError(f"padded ids of shape {list(ids.shape)} do not match lengths {lengths}")
        return [ids[b, :n].tolist() for b, n in enumerate(lengths)]
