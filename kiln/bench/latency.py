"""``kiln bench latency``: one request at a time, kiln beside Hugging Face transformers.

Figures (medians over rounds that alternate kiln and HF, so machine noise hits both):
engine load and load-to-first-token, prefill tok/s (a ``prefill_len`` prompt), time to
first token and batch-1 decode tok/s (a ``prompt_len`` prompt, ``new_tokens`` greedy tokens,
end token ignored), kiln's host overhead per decode step (the step's time outside the model
forward and LM head: scheduling, metadata, sampling, detokenization), achieved bandwidth (weight bytes x
decode tok/s / read bandwidth measured in this run) and peak RSS.
"""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from kiln.bench.common import ForwardTimer, new_record, precision, random_prompts, ratio, weight_bytes_per_token
from kiln.bench.machine import machine_facts, peak_rss_mb
from kiln.bench.peer import hf_generate, load_hf_peer
from kiln.config.engine_args import EngineArgs
from kiln.llm import LLM
from kiln.runtime.sampling_params import SamplingParams


def _kiln_stream(llm, prompt: list[int], new_tokens: int, timers: list[ForwardTimer]) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for timer in timers:
        timer.reset()
    started = time.perf_counter()
    first = None
    for _ in llm.stream(prompt, params):
        if first is None:
            first = time.perf_counter()
    decode_s = time.perf_counter() - first
    steps = new_tokens - 1
    # The first call of each timed module is the prompt's; the rest are decode steps.
    model_s = sum(sum(timer.durations[1:]) for timer in timers)
    outside = (decode_s - model_s) / steps if steps else float("nan")
    return {"ttft_s": first - started, "decode_tok_s": steps / decode_s if steps else float("nan"),
            "host_overhead_ms": 1000 * outside}


def _hf_round(model, prompt: list[int], new_tokens: int) -> dict:
    first, total = hf_generate(model, [prompt], new_tokens)
    return {"ttft_s": first, "decode_tok_s": (new_tokens - 1) / (total - first)}


def run_latency(engine: str | Path | EngineArgs, *, hf_gguf: str | None = None, hf_dir: str | None = None, prompt_len: int = 32,
                prefill_len: int = 512, new_tokens: int = 128, rounds: int = 3, seed: int = 0,
                progress: bool = True) -> dict:
    machine = machine_facts()
    started = time.perf_counter()
    llm = LLM(engine, progress=False)
    constructed = time.perf_counter() - started
    load_s = llm.engine.load_seconds
    vocab = llm.engine.config.vocab_size
    prompt, long_prompt = random_prompts(1, prompt_len, vocab, seed)[0], random_prompts(1, prefill_len, vocab, seed)[0]
    model = llm.core.runner.model
    # The model forward and the LM head (logits of the sampled rows, computed after it).
    # (A pipeline's rank 0 holds only the first stage: its overhead then includes the others'.)
    timers = [ForwardTimer(model)] + ([ForwardTimer(model.lm_head)] if hasattr(model, "lm_head") else [])
    kiln_load_to_first = constructed + _kiln_stream(llm, prompt, 2, timers)["ttft_s"]  # a cold start
    hf = None
    if hf_gguf or hf_dir:
        hf, hf_load_s = load_hf_peer(llm.engine.config.dtype, gguf=hf_gguf, model_dir=hf_dir)
        hf_load_to_first = hf_load_s + hf_generate(hf, [prompt], 2)[0]
    kiln_runs, hf_runs, kiln_prefill, hf_prefill = [], [], [], []
    for _ in tqdm(range(rounds), desc="latency rounds", disable=not progress):
        kiln_runs.append(_kiln_stream(llm, prompt, new_tokens, timers))
        kiln_prefill.append(prefill_len / _kiln_stream(llm, long_prompt, 1, timers)["ttft_s"])
        if hf is not None:
            hf_runs.append(_hf_round(hf, prompt, new_tokens))
            hf_prefill.append(prefill_len / hf_generate(hf, [long_prompt], 1)[0])
    for t in timers:
        t.remove()

    def med(runs, key):
        return round(statistics.median(r[key] for r in runs), 4) if runs else None

    weight_bytes = weight_bytes_per_token(llm.core.runner.model)
    # A hybrid model's recurrent state: one slot read and one written per token (two slots a sequence).
    state_bytes = llm.core.runner.state_slot_bytes
    kiln = {"engine_load_s": round(load_s, 3), "load_to_first_token_s": round(kiln_load_to_first, 3),
            "prefill_tok_s": round(statistics.median(kiln_prefill), 1), "ttft_s": med(kiln_runs, "ttft_s"),
            "decode_tok_s": med(kiln_runs, "decode_tok_s"), "host_overhead_ms": med(kiln_runs, "host_overhead_ms"),
            "weight_bytes": weight_bytes, "state_bytes_per_sequence": 2 * state_bytes,
            "peak_rss_mb": round(peak_rss_mb())}
    # Three significant figures, not decimals: a tiny model's fraction is far below 0.001.
    moved = (weight_bytes + 2 * state_bytes) * kiln["decode_tok_s"]
    kiln["bandwidth_fraction"] = float(f"{moved / (machine['read_gbs'] * 1e9):.3g}")
    spec = llm.core.stats.spec
    if spec is not None:  # speculative decoding: how much of what was proposed was kept
        kiln["spec_decode"] = {"acceptance_rate": round(spec.acceptance_rate, 3),
                               "mean_accepted_length": round(spec.mean_accepted_length, 3)}
    mapping = llm.engine.config.mapping
    llm.close()  # releases the other ranks of a split engine
    record = new_record("latency", engine=str(llm.engine_dir), dtype=llm.engine.config.dtype,
                        weights=llm.engine.config.quantization.quant_algo or llm.engine.config.dtype, prompt_len=prompt_len,
                        prefill_len=prefill_len, new_tokens=new_tokens, rounds=rounds, machine=machine, kiln=kiln,
                        world={"tp_size": mapping.tp_size, "pp_size": mapping.pp_size})
    if hf is not None:
        record["hf"] = {"load_s": round(hf_load_s, 3), "load_to_first_token_s": round(hf_load_to_first, 3),
                        "prefill_tok_s": round(statistics.median(hf_prefill), 1), "ttft_s": med(hf_runs, "ttft_s"),
                        "decode_tok_s": med(hf_runs, "decode_tok_s")}
        record["kiln_over_hf"] = {k: ratio(kiln[k], record["hf"][k]) for k in ("prefill_tok_s", "decode_tok_s")}
        record["kiln_over_hf"]["ttft_speedup"] = ratio(record["hf"]["ttft_s"], kiln["ttft_s"])
        record["kiln_over_hf"]["load_to_first_token_speedup"] = ratio(hf_load_to_first, kiln_load_to_first)
        del hf
        gc.collect()
    return record


