"""Every quantization mode of one model in one run: accuracy against the float32 engine and
decode speed against kiln's own bfloat16 and float32 engines.

For each engine (built beforehand, e.g. with the commands in docs/benchmark-log.md):

* perplexity on the first ``--ppl_samples`` long ShareGPT replies (the held-out ones that
  calibration never sees), windows of ``--window`` tokens every ``--stride``;
* greedy-token agreement with the float32 engine: ``--prompts`` chat-templated ShareGPT first
  turns, ``--new_tokens`` greedy tokens each (identical continuations, mean leading tokens that
  agree, share of positions that agree);
* decode tok/s at each of ``--batches`` (random ``--prompt_len``-token prompts, ``--speed_tokens``
  greedy tokens each), rounds alternating over the engines, medians; each speed also as a ratio
  to the bf16 and fp32 engines' in the same run;
* bytes of weights a batch-1 decode step reads, and KV cache bytes per token (how many more
  tokens fit in the same cache memory than with bf16).

    python benchmarks/quantization.py --fp32 ENGINE --bf16 ENGINE --engine NAME=ENGINE ... \
        [--ppl_samples 50] [--prompts 20] [--new_tokens 64] [--batches 1 32] [--rounds 3] \
        [--output_json FILE]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch
from tqdm import tqdm


def parse_engines(p: argparse.ArgumentParser, specs: list[str]) -> list[tuple[str, str]]:
    engines = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            p.error(f"--engine {spec!r}: expected NAME=DIR")
        engines.append((name, path))
    return engines


def perplexity(llm, texts: list[str], window: int, stride: int) -> float:
    from kiln.eval.perplexity import score_texts, summarize

    token_lists = [llm.tokenizer(t)["input_ids"] for t in texts]
    scores, totals = score_texts(llm, token_lists, window, stride, progress=False)
    return summarize(scores, totals)["perplexity"]


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def chat_prompts(tokenizer, count: int, max_len: int) -> list[list[int]]:
    from kiln.data.sharegpt import first_turns
    from kiln.tokenizer import chat_prompt_ids

    prompts = []
    for prompt, _ in first_turns():
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        if len(ids) <= max_len:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def memory_figures(llm) -> dict:
    from kiln.bench.common import weight_bytes_per_token
    from kiln.step.kv_cache import kv_bytes_per_token, kv_cache_dtype

    config = llm.engine.config
    attention = llm.engine.model.transformer.layers["0"].attention
    kv = kv_bytes_per_token(config.num_hidden_layers, attention.num_kv_heads, attention.head_size,
                            kv_cache_dtype(config))
    return {"weight_mb_per_token": round(weight_bytes_per_token(llm.engine.model) / 1e6, 1), "kv_bytes_per_token": kv}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fp32", required=True, help="the float32 engine: the accuracy reference")
    p.add_argument("--bf16", required=True, help="the bfloat16 engine: the speed reference")
    p.add_argument("--engine", action="append", default=[], metavar="NAME=DIR", help="a quantized engine (repeat)")
    p.add_argument("--ppl_samples", type=int, default=50, help="ShareGPT replies scored for perplexity (default 50)")
    p.add_argument("--window", type=int, default=768, help="perplexity window in tokens (default 768)")
    p.add_argument("--stride", type=int, default=384, help="perplexity stride in tokens (default 384)")
    p.add_argument("--prompts", type=int, default=20, help="chat prompts for greedy agreement (default 20)")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens per agreement prompt (default 64)")
    p.add_argument("--max_prompt_len", type=int, default=256, help="skip longer agreement prompts (default 256)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="batch sizes for decode tok/s")
    p.add_argument("--prompt_len", type=int, default=32, help="prompt tokens of the speed runs (default 32)")
    p.add_argument("--speed_tokens", type=int, default=128, help="greedy tokens per speed request (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="speed rounds alternating over engines (median)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--skip_accuracy", action="store_true", help="measure speed and memory only")
    p.add_argument("--output_json", help="write every figure to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from accuracy_vs_fp32 import agreement
    from kiln import LLM
    from kiln.bench.common import ForwardTimer, random_prompts
    from kiln.bench.throughput import kiln_batch
    from kiln.eval.perplexity import load_texts

    engines = [("fp32", args.fp32), ("bf16", args.bf16), *parse_engines(p, args.engine)]
    results = {name: {"engine": path} for name, path in engines}
    if not args.skip_accuracy:
        texts = load_texts("sharegpt", args.ppl_samples)
        reference, prompts = None, None
        for name, path in tqdm(engines, desc="accuracy"):
            llm = LLM(path, progress=False)
            prompts = prompts or chat_prompts(llm.tokenizer, args.prompts, args.max_prompt_len)
            started = time.perf_counter()
            results[name]["perplexity"] = perplexity(llm, texts, args.window, args.stride)
            tokens = greedy(llm, prompts, args.new_tokens)
            reference = reference or tokens
            results[name]["agreement_with_fp32"] = agreement(reference, tokens, args.new_tokens)
            results[name]["accuracy_seconds"] = round(time.perf_counter() - started, 1)
            results[name].update(memory_figures(llm))
            del llm
            gc.collect()

    # Speed: every engine loaded at once, rounds alternating over them (this machine's speed drifts).
    llms = {name: LLM(path, progress=False) for name, path in engines}
    runs = {name: {b: [] for b in args.batches} for name in llms}
    timers = {name: ForwardTimer(llm.core.runner.model) for name, llm in llms.items()}
    vocab = llms["fp32"].engine.config.vocab_size
    for name, llm in llms.items():  # warm-up (first calls pack weights and build kernels)
        kiln_batch(llm, random_prompts(2, args.prompt_len, vocab), 4, timers[name])
        results[name].update(memory_figures(llm))
    for _ in tqdm(range(args.rounds), desc="speed rounds"):
        for batch in args.batches:
            prompts = random_prompts(batch, args.prompt_len, vocab)
            for name, llm in llms.items():
                runs[name][batch].append(kiln_batch(llm, prompts, args.speed_tokens, timers[name])["decode_tok_s"])
    for name in llms:
        for batch in args.batches:
            results[name][f"decode_tok_s_b{batch}"] = round(statistics.median(runs[name][batch]), 1)
    bf16_kv = results["bf16"]["kv_bytes_per_token"]
    for name in llms:
        r = results[name]
        r["kv_tokens_vs_bf16"] = round(bf16_kv / r["kv_bytes_per_token"], 2)
        for batch in args.batches:
            key = f"decode_tok_s_b{batch}"
            r[f"b{batch}_vs_bf16"] = round(r[key] / results["bf16"][key], 2)
            r[f"b{batch}_vs_fp32"] = round(r[key] / results["fp32"][key], 2)

    print(format_table(results, args.batches, not args.skip_accuracy))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"threads": args.threads, "engines": results}, f, indent=2)
    return 0


def format_table(results: dict, batches: list[int], accuracy: bool) -> str:
    fp32_ppl = results["fp32"].get("perplexity")
    head = "| mode |"
    rule = "|---|"
    if accuracy:
        head += " perplexity | vs fp32 | identical / leading / positions agreeing with fp32 |"
        rule += "---:|---:|---:|"
    for b in batches:
        head += f" decode tok/s b{b} | vs bf16 | vs fp32 |"
        rule += "---:|---:|---:|"
    head += " weights MB/token | KV tokens vs bf16 |"
    rule += "---:|---:|"
    lines = [head, rule]
    for name, r in results.items():
        row = f"| {name} |"
        if accuracy:
            a = r["agreement_with_fp32"]
            row += (f" {r['perplexity']:.4f} | {100 * (r['perplexity'] / fp32_ppl - 1):+.2f}% |"
                    f" {100 * a['identical_continuations']:.0f}% / {a['mean_leading_agreement_tokens']} /"
                    f" {100 * a['position_agreement']:.0f}% |")
        for b in batches:
            row += f" {r[f'decode_tok_s_b{b}']:.1f} | {r[f'b{b}_vs_bf16']:.2f}x | {r[f'b{b}_vs_fp32']:.2f}x |"
        row += f" {r['weight_mb_per_token']} | {r['kv_tokens_vs_bf16']:.2f}x |"
        lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
