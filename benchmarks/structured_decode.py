"""What structured outputs cost in decode speed: the bundled model, constrained and free, alternating.

    python benchmarks/structured_decode.py [--engine ENGINE] [--rounds 3] [--output_json FILE]

Decode tok/s (output tokens over the time of the whole ``generate`` call, prefill included, the
same prompts for both) of requests held to a JSON Schema against the same requests unconstrained
(``ignore_eos``, so they run as long as ``max_tokens``), at batch 1 and with 16 requests at once,
rounds alternating; medians. The schema asks for an array of 24 short strings, so constrained
outputs run long too. The target (issue 24): constrained within 10% of free. The figures are
appended to benchmarks/results.jsonl (``kind: structured_decode``) for benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams, StructuredOutputsParams
from kiln.bench.common import append_record, new_record
from kiln.bench.machine import machine_facts
from kiln.examples import smollm2_gguf_path

SCHEMA = {"type": "object", "properties": {
    "words": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 24, "maxItems": 24}},
    "required": ["words"], "additionalProperties": False}
PROMPT = "List twenty-four English words as JSON:"


def tok_s(llm: LLM, batch: int, params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default=str(smollm2_gguf_path()), help="engine or source (default: the bundled GGUF)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians (default 3)")
    p.add_argument("--max_tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--output_json", default=str(Path(__file__).parent / "results.jsonl"),
                   help="append the record here (default benchmarks/results.jsonl)")
    args = p.parse_args(argv)
    llm = LLM(args.engine, max_batch_size=16, progress=False)
    held = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    tok_s(llm, 1, held), tok_s(llm, 1, free)  # warm-up: grammar tokenizer, kernels
    print(f"{args.engine}: decode tok/s, median of {args.rounds} alternating rounds")
    batches = {}
    for batch in (1, 16):
        figures = {"free": [], "json schema": []}
        for _ in range(args.rounds):
            figures["free"].append(tok_s(llm, batch, free))
            figures["json schema"].append(tok_s(llm, batch, held))
        free_s, held_s = (statistics.median(v) for v in figures.values())
        print(f"  batch {batch:2d}: free {free_s:7.1f}, json schema {held_s:7.1f} ({held_s / free_s:.2f}x)")
        batches[str(batch)] = {"free_tok_s": free_s, "json_schema_tok_s": held_s}
    append_record(args.output_json, new_record(
        "structured_decode", engine=Path(args.engine).name, max_tokens=args.max_tokens, rounds=args.rounds,
        threads=torch.get_num_threads(), machine=machine_facts(), batches=batches,
        command=" ".join(["python", "benchmarks/structured_decode.py", *(argv or sys.argv[1:])])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
