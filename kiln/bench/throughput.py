"""``kiln bench throughput``: batches of requests, kiln beside Hugging Face transformers.

For each batch size, ``batch`` prompts of ``prompt_len`` random tokens each generate exactly
``new_tokens`` greedy tokens: kiln with ``LLM.generate`` (one packed step per iteration over
the paged cache), HF with one static ``generate`` batch. Output tok/s counts every generated
token over the whole call; decode tok/s counts the tokens after the first over the time
after the first token.
"""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from kiln.bench.common import CollectTimer, ForwardTimer, new_record, precision, random_prompts, ratio
from kiln.bench.machine import machine_facts, peak_rss_mb
from kiln.bench.peer import hf_generate, load_hf_peer
from kiln.config.engine_args import EngineArgs
from kiln.llm import LLM
from kiln.runtime.sampling_params import SamplingParams


def kiln_batch(llm, prompts: list[list[int]], new_tokens: int, timer: ForwardTimer | CollectTimer) -> dict:
    """Output tok/s, time to first token and decode tok/s of ``prompts`` generating
    ``new_tokens`` greedy tokens each, all together (every prompt must fit in the first step;
    with pipeline stages, in the first micro-batch of each: ``timer`` is then a CollectTimer)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    timer.reset()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    total = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    # Every prompt fits in the first step (checked by the caller), so its end is the first token;
    # a pipeline deals them into one micro-batch per stage.
    first = timer.ends[llm.engine.config.mapping.pp_size - 1 if isinstance(timer, CollectTimer) else 0] - started
    return _figures(len(prompts), new_tokens, first, total)


def _figures(batch: int, new_tokens: int, first: float, total: float) -> dict:
    return {"output_tok_s": batch * new_tokens / total, "ttft_s": first,
            "decode_tok_s": batch * (new_tokens - 1) / (total - first)}


def run_throughput(engine: str | Path | EngineArgs, *, hf_gguf: str | None = None, hf_dir: str | None = None,
                   batch_sizes: tuple[int, ...] = (8, 32, 64), prompt_len: int = 32, new_tokens: int = 128,
                   rounds: int = 1, seed: int = 0, progress: bool = True) -> dict:
    machine = machine_facts()
    llm = LLM(engine, progress=False)
    build = llm.engine.build_config
    too_big = [b for b in batch_sizes if b > build.max_batch_size or b * prompt_len > build.max_num_tokens]
    if too_big:
        raise ValueError(f"batch sizes {too_big} exceed the engine's max_batch_size {build.max_batch_size} or "
                         f"max_num_tokens {build.max_num_tokens} (rebuild with larger limits)")
    timer = (ForwardTimer(llm.core.runner.model) if llm.engine.config.mapping.pp_size == 1
             else CollectTimer(llm.core.runner))
    hf = None
    if hf_gguf or hf_dir:
        hf, _ = load_hf_peer(llm.engine.config.dtype, gguf=hf_gguf, model_dir=hf_dir)
    vocab = llm.engine.config.vocab_size
    results = []
    for batch in tqdm(batch_sizes, desc="batch sizes", disable=not progress):
        prompts = random_prompts(batch, prompt_len, vocab, seed)
        # Warm-up at this batch size: the first touch of its KV blocks and first calls of its
        # kernel shapes would otherwise be timed (a cold batch of 8 measured 16 tok/s, warm 616).
        kiln_batch(llm, prompts, 4, timer)
        kiln_runs, hf_runs = [], []
        for _ in range(rounds):
            kiln_runs.append(kiln_batch(llm, prompts, new_tokens, timer))
            if hf is not None:
                first, total = hf_generate(hf, prompts, new_tokens)
                hf_runs.append(_figures(batch, new_tokens, first, total))
        row = {"batch": batch, "kiln": _median(kiln_runs)}
        if hf_runs:
            row["hf"] = _median(hf_runs)
            row["kiln_over_hf"] = ratio(row["kiln"]["output_tok_s"], row["hf"]["output_tok_s"])
        results.append(row)
    timer.remove()
    del hf
    gc.collect()
    mapping = llm.engine.config.mapping
    llm.close()  # releases the other ranks of a split engine
    return new_record("throughput", engine=str(llm.engine_dir), dtype=llm.engine.config.dtype,
                      weights=llm.engine.config.quantization.quant_algo or llm.engine.config.dtype, prompt_len=prompt_len,
                      new_tokens=new_tokens, rounds=rounds, machine=machine, batches=results,
                      world={"tp_size": mapping.tp_size, "pp_size": mapping.pp_size},
                      peak_rss_mb=round(peak_rss_mb()))


def _median(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def format_throughput(record: dict) -> str:
    m = record["machine"]
    world = record.get("world") or {}
    split = f", tp {world['tp_size']} x pp {world['pp_size']}" if world.get("tp_size", 1) * world.get("pp_size", 1) > 1 else ""
    lines = [f"throughput: {precision(record)}{split}, {m['threads']} threads, {record['prompt_len']}-token prompts, "
             f"{record['new_tokens']} new tokens each (median of {record['rounds']})",
             f"machine: read {m['read_gbs']} GB/s, matmul {m['matmul_gflops_fp32']} GFLOP/s fp32, "
             f"{m['matmul_gflops_bf16'] or 'no native'} bf16",
             f"  {'batch':>5} {'kiln out tok/s':>15} {'HF out tok/s':>13} {'kiln/HF':>8} "
             f"{'kiln decode tok/s':>18} {'HF decode tok/s':>16}"]
    for row in record["batches"]:
        k, h = row["kiln"], row.get("hf") or {}
        lines.append(f"  {row['batch']:>5} {k['output_tok_s']:>15.1f} {h.get('output_tok_s', float('nan')):>13.1f} "
                     f"{row.get('kiln_over_hf') or '-':>8} {k['decode_tok_s']:>18.1f} "
                     f"{h.get('decode_tok_s', float('nan')):>16.1f}")
    return "\n".join(lines)
