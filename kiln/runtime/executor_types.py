"""What goes in and out of the :class:`~kiln.runtime.executor.Executor`: its configuration, a
request, a response (a result or an error), and per-iteration statistics."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from kiln.config.speculative import SpeculativeConfig
from kiln.errors import KilnError, RequestError
from kiln.runtime.lora_cache import LoraCacheConfig, LoraCacheStats, LoraConfig
from kiln.runtime.prompt_tuning import PromptTuningConfig
from kiln.runtime.sampling import SamplingConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import SpecDecodeStats


@dataclass
class KvCacheConfig:
    """KV cache size: ``max_tokens``, else ``free_memory_fraction`` of the available memory."""

    max_tokens: int | None = None
    free_memory_fraction: float = 0.3
    enable_block_reuse: bool = False  # prefix caching: reuse the KV blocks of a shared prompt prefix


SERVING_MAX_NUM_TOKENS = 1024


@dataclass
class ExecutorConfig:
    max_batch_size: int | None = None  # default: the engine's
    # Tokens per step. Serving defaults to 1,024 (or the engine's limit, if lower): a step
    # of that many prompt tokens takes ~1 s on two cores, so running requests keep streaming
    # while long prompts prefill in chunks, and early requests get their first token sooner.
    max_num_tokens: int | None = None
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    capacity_policy: str = "MAX_UTILIZATION"  # or "GUARANTEED_NO_EVICT"
    max_queue_size: int = 1024  # requests waiting to be admitted; beyond it enqueue fails
    iteration_stats_max: int = 1000  # how many iterations' stats to keep
    attention_backend: str = "auto"  # "native" (C decode kernel), "torch" (reference) or auto
    lora_cache_config: LoraCacheConfig = field(default_factory=LoraCacheConfig)
    # Speculative decoding (vLLM's dict, its JSON, or a SpeculativeConfig; None: off). A draft
    # model is an engine directory here (LLM and kiln serve resolve sources: draft_engine_for).
    speculative_config: SpeculativeConfig | dict | str | None = None


@dataclass
class OutputConfig:
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = False


@dataclass
class Request:
    """One generation request (token ids in, token ids out)."""

    input_token_ids: list[int]
    max_tokens: int = 16
    streaming: bool = False
    sampling_config: SamplingConfig | SamplingParams | None = None
    output_config: OutputConfig = field(default_factory=OutputConfig)
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: torch.Tensor | None = None
    lora_config: LoraConfig | None = None  # the adapter the request runs with (reference 004)
    prompt_tuning_config: PromptTuningConfig | None = None  # its task's virtual-token table (reference 001)
    priority: float = 0.5  # higher first; FCFS within a priority
    allotted_time_ms: int | None = None  # finish with "timeout" after this long

    def engine_params(self) -> SamplingParams:
        """The SamplingParams the engine runs this request with: its sampling config, with the
        request's max_tokens, stop and bad words, embedding bias and log-prob output folded in."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        config = self.sampling_config
        if config is None:
            config = SamplingConfig()
        if isinstance(config, SamplingConfig):
            params = config.per_sequence(1, self.max_tokens)[0]
        elif isinstance(config, SamplingParams):
            if config.stop or config.bad_words:  # text: kiln.runtime.request_processor turns them into tokens
                raise RequestError("stop strings and bad_words need a tokenizer: the executor takes stop_words and "
                                   "bad_words as token ids (or use RequestProcessor.engine_params)")
            params = dataclasses.replace(config, max_tokens=self.max_tokens)
        else:
            raise RequestError(f"sampling_config must be a SamplingConfig or SamplingParams, got {type(config).__name__}")
        stop_words = [list(w) for w in self.stop_words]
        return dataclasses.replace(
            params, stop_token_ids=list(params.stop_token_ids) + [w[0] for w in stop_words if len(w) == 1],
            stop_words_ids=list(params.stop_words_ids) + [w for w in stop_words if len(w) > 1],
            bad_words_ids=list(params.bad_words_ids) + [list(w) for w in self.bad_words],
            embedding_bias=self.embedding_bias if self.embedding_bias is not None else params.embedding_bias,
            logprobs=0 if self.output_config.return_log_probs and params.logprobs is None else params.logprobs)


@dataclass
class Result:
    output_token_ids: list[list[int]]  # per beam (or sample); new tokens only when streaming
    is_final: bool
    finish_reasons: list[str | None]
    log_probs: list[list[float]] | None = None
    cum_log_probs: list[float] | None = None
    # per sequence, per generated token: {token: logprob} of the top-k, when the request's
    # sampling params ask for ``logprobs=k`` (k > 0); all tokens so far, even when streaming
    top_log_probs: list[list[dict[int, float]]] | None = None
    # [prompt tokens, vocab]: in the final result, or a streaming request's first one after its prefill
    context_logits: torch.Tensor | None = None
    generation_logits: list | None = None


@dataclass
class Response:
    """A request's new output, or its error: ``internal_error`` False when the request was at
    fault (invalid: a client error), True when kiln failed while serving it (a server error)."""

    request_id: int
    result: Result | None = None
    error_msg: str | None = None
    internal_error: bool = False

    def has_error(self) -> bool:
        return self.error_msg is not None


def error_response(request_id: int, error: BaseException) -> Response:
    """The final response of a request that failed with ``error``; only kiln's own input errors
    are the request's fault."""
    if isinstance(error, KilnError):
        return Response(request_id, error_msg=str(error))
    return Response(request_id, error_msg=f"internal error while serving this request: {error!r}",
                    internal_error=True)


@dataclass
class IterationStats:
    iteration: int
    timestamp: float
    step_ms: float
    num_active_requests: int
    num_queued_requests: int
    num_scheduled_tokens: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_blocks_cached: int  # holding reusable prefix content (in use or free)
    prefix_cache_hit_rate: float  # hit blocks / looked-up blocks since start
    lora_cache: LoraCacheStats | None = None  # the LoRA cache's levels and counters
    num_waiting_for_lora: int = 0  # requests waiting for a LoRA device slot
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters since start, when it is on

    @classmethod
    def of(cls, core, iteration: int, step_ms: float, num_active: int, lora_cache: LoraCacheStats | None,
           num_waiting_for_lora: int) -> "IterationStats":
        """The stats of an engine core (``kiln.runtime.engine_core.EngineCore``) after a step."""
        pool, spec = core.pool, core.stats.spec
        return cls(iteration, time.time(), step_ms, num_active, len(core.scheduler.waiting),
                   core.stats.last_step_tokens, pool.num_blocks - pool.num_free, pool.num_free, pool.num_blocks,
                   pool.num_cached, pool.hit_rate, lora_cache, num_waiting_for_lora,
                   spec and dataclasses.replace(spec))
