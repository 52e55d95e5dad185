"""Prometheus text-format metrics, written by hand (no client library needed)."""
from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip(list(self.buckets) + ["+Inf"], self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Counters and histograms the serving code updates; gauges are read at scrape time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.in_flight = 0  # HTTP-level generation requests being served

    def add_prompt_tokens(self, n: int) -> None:
        with self.lock:
            self.prompt_tokens += n

    def add_generated(self, n: int, ttft: float | None, itl: float | None) -> None:
        with self.lock:
            self.generation_tokens += n
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None and n > 0:
                self.itl.observe(itl / n, n)

    def finished(self, reason: str) -> None:
        with self.lock:
            self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The exposition text; ``gauges`` maps a name to (help, value)."""
        lines = []

        def metric(name: str, kind: str, help_: str, body: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *body])

        for name, (help_, value) in gauges.items():
            metric(name, "gauge", help_, [f"{name} {value}"])
        with self.lock:
            metric("kiln_prompt_tokens_total", "counter", "Prompt tokens processed.",
                   [f"kiln_prompt_tokens_total {self.prompt_tokens}"])
            metric("kiln_generation_tokens_total", "counter", "Tokens generated.",
                   [f"kiln_generation_tokens_total {self.generation_tokens}"])
            metric("kiln_request_success_total", "counter", "Finished sequences by finish reason.",
                   [f'kiln_request_success_total{{finish_reason="{r}"}} {n}'
                    for r, n in sorted(self.requests_finished.items())])
            metric("kiln_time_to_first_token_seconds", "histogram", "Time from arrival to the first token.",
                   self.ttft.lines("kiln_time_to_first_token_seconds"))
            metric("kiln_inter_token_latency_seconds", "histogram", "Time between generated tokens.",
                   self.itl.lines("kiln_inter_token_latency_seconds"))
        return "\n".join(lines) + "\n"


def engine_gauges(last, pool, idle: bool, states=None, slot_bytes: int = 0,
                  state_cache=None) -> dict[str, tuple[str, float]]:
    """Gauges (name -> help, value) of the executor's latest iteration stats ``last`` (None before
    the first step), its KV block ``pool`` and, for a hybrid model, its recurrent-state slots
    ``states`` of ``slot_bytes`` each and (prefix caching) its ``state_cache`` of checkpoints;
    ``idle``: no request is being served."""
    gauges = {
        "kiln_num_requests_running": ("Sequences being generated.",
                                      0 if idle or last is None else last.num_active_requests),
        "kiln_num_requests_waiting": ("Sequences waiting to be scheduled.",
                                      0 if idle or last is None else last.num_queued_requests),
        "kiln_kv_cache_blocks_used": ("KV cache blocks in use.", pool.num_blocks - pool.num_free),
        "kiln_kv_cache_blocks_total": ("KV cache blocks in all.", pool.num_blocks),
        "kiln_kv_cache_usage_ratio": ("Fraction of KV cache blocks in use.",
                                      (pool.num_blocks - pool.num_free) / pool.num_blocks),
        "kiln_prefix_cache_hit_rate": ("Prefix-cache hit blocks / looked-up blocks since start.", pool.hit_rate),
    }
    if states is not None:
        gauges.update({
            "kiln_state_cache_slots_used": ("Recurrent-state slots in use (two per running sequence).",
                                            states.num_slots - states.num_free),
            "kiln_state_cache_slots_total": ("Recurrent-state slots in all.", states.num_slots),
            "kiln_state_cache_bytes": ("Bytes of all recurrent-state slots (recurrent layers' state per slot "
                                       "times slots).", states.num_slots * slot_bytes),
        })
    if state_cache is not None:
        gauges.update({
            "kiln_state_checkpoints_cached": ("Prefix caching: recurrent states kept at block boundaries.",
                                              state_cache.num_cached),
            "kiln_state_checkpoints_total": ("Prefix caching: checkpoint slots in all.", state_cache.num_slots),
            "kiln_state_checkpoints_bytes": ("Bytes of the checkpoint slots.", state_cache.num_slots * slot_bytes),
        })
    spec = None if last is None else last.spec_decode
    if spec is not None:
        gauges.update({
            "kiln_spec_decode_num_drafts": ("Speculative decoding: steps that verified a sequence's proposals.",
                                            spec.num_drafts),
            "kiln_spec_decode_num_draft_tokens": ("Speculative decoding: tokens proposed.", spec.num_draft_tokens),
            "kiln_spec_decode_num_accepted_tokens": ("Speculative decoding: proposed tokens kept.",
                                                     spec.num_accepted_tokens),
            "kiln_spec_decode_acceptance_rate": ("Speculative decoding: kept / proposed tokens.",
                                                 spec.acceptance_rate),
            "kiln_spec_decode_mean_accepted_length": ("Speculative decoding: tokens per verifying step of a "
                                                      "sequence (kept proposals and its own).",
                                                      spec.mean_accepted_length),
        })
    lora = None if last is None else last.lora_cache
    if lora is not None:
        gauges.update({
            "kiln_lora_host_adapters": ("LoRA adapters in the host cache.", lora.host_adapters),
            "kiln_lora_host_bytes": ("Bytes of LoRA adapters in the host cache.", lora.host_bytes),
            "kiln_lora_device_adapters": ("LoRA adapters holding device slots.", lora.device_adapters),
            "kiln_lora_device_slots": ("LoRA device slots in all.", lora.device_slots),
            "kiln_lora_cache_hits": ("LoRA task ids found in the host cache since start.", lora.hits),
            "kiln_lora_cache_misses": ("LoRA task ids loaded or unknown since start.", lora.misses),
            "kiln_lora_cache_evictions": ("LoRA adapters evicted since start.", lora.evictions),
        })
    return gauges
