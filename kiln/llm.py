"""LLM: the high-level API most users start from.

    from kiln import LLM, SamplingParams
    llm = LLM("path/to/hf-dir-or.gguf-or-checkpoint-or-engine")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from kiln.checkpoint.peft import load_prompt_table, read_adapter
from kiln.engine_cache import resolve_engine
from kiln.errors import ConfigError, RequestError
from kiln.layers.lora import LoraAdapter
from kiln.outputs import (FINISH_NAMES, CompletionOutput, RequestOutput, StreamDelta, TextTracker, beam_completions,
                          completion)
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore, SequenceGroup
from kiln.runtime.lora_cache import LoraConfig, parse_adapter
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import FinishReason
from kiln.tokenizer import chat_prompt_ids, end_ids, load_tokenizer

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "StreamDelta"]

class LLM:
    """Generate text with a model given as an HF dir, a GGUF file, a kiln checkpoint or an engine.

    Anything but an engine is converted and built once into the engine cache
    (``cache_dir``, default ``~/.cache/kiln``) and reused on later calls, exactly as ``kiln run``
    and ``kiln serve`` build it; ``dtype`` ``"auto"`` follows ``kiln build --dtype auto``
    (bfloat16 on a CPU with native bf16), ``"float32"`` keeps full precision. ``quantization``
    quantizes an HF dir or GGUF file while converting: an algorithm name (``"W8A16"``,
    ``"W4A16"``, ``"W4A16_AWQ"``, ``"W4A16_GPTQ"``, ``"W4A8_AWQ"``, ``"FP8"``, ``"W8A8_SQ_PER_CHANNEL"``), a
    ``QuantConfig``, or a dict of its fields (``group_size``, ``has_zero_point``,
    ``exclude_modules``, ``kv_cache_quant_algo``) plus calibration options (``calib_dataset``,
    ``calib_size``, ``calib_max_len``, ``smoothquant_alpha``, ``gptq_act_order``, ``awq_gptq``) as
    ``kiln convert`` takes them. ``max_prompt_embedding_table_size`` builds the engine with
    prompt tuning (``generate(prompt_table=...)``) for tables of up to that many rows.
    """

    def __init__(self, model: str | Path, *, tokenizer: str | Path | None = None, dtype: str = "auto",
                 cache_dir: str | Path | None = None, max_batch_size: int | None = None,
                 max_input_len: int | None = None, max_seq_len: int | None = None,
                 max_num_tokens: int | None = None, tokens_per_block: int | None = None,
                 max_beam_width: int | None = None, kv_cache_max_tokens: int | None = None,
                 max_prompt_embedding_table_size: int | None = None, quantization=None, progress: bool = True):
        build_options = dict(max_batch_size=max_batch_size, max_input_len=max_input_len, max_seq_len=max_seq_len,
                             max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block,
                             max_beam_width=max_beam_width,
                             max_prompt_embedding_table_size=max_prompt_embedding_table_size)
        self.engine_dir = resolve_engine(model, dtype=dtype, build_options=build_options, cache_dir=cache_dir,
                                         progress=progress, quantization=quantization)
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
        self._lora_adapters: dict[object, LoraAdapter] = {}  # by adapter directory or task id

    def close(self) -> None:
        """Release the other ranks of a world this LLM runs on rank 0 of (a no-op in one process)."""
        self.core.close()

    # -- requests ---------------------------------------------------------------------------

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _engine_params(self, params: SamplingParams) -> SamplingParams:
        """The request's params with the model's extra end ids, tokenized bad words and the
        log-probs ``best_of`` needs to rank its samples."""
        changes = {}
        if self.extra_stop_ids and not params.ignore_eos:  # ignore_eos ignores every end id
            changes["stop_token_ids"] = list(params.stop_token_ids) + self.extra_stop_ids
        if params.bad_words:
            words = list(params.bad_words_ids)
            for word in params.bad_words:  # ban the word at a word start and mid-text alike
                for variant in {word, " " + word.lstrip()}:
                    ids = self.tokenizer(variant, add_special_tokens=False)["input_ids"]
                    if ids and ids not in words:
                        words.append(ids)
            changes["bad_words_ids"] = words
        if not params.use_beam_search and params.num_samples > params.n and params.logprobs is None:
            changes["logprobs"] = 0
        if params.use_beam_search and (params.stop or params.stop_words_ids):
            raise RequestError("stop strings and multi-token stop words are not supported with beam search")
        return dataclasses.replace(params, **changes) if changes else params

    def lora_adapter(self, lora) -> LoraAdapter | None:
        """The adapter ``lora`` names, loaded once: the name of one built into the engine
        (``kiln build --lora_dir``), a Hugging Face PEFT LoRA adapter directory, a directory
        ``kiln lora convert`` wrote, or a ``LoraConfig`` (weights and config the first time, its
        ``task_id`` alone after); None for None."""
        if lora is None or isinstance(lora, LoraAdapter):
            return lora
        if isinstance(lora, LoraConfig):
            key = ("task", lora.task_id)
            if lora.weights is None and lora.config is None:
                if key not in self._lora_adapters:
                    raise RequestError(f"lora: task_id {lora.task_id} has not been given its weights and config")
                return self._lora_adapters[key]
            weights, config = lora.weights, lora.config
        elif isinstance(lora, (str, Path)):
            key = self.engine.lora_adapter_dirs.get(str(lora), Path(lora)).resolve()  # a built-in adapter's name
            if key in self._lora_adapters:
                return self._lora_adapters[key]
            weights, config = read_adapter(key)
        else:
            raise RequestError(f"lora: expected an adapter directory or a LoraConfig, got {type(lora).__name__}")
        adapter = self._lora_adapters[key] = parse_adapter(weights, config, self.engine.config,
                                                           self.engine.lora_config, "lora")
        return adapter

    def _add(self, prompt_ids: list[int], params: SamplingParams, lora=None,
             prompt_table=None) -> tuple[SequenceGroup, dict]:
        """Queue a request; returns it with a stop-string tracker per sequence (when asked)."""
        request = self.core.add_request(prompt_ids, self._engine_params(params), self.end_id,
                                        return_context_logits=params.prompt_logprobs is not None,
                                        lora=self.lora_adapter(lora),
                                        prompt_table=load_prompt_table(prompt_table)
                                        if isinstance(prompt_table, (str, Path)) else prompt_table)
        trackers = {}
        if params.stop:
            trackers = {s.seq_id: TextTracker(self.tokenizer, params.stop, params.include_stop_str_in_output)
                        for s in request.seqs}
        return request, trackers

    def _check_stop_strings(self, request: SequenceGroup, trackers: dict) -> None:
        for seq in request.seqs:
            tracker = trackers.get(seq.seq_id)
            if tracker is None or tracker.num_tokens == seq.num_output_tokens:
                continue
            if tracker.update(seq.output_token_ids, final=seq.is_finished):
                self.core.finish_sequence(seq, FinishReason.STOP_WORDS)

    def _step(self, pending: dict[int, tuple[SequenceGroup, dict]]) -> list[SequenceGroup]:
        """One engine step; applies stop strings; returns the requests that finished. A request
        that failed inside the engine raises its error here (the engine is fine)."""
        self.core.step()
        for _, error in self.core.take_failures():
            raise error
        done = []
        for request_id, (request, trackers) in list(pending.items()):
            if trackers:
                self._check_stop_strings(request, trackers)
            if request.is_finished:
                done.append(request)
                del pending[request_id]
        return done

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora=None, prompt_table=None) -> list[RequestOutput]:
        """Generate for every prompt (all batched together); outputs in prompt order. ``lora``:
        a LoRA adapter for every prompt, or a list with one per prompt (None: the base model),
        as ``lora_adapter`` takes them. ``prompt_table``: a prompt-tuning embedding table
        ``[n_virtual, hidden]``, a PEFT prompt-tuning adapter directory or a ``.npy`` table (or a
        list, one per prompt) whose row ``i`` a prompt names as token id ``vocab_size + i``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        tables = prompt_table if isinstance(prompt_table, list) else [prompt_table] * len(prompts)
        if len(loras) != len(prompts) or len(tables) != len(prompts):
            raise RequestError(f"{len(loras)} LoRA adapters and {len(tables)} prompt tables for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        added: list[tuple[SequenceGroup, dict]] = []
        try:
            for ids, p, adapter, table in zip(encoded, params_list, loras, tables):
                added.append(self._add(ids, p, adapter, table))
        except Exception:
            for request, _ in added:  # one bad prompt rejects the batch: leave nothing queued
                self.core.abort(request)
            raise
        pending = {r.request_id: (r, t) for r, t in added}
        try:
            with tqdm(total=len(added), desc="generating", disable=not use_tqdm) as bar:
                while pending:
                    bar.update(len(self._step(pending)))
        except BaseException:  # a request failed, or the caller interrupted: leave nothing queued
            for request, _ in pending.values():
                self.core.abort(request)
            raise
        return [self._output(r, t, p if isinstance(p, str) else None, sp)
                for (r, t), p, sp in zip(added, prompts, params_list)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, lora=None) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"}) or to several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([chat_prompt_ids(self.tokenizer, c) for c in conversations], sampling_params, lora=lora)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               lora=None) -> Iterator[StreamDelta]:
        """Generate for one prompt (one sequence, no beam search), yielding text as it is decoded."""
        params = sampling_params or SamplingParams()
        if params.use_beam_search or params.num_samples > 1:
            raise RequestError("stream() returns one sequence: use generate() for n > 1 or beam search")
        request, trackers = self._add(self._encode(prompt), params, lora)
        seq = request.seqs[0]
        tracker = trackers.get(seq.seq_id) or TextTracker(self.tokenizer, [], False)
        pending = {request.request_id: (request, trackers)}
        sent = 0
        try:
            while pending:
                self._step(pending)
                out = seq.output_token_ids
                if len(out) > sent or seq.is_finished:
                    if tracker.num_tokens != len(out):
                        tracker.update(out, final=seq.is_finished)
                    reason = FINISH_NAMES[seq.finish_reason] if seq.is_finished else None
                    yield StreamDelta(tracker.delta(), out[sent:], seq.is_finished, reason)
                    sent = len(out)
        finally:
            if not request.is_finished:
                self.core.abort(request)

    # -- outputs ------------------------------------------------------------------------------

    def _output(self, request: SequenceGroup, trackers: dict, prompt: str | None, params: SamplingParams) -> RequestOutput:
        """The caller's view of a finished request (``params``: what the caller asked for)."""
        if request.beam is not None:
            outputs = beam_completions(request, self.tokenizer, params.logprobs is not None)[: params.n]
        else:
            seqs = request.seqs
            if len(seqs) > params.n:  # best_of: keep the n most likely samples
                seqs = sorted(seqs, key=lambda s: -s.cum_logprob)[: params.n]
            outputs = [completion(i, s, self.tokenizer, trackers.get(s.seq_id), params.logprobs is not None)
                       for i, s in enumerate(seqs)]
        return RequestOutput(request.request_id, prompt, list(request.prompt_token_ids), outputs,
                             self._prompt_logprobs(request))

    def _prompt_logprobs(self, request: SequenceGroup) -> list | None:
        k = request.params.prompt_logprobs
        if k is None or not request.context_logits:
            return None
        logprobs = torch.cat(request.context_logits).log_softmax(dim=-1)  # row i predicts prompt token i + 1
        ids = request.prompt_token_ids
        out: list = [None]
        for i in range(1, len(ids)):
            entry = {ids[i]: logprobs[i - 1, ids[i]].item()}
            if k:
                values, tops = logprobs[i - 1].topk(k)
                entry = {**dict(zip(tops.tolist(), values.tolist())), **entry}
            out.append(entry)
        return out
