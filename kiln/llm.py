"""LLM: the high-level API most users start from.

    from kiln import LLM, SamplingParams
    llm = LLM("path/to/hf-dir-or.gguf-or-checkpoint-or-engine")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from kiln.engine_cache import resolve_engine
from kiln.errors import ConfigError, RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.sequence import FinishReason, Sequence
from kiln.tokenizer import IncrementalDetokenizer, chat_prompt_ids, end_ids, load_tokenizer

# What users of OpenAI-style APIs expect to see.
_FINISH_NAMES = {FinishReason.END_ID: "stop", FinishReason.STOP_WORDS: "stop", FinishReason.LENGTH: "length",
                 FinishReason.CANCELLED: "abort"}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


@dataclass
class StreamDelta:
    """A piece of a streamed generation: new text and tokens, and whether it is the last."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


class LLM:
    """Generate text with a model given as an HF dir, a GGUF file, a kiln checkpoint or an engine.

    Anything but an engine is converted and built once into the engine cache
    (``cache_dir``, default ``~/.cache/kiln``) and reused on later calls.
    """

    def __init__(self, model: str | Path, *, tokenizer: str | Path | None = None, dtype: str | None = None,
                 cache_dir: str | Path | None = None, max_batch_size: int | None = None,
                 max_input_len: int | None = None, max_seq_len: int | None = None,
                 max_num_tokens: int | None = None, tokens_per_block: int | None = None,
                 kv_cache_max_tokens: int | None = None, progress: bool = True):
        build_options = dict(max_batch_size=max_batch_size, max_input_len=max_input_len, max_seq_len=max_seq_len,
                             max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block)
        self.engine_dir = resolve_engine(model, dtype=dtype, build_options=build_options, cache_dir=cache_dir,
                                         progress=progress)
        self.engine = Engine(self.engine_dir)
        tokenizer_dir = Path(tokenizer) if tokenizer else self.engine.tokenizer_dir
        if tokenizer_dir is None:
            raise ConfigError(f"{self.engine_dir}: the engine carries no tokenizer; pass tokenizer=DIR")
        self.tokenizer = load_tokenizer(tokenizer_dir)
        ids = end_ids(tokenizer_dir, self.tokenizer)
        self.end_id = ids[0] if ids else None
        self.extra_stop_ids = ids[1:]
        build = self.engine.build_config
        num_blocks = None
        if kv_cache_max_tokens is not None:
            num_blocks = max(1, kv_cache_max_tokens // build.tokens_per_block)
        self.core = EngineCore(self.engine, num_blocks=num_blocks)

    # -- prompts ----------------------------------------------------------------------------

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if self.extra_stop_ids:
            params = dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids) + self.extra_stop_ids)
        return self.core.add_request(prompt_ids, params, self.end_id)

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (all batched together); outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        seqs = []
        try:
            for ids, p in zip(encoded, params_list):
                seqs.append(self._add(ids, p))
        except Exception:
            for seq in seqs:  # one bad prompt rejects the batch: leave nothing queued
                self.core.abort(seq)
            raise
        pending = set(seqs)
        with tqdm(total=len(seqs), desc="generating", disable=not use_tqdm) as bar:
            while pending:
                self.core.step()
                done = {s for s in pending if s.is_finished}
                pending -= done
                bar.update(len(done))
        return [self._output(s, p if isinstance(p, str) else None) for s, p in zip(seqs, prompts)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"}) or to several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([chat_prompt_ids(self.tokenizer, c) for c in conversations], sampling_params)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Generate for one prompt, yielding text as it is decoded."""
        seq = self._add(self._encode(prompt), sampling_params or SamplingParams())
        detok = IncrementalDetokenizer(self.tokenizer)
        sent = 0
        try:
            while not seq.is_finished:
                self.core.step()
                out = seq.output_token_ids
                if len(out) > sent or seq.is_finished:
                    text = detok.step(out, final=seq.is_finished)
                    reason = _FINISH_NAMES[seq.finish_reason] if seq.is_finished else None
                    yield StreamDelta(text, out[sent:], seq.is_finished, reason)
                    sent = len(out)
        finally:
            if not seq.is_finished:
                self.core.abort(seq)

    def _output(self, seq: Sequence, prompt: str | None) -> RequestOutput:
        tokens = seq.output_token_ids
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        reason = _FINISH_NAMES[seq.finish_reason] if seq.finish_reason else None
        return RequestOutput(seq.seq_id, prompt, seq.token_ids[: seq.num_prompt_tokens],
                             [CompletionOutput(0, text, list(tokens), reason)])
