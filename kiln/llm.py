"""LLM: the high-level API most users start from.

    from kiln import LLM, SamplingParams
    llm = LLM("path/to/hf-dir-or.gguf-or-checkpoint-or-engine")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from kiln.checkpoint.peft import load_prompt_table, read_adapter
from kiln.config.engine_args import EngineArgs
from kiln.engine_cache import draft_engine_for, engine_for
from kiln.errors import ConfigError, RequestError
from kiln.layers.lora import LoraAdapter
from kiln.outputs import CompletionOutput, RequestOutput, StreamDelta, beam_completions, completion
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore, SequenceGroup
from kiln.runtime.lora_cache import LoraConfig, parse_adapter
from kiln.runtime.prompt_logprobs import prompt_logprobs
from kiln.runtime.request_processor import RequestProcessor
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import FinishReason
from kiln.tokenizer import chat_prompt_ids

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "StreamDelta"]


class LLM:
    """Generate text with a model given as an HF dir, a GGUF file, a kiln checkpoint or an engine.

    Anything but an engine is converted and built once into the engine cache
    (``cache_dir``, default ``~/.cache/kiln``) and reused on later calls, exactly as ``kiln run``
    and ``kiln serve`` build it. The keywords are :class:`~kiln.config.engine_args.EngineArgs`'
    fields (``tokenizer``, ``cache_dir``, ``quantization``, ``dtype``, the build limits,
    ``kv_cache_max_tokens``, ``enable_prefix_caching``); ``dtype`` ``"auto"`` follows ``kiln build --dtype auto``
    (bfloat16 on a CPU with native bf16), ``"float32"`` keeps full precision. ``quantization``
    quantizes an HF dir or GGUF file while converting: an algorithm name (``"W8A16"``,
    ``"W4A16"``, ``"W4A16_AWQ"``, ``"W4A16_GPTQ"``, ``"W4A8_AWQ"``, ``"FP8"``, ``"W8A8_SQ_PER_CHANNEL"``), a
    ``QuantConfig``, or a dict of its fields (``group_size``, ``has_zero_point``,
    ``exclude_modules``, ``kv_cache_quant_algo``) plus calibration options (``calib_dataset``,
    ``calib_size``, ``calib_max_len``, ``smoothquant_alpha``, ``gptq_act_order``, ``awq_gptq``) as
    ``kiln convert`` takes them. ``max_prompt_embedding_table_size`` builds the engine with
    prompt tuning (``generate(prompt_table=...)``) for tables of up to that many rows.
    ``tokenizer``: a tokenizer directory or a GGUF file (default: the engine's own).

    ``skip_tokenizer_init=True`` loads no tokenizer, for callers that tokenize themselves:
    prompts must be token ids, outputs carry ``token_ids`` and an empty ``text``, log-probs work
    as usual, and stop strings, ``bad_words``, structured outputs and ``chat`` are refused (they
    need a tokenizer). Generation still ends at the model's end-of-sequence ids when the engine's
    ``generation_config.json`` names them (an engine built from a GGUF file always has one, from a
    Hugging Face dir when the dir has one); otherwise only at ``max_tokens`` or ``stop_token_ids``.
    """

    def __init__(self, model: str | Path | EngineArgs, *, progress: bool = True, **options):
        """``options``: the fields of :class:`kiln.config.engine_args.EngineArgs` (the options
        ``kiln run`` and ``kiln serve`` take as flags), or pass an ``EngineArgs`` as ``model``."""
        args = model if isinstance(model, EngineArgs) else EngineArgs(model=model, **options)
        if isinstance(model, EngineArgs) and options:
            raise ConfigError(f"LLM(EngineArgs, ...): give {sorted(options)} in the EngineArgs")
        self.engine_dir = engine_for(args, progress=progress)
        self.engine = Engine(self.engine_dir)
        vocab_size = self.engine.config.vocab_size
        if args.skip_tokenizer_init:
            self.processor = RequestProcessor.without_tokenizer(self.engine_dir, vocab_size)
        else:
            self.processor = RequestProcessor.load(args.tokenizer or self.engine.tokenizer_dir, self.engine_dir,
                                                   vocab_size)
        self.tokenizer = self.processor.tokenizer  # None with skip_tokenizer_init
        num_blocks = None
        if args.kv_cache_max_tokens is not None:
            tokens_per_block = self.engine.build_config.tokens_per_block  # whole blocks holding at least that many
            num_blocks = max(1, -(-args.kv_cache_max_tokens // tokens_per_block))
        self.core = EngineCore(self.engine, max_num_seqs=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                               num_blocks=num_blocks, enable_prefix_caching=args.enable_prefix_caching,
                               speculative_config=draft_engine_for(args.speculative_config, args.cache_dir, progress))
        self.core.use_grammar_tokenizer(self.processor.grammar_tokenizer)
        self._lora_adapters: dict[object, LoraAdapter] = {}  # by adapter directory or task id

    def close(self) -> None:
        """Release the other ranks of a world this LLM runs on rank 0 of (a no-op in one process)."""
        self.core.close()

    # -- requests ---------------------------------------------------------------------------

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return self.processor.encode(prompt)

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
        request = self.core.add_request(prompt_ids, self.processor.engine_params(params), self.processor.end_id,
                                        return_context_logits=params.prompt_logprobs is not None,
                                        lora=self.lora_adapter(lora),
                                        prompt_table=load_prompt_table(prompt_table)
                                        if isinstance(prompt_table, (str, Path)) else prompt_table)
        trackers = {}
        if params.stop:
            trackers = {s.seq_id: self.processor.text_tracker(params) for s in request.seqs}
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
        if self.tokenizer is None:
            raise RequestError("messages: chat renders them with the tokenizer's chat template, and "
                               "skip_tokenizer_init=True loaded none; pass token ids to generate()")
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
        tracker = trackers.get(seq.seq_id) or self.processor.text_tracker(params)
        pending = {request.request_id: (request, trackers)}
        sent = 0
        try:
            while pending:
                self._step(pending)
                out = seq.output_token_ids
                if len(out) > sent or seq.is_finished:
                    if tracker.num_tokens != len(out):
                        tracker.update(out, final=seq.is_finished)
                    reason = self.processor.finish_name(seq.finish_reason if seq.is_finished else None)
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
        return prompt_logprobs(request.context_logits, request.prompt_token_ids, k).entries
