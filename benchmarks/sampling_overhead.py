"""Per-step sampling overhead: ``process_logits`` + ``sample`` on a step's logits, no model.

Both configurations are measured in the same run, in alternating rounds, so machine noise
hits them alike:

(a) greedy, no controls (``temperature=0``);
(b) every control on: temperature 0.8, top_k 50, top_p 0.9, min_p 0.05, top_p_decay 0.9,
    repetition 1.1, presence 0.3, frequency 0.3, no_repeat_ngram_size 3, three bad words
    (one single-token, two multi-token), logit_bias with 5 entries, min_tokens 5, logprobs 5.

At batch 1, 8 and 64, vocab 49152 (SmolLM2's), each sequence holding ~300 tokens (290 prompt
+ 3 generated, so the min_tokens ban is active). The sequences do not grow between runs: the
token history is synced once in warm-up, so the timing is the steady per-step cost (a real
step additionally copies its one new token into the history). The logits are cloned outside
the timed region. Median of ``--runs`` timed runs after ``--warmup`` runs, 2 threads.

    python benchmarks/sampling_overhead.py [--runs 25] [--output_json FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.runtime.logits_processors import TokenHistory, process_logits  # noqa: E402
from kiln.runtime.sampling import sample  # noqa: E402
from kiln.runtime.sampling_params import SamplingParams  # noqa: E402
from kiln.runtime.sequence import Sequence  # noqa: E402

VOCAB = 49152
PROMPT_LEN, OUTPUT_LEN = 290, 3
MAX_SEQ_LEN = 2048
END_ID = 2


def make_params(config: str, seed: int) -> SamplingParams:
    if config == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=256)
    return SamplingParams(
        max_tokens=256, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, top_p_decay=0.9, top_p_min=0.1,
        repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3, no_repeat_ngram_size=3,
        bad_words_ids=[[1234], [500, 600], [700, 800, 900]],
        logit_bias={10: 1.0, 20: -1.0, 30: 2.5, 40: -5.0, 50: 0.5}, min_tokens=5, logprobs=5, seed=seed)


def make_batch(config: str, batch: int, rng: random.Random) -> list[Sequence]:
    seqs = []
    for i in range(batch):
        # Tokens from a 2000-id alphabet so penalties and n-grams find repeats, as in text.
        tokens = [rng.randrange(2000) + 100 for _ in range(PROMPT_LEN + OUTPUT_LEN)]
        seq = Sequence(i, tokens, make_params(config, seed=i), END_ID, MAX_SEQ_LEN)
        seq.num_prompt_tokens = PROMPT_LEN
        seq.current_top_p = 0.9 * 0.9 ** OUTPUT_LEN  # as decayed after OUTPUT_LEN tokens
        seqs.append(seq)
    return seqs


def one_step(logits: torch.Tensor, seqs: list[Sequence], history: TokenHistory) -> float:
    work = logits.clone()
    start = time.perf_counter()
    sample(process_logits(work, seqs, history), seqs)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--runs", type=int, default=25, help="timed runs per (config, batch), >= 20")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output_json", type=Path)
    args = ap.parse_args()
    if args.runs < 20:
        ap.error("--runs must be >= 20")
    torch.set_num_threads(args.threads)
    configs = ["greedy", "all_controls"]
    rng = random.Random(0)
    results = []
    total = len(args.batch_sizes) * (args.warmup + args.runs) * len(configs)
    with tqdm(total=total, desc="sampling overhead", unit="step") as bar:
        for batch in args.batch_sizes:
            logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
            setups = {c: (make_batch(c, batch, rng), TokenHistory(MAX_SEQ_LEN)) for c in configs}
            times = {c: [] for c in configs}
            for r in range(args.warmup + args.runs):
                for c in (configs if r % 2 == 0 else configs[::-1]):  # alternate which goes first
                    t = one_step(logits, *setups[c])
                    if r >= args.warmup:
                        times[c].append(t)
                    bar.update(1)
            for c in configs:
                ms = statistics.median(times[c]) * 1e3
                results.append({"config": c, "batch": batch, "vocab": VOCAB,
                                "history_tokens": PROMPT_LEN + OUTPUT_LEN, "runs": args.runs,
                                "median_ms_per_step": ms, "median_ms_per_seq": ms / batch})
    print(f"\nprocess_logits + sample, vocab {VOCAB}, {PROMPT_LEN + OUTPUT_LEN}-token histories, "
          f"{args.threads} threads, median of {args.runs} runs\n")
    print("| config | batch | ms / step | ms / sequence |")
    print("|---|---:|---:|---:|")
    for row in results:
        print(f"| {row['config']} | {row['batch']} | {row['median_ms_per_step']:.3f} | "
              f"{row['median_ms_per_seq']:.3f} |")
    if args.output_json:
        args.output_json.write_text(json.dumps({"threads": args.threads, "results": results}, indent=2))
        print(f"\nwrote {args.output_json}")


if __name__ == "__main__":
    main()
