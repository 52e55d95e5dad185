"""GenerationSession: the static-batch API of reference 003 (setup, then generate).

``setup(batch_size, beam_width, max_seq_len)`` sizes the KV cache; ``generate`` takes a
:class:`GenerationInput` (packed or padded ids plus lengths, stop/bad words lists in the
``[2, len]`` encoding, an embedding bias) and a :class:`SamplingConfig`, and returns a
:class:`GenerationOutput` whose ``ids`` are ``[batch, beam, max_input_len + max_new_tokens]``:
a copy of the input, then the generated tokens, then ``pad_id``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore, SequenceGroup
from kiln.runtime.sampling import SamplingConfig
from kiln.runtime.words import decode_batch_words


@dataclass
class GenerationInput:
    end_id: int  # -1: none
    pad_id: int
    ids: torch.Tensor  # [num_tokens] when packed, [batch, max_input_len] when padded
    lengths: torch.Tensor  # [batch]
    packed: bool = True
    max_new_tokens: int | None = None
    embedding_bias: torch.Tensor | None = None  # [vocab] (or [batch, vocab]) added to the logits
    bad_words_list: torch.Tensor | None = None  # [2, len] or [batch, 2, len]
    stop_words_list: torch.Tensor | None = None  # [2, len] or [batch, 2, len]


@dataclass
class GenerationOutput:
    ids: torch.Tensor  # [batch, beam, max_input_len + max_new_tokens]
    sequence_lengths: torch.Tensor  # [batch, beam]: input + generated tokens
    log_probs: torch.Tensor  # [batch, beam, max_new_tokens]: log-prob of each generated token (0 past the end)
    cum_log_probs: torch.Tensor  # [batch, beam]
    finish_reasons: list[list[str]]  # [batch][beam]
    context_logits: torch.Tensor | None = None  # [batch, max_input_len, vocab], when asked
    # [batch, beam, max_new_tokens, vocab], when asked: the raw logits of each step. With beam
    # search, beam k at step t is the k-th live beam of that step, not the ancestor of the
    # k-th returned hypothesis.
    generation_logits: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        return self.sequence_lengths


class GenerationSession:
    """Runs batches of prompts to completion on one engine."""

    def __init__(self, engine: Engine | str | Path):
        self.engine = engine if isinstance(engine, Engine) else Engine(engine)
        self._core: EngineCore | None = None

    def setup(self, batch_size: int, beam_width: int = 1, max_seq_len: int | None = None) -> None:
        build = self.engine.build_config
        max_seq_len = max_seq_len or build.max_seq_len
        if not 1 <= beam_width <= build.max_beam_width:
            raise RequestError(f"beam_width {beam_width} is outside [1, max_beam_width={build.max_beam_width}] "
                               "(build the engine with --max_beam_width)")
        if not 1 <= batch_size * beam_width <= build.max_batch_size:
            raise RequestError(f"batch_size {batch_size} x beam_width {beam_width} is outside "
                               f"[1, max_batch_size={build.max_batch_size}]")
        if max_seq_len > build.max_seq_len:
            raise RequestError(f"max_seq_len {max_seq_len} exceeds the engine's max_seq_len {build.max_seq_len}")
        self.batch_size, self.beam_width, self.max_seq_len = batch_size, beam_width, max_seq_len
        blocks = batch_size * beam_width * (-(-max_seq_len // build.tokens_per_block) + 1)
        self._core = EngineCore(self.engine, max_num_seqs=batch_size * beam_width, num_blocks=blocks)

    def generate(self, inputs: GenerationInput, sampling_config: SamplingConfig | None = None,
                 on_token_generated: Callable[[torch.Tensor, int, bool], None] | None = None, *,
                 return_context_logits: bool = False, return_generation_logits: bool = False) -> GenerationOutput:
        """Generate for every sequence until each hits ``end_id``, a stop word or ``max_new_tokens``.

        ``on_token_generated(ids, step, finished)`` is called after each step with the output
        ids so far (streaming). Context logits need an engine built with
        ``--gather_all_token_logits``.
        """
        if self._core is None:
            raise RequestError("call setup() before generate()")
        if return_context_logits and not self.engine.build_config.gather_all_token_logits:
            raise RequestError("context logits need an engine built with --gather_all_token_logits")
        config = sampling_config or SamplingConfig()
        if config.beam_width != self.beam_width:
            raise RequestError(f"SamplingConfig.beam_width {config.beam_width} differs from setup()'s "
                               f"beam_width {self.beam_width}")
        prompts = self._split_prompts(inputs)
        batch = len(prompts)
        if batch > self.batch_size:
            raise RequestError(f"{batch} sequences given, setup() was for batch_size {self.batch_size}")
        max_input = max(len(p) for p in prompts)
        max_new = inputs.max_new_tokens or (self.max_seq_len - max_input)
        if max_input + max_new > self.max_seq_len:
            raise RequestError(f"max input length {max_input} + max_new_tokens {max_new} exceeds "
                               f"max_seq_len {self.max_seq_len}")
        params = self._request_params(inputs, config, batch, max_new)
        end_id = inputs.end_id if inputs.end_id >= 0 else None  # -1: no end token
        requests: list[SequenceGroup] = []
        try:
            for prompt, p in zip(prompts, params):
                requests.append(self._core.add_request(prompt, p, end_id, return_context_logits,
                                                       return_generation_logits))
        except Exception:
            for request in requests:  # a bad sequence rejects the batch: leave nothing queued
                self._core.abort(request)
            raise
        total = max_input + max_new
        ids = torch.full((batch, self.beam_width, total), inputs.pad_id, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            ids[b, :, : len(prompt)] = torch.tensor(prompt)
        step = 0
        while not all(r.is_finished for r in requests):
            self._core.step()
            for _, error in self._core.take_failures():  # a sequence failed inside the engine
                for request in requests:
                    self._core.abort(request)
                raise error
            step += 1
            if on_token_generated is not None:
                for b, request in enumerate(requests):
                    self._fill_ids(ids[b], request, inputs.pad_id)
                on_token_generated(ids, step, all(r.is_finished for r in requests))
        return self._output(requests, prompts, ids, max_new, inputs.pad_id, return_context_logits,
                            return_generation_logits)

    # -- inputs -------------------------------------------------------------------------------

    def _request_params(self, inputs: GenerationInput, config: SamplingConfig, batch: int, max_new: int):
        params = config.per_sequence(batch, max_new)
        bad = decode_batch_words(inputs.bad_words_list, batch, "bad_words_list")
        stop = decode_batch_words(inputs.stop_words_list, batch, "stop_words_list")
        bias = inputs.embedding_bias
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() not in (1, 2)
                                 or (bias.dim() == 2 and bias.shape[0] != batch)):
            raise RequestError(f"embedding_bias must be [vocab] or [batch={batch}, vocab], got "
                               f"{list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        out = []
        for b, p in enumerate(params):
            row_bias = None if bias is None else (bias if bias.dim() == 1 else bias[b])
            out.append(dataclasses.replace(
                p, bad_words_ids=bad[b], stop_words_ids=[w for w in stop[b] if len(w) > 1],
                stop_token_ids=[w[0] for w in stop[b] if len(w) == 1],
                embedding_bias=None if row_bias is None else row_bias.float(), logprobs=0))
        return out

    @staticmethod
    def _split_prompts(inputs: GenerationInput) -> list[list[int]]:
        lengths = [int(n) for n in inputs.lengths.reshape(-1).tolist()]
        if not lengths or any(n <= 0 for n in lengths):
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

    # -- outputs ------------------------------------------------------------------------------

    def _beams(self, request: SequenceGroup) -> list[tuple[list[int], list[float], str]]:
        """(generated tokens, their log-probs, finish reason) per returned beam or sample."""
        if request.beam is not None:
            if request.hypotheses is not None:
                return [(h.token_ids, h.log_probs, "end_id" if h.token_ids and h.token_ids[-1] in
                         request.beam.params.end_ids else "length") for h in request.hypotheses]
            return [(s.output_token_ids, [], "") for s in request.seqs]
        return [(s.output_token_ids, s.logprobs, s.finish_reason.value if s.finish_reason else "")
                for s in request.seqs]

    def _fill_ids(self, ids: torch.Tensor, request: SequenceGroup, pad_id: int) -> None:
        prompt_len = len(request.prompt_token_ids)
        for k, (tokens, _, _) in enumerate(self._beams(request)[: self.beam_width]):
            ids[k, prompt_len:] = pad_id
            ids[k, prompt_len:prompt_len + len(tokens)] = torch.tensor(tokens, dtype=torch.int64)

    def _output(self, requests: list[SequenceGroup], prompts, ids: torch.Tensor, max_new: int, pad_id: int,
                want_context: bool, want_generation: bool) -> GenerationOutput:
        batch, beams = len(requests), self.beam_width
        lengths = torch.zeros(batch, beams, dtype=torch.int64)
        log_probs = torch.zeros(batch, beams, max_new)
        reasons = []
        for b, request in enumerate(requests):
            self._fill_ids(ids[b], request, pad_id)
            results = self._beams(request)
            reasons.append([r for _, _, r in results])
            for k, (tokens, lps, _) in enumerate(results[:beams]):
                lengths[b, k] = len(prompts[b]) + len(tokens)
                log_probs[b, k, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        out = GenerationOutput(ids=ids, sequence_lengths=lengths, log_probs=log_probs,
                               cum_log_probs=log_probs.sum(-1), finish_reasons=reasons)
        vocab = self.engine.config.vocab_size
        if want_context:
            max_input = max(len(p) for p in prompts)
            context = torch.zeros(batch, max_input, vocab)
            for b, request in enumerate(requests):
                rows = torch.cat(request.context_logits)
                context[b, : rows.shape[0]] = rows
            out.context_logits = context
        if want_generation:
            gen = torch.zeros(batch, beams, max_new, vocab)
            for b, request in enumerate(requests):
                for step, per_seq in enumerate(request.generation_logits[:max_new]):
                    for k, row in enumerate(per_seq[:beams]):
                        if row is not None:
                            gen[b, k, step] = row
            out.generation_logits = gen
        return out
