"""Quality beside speed for every precision, kiln's modes and llama.cpp's types, same weights.

    python benchmarks/quality.py --gguf $SMOLLM2_GGUF --kiln fp32=ENGINE W4A16=ENGINE ... \
        --llamacpp f32 q8_0 q4_0 q4_k_m [--ppl_samples 20] [--window 512] [--stride 256] \
        [--rounds 3] [--new_tokens 64] [--output_json FILE]

For each kiln engine and each llama.cpp type (made from ``--gguf`` by llama.cpp's own quantizer,
as benchmarks/llamacpp_peer.py does):

* perplexity on the first ``--ppl_samples`` long ShareGPT replies (kiln's held-out texts), the
  same token ids and sliding windows for every engine (``kiln.eval.perplexity``); llama.cpp
  scores them from its own logits, token ids fed directly (no second tokenizer);
* its ratio to full precision: a kiln engine's to the first kiln engine's (give the float one
  first), a llama.cpp type's to the first llama.cpp type's (give f32 first);
* batch-1 greedy decode tok/s after a 32-token prompt, rounds alternating, medians.

The bundled GGUF is itself Q4_1 (blocks of 32, a float scale and minimum each): every type is
re-rounded from those values, and a 4-bit format with 32-wide groups and a float minimum holds
them exactly, so on this model such formats look better than on an original float model.
Records go to ``--output_json`` (kind "quality"); ``python benchmarks/report.py`` renders them.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from kiln.bench.common import append_record, new_record, stream_round
from kiln.bench.machine import machine_facts
from kiln.eval.perplexity import load_texts, score_texts, sliding_windows, summarize
from llamacpp_peer import llamacpp_round, make_gguf  # benchmarks/ is on the path: scripts run from it


def llamacpp_perplexity(llm, token_lists: list[list[int]], window: int, stride: int) -> float:
    """exp of the mean NLL of every token but each text's first, in kiln's windows."""
    nll, scored = 0.0, 0
    for ids in token_lists:
        for w in sliding_windows(len(ids), window, stride):
            llm.reset()
            llm.eval(ids[w.start:w.end])
            logits = np.asarray(llm.scores[:w.end - w.start], dtype=np.float64)
            top = logits.max(axis=1, keepdims=True)
            logprobs = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
            for pos in range(w.score_from, w.end):  # row k predicts the window's token k + 1
                nll -= logprobs[pos - w.start - 1, ids[pos]]
            scored += w.end - w.score_from
    return math.exp(nll / scored)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="the GGUF llama.cpp's types are made from (the bundled one)")
    p.add_argument("--kiln", nargs="+", default=[], metavar="NAME=ENGINE",
                   help="kiln engines of the same model; the first is the reference")
    p.add_argument("--llamacpp", nargs="*", default=[], metavar="TYPE",
                   help="llama.cpp weight types (benchmarks/llamacpp_peer.py FTYPES)")
    p.add_argument("--ppl_samples", type=int, default=20, help="held-out ShareGPT replies scored (default 20)")
    p.add_argument("--window", type=int, default=512, help="perplexity window in tokens (default 512)")
    p.add_argument("--stride", type=int, default=256, help="perplexity window stride (default 256)")
    p.add_argument("--rounds", type=int, default=3, help="alternating decode rounds; medians (default 3)")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens per decode round (default 64)")
    p.add_argument("--output_json", default=str(Path(__file__).parent / "results.jsonl"),
                   help="append the record here (default benchmarks/results.jsonl)")
    args = p.parse_args(argv)
    if not args.kiln:
        p.error("--kiln: give at least the reference engine")

    import llama_cpp

    from kiln import LLM

    engines = {}
    for spec in args.kiln:
        name, sep, path = spec.partition("=")
        if not sep:
            p.error(f"--kiln {spec!r}: expected NAME=ENGINE")
        engines[f"kiln {name}"] = ("kiln", LLM(path, progress=False))
    reference = next(iter(engines.values()))[1]
    token_lists = [reference.tokenizer(t)["input_ids"] for t in load_texts("sharegpt", args.ppl_samples)]
    rng = random.Random(0)
    prompt = [rng.randrange(100, reference.engine.config.vocab_size) for _ in range(32)]
    figures: dict[str, dict] = {name: {} for name in engines}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.llamacpp:
            path = make_gguf(Path(args.gguf), kind, Path(tmp))
            engines[f"llama.cpp {kind}"] = ("llamacpp", llama_cpp.Llama(
                model_path=str(path), n_ctx=max(args.window, 512), n_batch=args.window, logits_all=True,
                n_threads=torch.get_num_threads(), verbose=False))
            figures[f"llama.cpp {kind}"] = {"file_mb": path.stat().st_size / 2**20}  # after kiln's, in order
        for name, (kind, llm) in engines.items():
            if kind == "kiln":
                scores, totals = score_texts(llm, token_lists, args.window, args.stride, progress=False)
                ppl = summarize(scores, totals)["perplexity"]
            else:
                ppl = llamacpp_perplexity(llm, token_lists, args.window, args.stride)
            figures[name]["perplexity"] = ppl
            print(f"{name}: perplexity {ppl:.3f}", flush=True)
        runs: dict[str, list[float]] = {name: [] for name in engines}
        for name, (kind, llm) in engines.items():  # warm-up
            (stream_round if kind == "kiln" else llamacpp_round)(llm, prompt, 8)
        for _ in range(args.rounds):
            for name, (kind, llm) in engines.items():
                runs[name].append((stream_round if kind == "kiln" else llamacpp_round)(llm, prompt, args.new_tokens)[1])
    for name, tok_s in runs.items():
        figures[name]["decode_tok_s"] = statistics.median(tok_s)
    record = new_record("quality", gguf=Path(args.gguf).name, ppl_samples=args.ppl_samples, window=args.window,
                        stride=args.stride, tokens_scored=sum(len(ids) - 1 for ids in token_lists),
                        threads=torch.get_num_threads(), machine=machine_facts(), engines=figures,
                        command=" ".join(["python", "benchmarks/quality.py", *(argv or sys.argv[1:])]))
    print(format_quality(record))
    append_record(args.output_json, record)
    return 0


def format_quality(record: dict) -> str:
    engines = record["engines"]
    base = next(f["perplexity"] for name, f in engines.items() if name.startswith("kiln"))
    peer = next((f["perplexity"] for name, f in engines.items() if name.startswith("llama.cpp")), None)
    lines = [f"{record['tokens_scored']} tokens of {record['ppl_samples']} held-out ShareGPT replies, "
             f"window {record['window']}, stride {record['stride']}; decode after a 32-token prompt",
             f"  {'engine':20} {'perplexity':>10} {'ratio':>6} {'decode tok/s':>12}"]
    for name, f in engines.items():
        ratio = f["perplexity"] / (peer if name.startswith("llama.cpp") and peer else base)
        lines.append(f"  {name:20} {f['perplexity']:10.3f} {ratio:6.3f} {f['decode_tok_s']:12.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
