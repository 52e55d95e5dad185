"""Batch-1 decode speed of kiln next to Hugging Face transformers, same prompt, same run.

Both decode greedily for exactly ``--max_new_tokens`` tokens from the same chat prompt.
Decode tok/s counts tokens after the first (the first token's time is prompt processing).
Rounds alternate kiln / HF so machine noise hits both alike; medians are reported.

    python benchmarks/decode_vs_hf.py --engine_dir ENGINE --hf_gguf FILE.gguf   # or --hf_dir DIR
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_peer import add_peer_args, check_peer_args, load_hf_peer


def kiln_round(llm, prompt_ids: list[int], n: int) -> tuple[float, float]:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first = None
    for _ in llm.stream(prompt_ids, params):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first)


class _Clock:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def hf_round(model, prompt_ids: list[int], n: int) -> tuple[float, float]:
    ids = torch.tensor([prompt_ids])
    clock = _Clock()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, streamer=clock)
    end = time.perf_counter()
    return clock.first - start, (n - 1) / (end - clock.first)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine_dir", required=True, help="kiln engine to measure")
    add_peer_args(p)
    p.add_argument("--prompt", default="Give me three tips for writing clear code.", help="user message")
    p.add_argument("--max_new_tokens", type=int, default=128, help="tokens to decode per round (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per engine; medians reported (default 3)")
    p.add_argument("--output_json", help="also write the figures here")
    args = p.parse_args(argv)
    check_peer_args(p, args)

    from kiln import LLM
    from kiln.tokenizer import chat_prompt_ids

    llm = LLM(args.engine_dir, progress=False)
    prompt_ids = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": args.prompt}])
    started = time.perf_counter()
    hf = load_hf_peer(args, llm.engine.config.dtype)
    hf_load = time.perf_counter() - started

    kiln_runs, hf_runs = [], []
    kiln_round(llm, prompt_ids, 8)  # warm-up: page in weights, first-call set-up
    hf_round(hf, prompt_ids, 8)
    for r in range(args.rounds):
        kiln_runs.append(kiln_round(llm, prompt_ids, args.max_new_tokens))
        hf_runs.append(hf_round(hf, prompt_ids, args.max_new_tokens))
        print(f"round {r + 1}/{args.rounds}: kiln {kiln_runs[-1][1]:.1f} tok/s, HF {hf_runs[-1][1]:.1f} tok/s",
              file=sys.stderr)
    result = {
        "model": llm.engine.config.architecture, "dtype": llm.engine.config.dtype, "threads": args.threads,
        "prompt_tokens": len(prompt_ids), "new_tokens": args.max_new_tokens, "rounds": args.rounds,
        "kiln_decode_tok_s": statistics.median(r[1] for r in kiln_runs),
        "hf_decode_tok_s": statistics.median(r[1] for r in hf_runs),
        "kiln_first_token_ms": 1000 * statistics.median(r[0] for r in kiln_runs),
        "hf_first_token_ms": 1000 * statistics.median(r[0] for r in hf_runs),
        "kiln_engine_load_s": llm.engine.load_seconds, "hf_load_s": hf_load,
    }
    result["decode_ratio_kiln_over_hf"] = result["kiln_decode_tok_s"] / result["hf_decode_tok_s"]
    print(f"\nbatch-1 decode, {args.max_new_tokens} new tokens after a {len(prompt_ids)}-token chat prompt, "
          f"{result['dtype']}, {args.threads} threads (median of {args.rounds}):")
    print(f"  {'':6} {'decode tok/s':>13} {'first token ms':>15} {'load s':>8}")
    print(f"  {'kiln':6} {result['kiln_decode_tok_s']:13.1f} {result['kiln_first_token_ms']:15.0f} "
          f"{result['kiln_engine_load_s']:8.2f}")
    print(f"  {'HF':6} {result['hf_decode_tok_s']:13.1f} {result['hf_first_token_ms']:15.0f} {result['hf_load_s']:8.2f}")
    print(f"  kiln / HF decode: {result['decode_ratio_kiln_over_hf']:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