def format_latency(record: dict) -> str:
    k, h = record["kiln"], record.get("hf") or {}
    m = record["machine"]
    lines = [f"latency: {precision(record)}, {m['threads']} threads, {record['prompt_len']}-token prompt, "
             f"{record['new_tokens']} new tokens, prefill {record['prefill_len']} tokens, median of {record['rounds']}",
             f"machine: read {m['read_gbs']} GB/s, matmul {m['matmul_gflops_fp32']} GFLOP/s fp32, "
             f"{m['matmul_gflops_bf16'] or 'no native'} bf16",
             f"  {'':22} {'kiln':>10} {'HF':>10} {'kiln/HF':>8}"]
    rows = [("decode tok/s", "decode_tok_s", False, "{:.1f}"), ("prefill tok/s", "prefill_tok_s", False, "{:.0f}"),
            ("time to first token s", "ttft_s", True, "{:.3f}"),
            ("load to first token s", "load_to_first_token_s", True, "{:.2f}")]
    for label, key, lower_better, fmt in rows:
        kv, hv = k.get(key), h.get(key)
        r = ratio(hv, kv) if lower_better else ratio(kv, hv)
        hs = fmt.format(hv) if hv is not None else "-"
        lines.append(f"  {label:22} {fmt.format(kv):>10} {hs:>10} {f'{r:.2f}x' if r else '-':>8}")
    spec = k.get("spec_decode")
    if spec:
        lines.append(f"  speculative decoding: {spec['acceptance_rate']:.0%} of proposed tokens kept, "
                     f"{spec['mean_accepted_length']:.2f} tokens per verifying step")
    if k.get("state_bytes_per_sequence"):
        lines.append(f"  recurrent state: {k['state_bytes_per_sequence'] / 1e6:.2f} MB a sequence (two slots; one "
                     "read and one written per token, counted in the bandwidth below)")
    world = record.get("world") or {}
    if world.get("tp_size", 1) * world.get("pp_size", 1) > 1:
        lines.append(f"  tp {world['tp_size']} x pp {world['pp_size']} ranks on this machine; host overhead and "
                     "weights are rank 0's (its model part)")
    lines.append(f"  kiln engine load {k['engine_load_s']} s (HF from_pretrained {h.get('load_s', '-')} s); "
                 f"host overhead {k['host_overhead_ms']:.2f} ms/step; weights {k['weight_bytes'] / 1e6:.0f} MB "
                 f"read at {k['bandwidth_fraction'] * 100:.0f}% of measured bandwidth; peak RSS {k['peak_rss_mb']} MB")
    return "\n".join(lines)
