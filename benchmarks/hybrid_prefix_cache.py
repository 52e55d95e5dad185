"""Prefix caching on a hybrid model at a real size: a conversation's next turn with it and without.

    python benchmarks/hybrid_prefix_cache.py [--shape granite-4.0-h-micro] [--quant q4_0]
        [--prompt_tokens 2048] [--answer_tokens 32] [--message_tokens 64] [--rounds 2]

Turn 1 is a random prompt and its greedy answer; turn 2 is turn 1's prompt, its answer and a new
message. With ``enable_prefix_caching`` the second turn takes the cached blocks up to the last
full block of turn 1's answer and the recurrent states kept there
(``kiln.runtime.state_prefix_cache``), and prefills only the rest; without it, the whole
conversation again. Figures: time to turn 2's first token both ways, and turn 1's decode rate
both ways (what saving a state at each block boundary costs a decode). The engine is
``moe_scale.py``'s for the shape (run that first: it writes and builds it); each round a fresh
conversation (new random prompt) on the same two engines. Medians; appends a record (kind
"hybrid_prefix_cache") to ``--output_json``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.bench.common import append_record, new_record, stream_round
from kiln.bench.machine import machine_facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="granite-4.0-h-micro",
                   help="a hybrid moe_scale shape (default granite-4.0-h-micro)")
    p.add_argument("--quant", default="q4_0", help="its quantization, as moe_scale.py names it (default q4_0)")
    p.add_argument("--prompt_tokens", type=int, default=2048, help="turn 1's prompt (default 2048)")
    p.add_argument("--answer_tokens", type=int, default=32, help="turn 1's answer (default 32)")
    p.add_argument("--message_tokens", type=int, default=64, help="turn 2's new message (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="conversations; medians (default 2)")
    p.add_argument("--work_dir", default="/tmp/kiln-moe", help="moe_scale.py's work directory (reused)")
    p.add_argument("--output_json", default=str(Path(__file__).parent / "results.jsonl"),
                   help="append the record here (default benchmarks/results.jsonl)")
    args = p.parse_args(argv)
    engine = Path(args.work_dir) / f"{args.shape}-{args.quant}" / "engine"
    if not (engine / "config.json").is_file():
        p.error(f"no engine at {engine}: run python benchmarks/moe_scale.py --shape {args.shape} --quant "
                f"{args.quant} --work_dir {args.work_dir} first (it writes and builds it)")
    engines = {"cached": LLM(str(engine), enable_prefix_caching=True, progress=False),
               "plain": LLM(str(engine), progress=False)}
    vocab = engines["plain"].engine.config.vocab_size
    greedy = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    figures: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        rng = random.Random(round_)
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        message = [rng.randrange(100, vocab) for _ in range(args.message_tokens)]
        for name, llm in engines.items():
            _, decode = stream_round(llm, prompt, args.answer_tokens)  # (cached: a state kept at each boundary)
            answer = llm.generate([prompt], greedy)[0].outputs[0].token_ids
            ttft, _ = stream_round(llm, prompt + answer + message, 2)
            figures.setdefault(f"{name}_turn2_ttft_s", []).append(ttft)
            figures.setdefault(f"{name}_decode_tok_s", []).append(decode)
            print(f"round {round_}: {name}: turn 2's first token {ttft:.2f} s, turn 1 decode {decode:.2f} tok/s",
                  flush=True)
    medians = {key: round(statistics.median(values), 3) for key, values in figures.items()}
    record = new_record("hybrid_prefix_cache", shape=args.shape, quant=args.quant, random_weights=True,
                        threads=torch.get_num_threads(), prompt_tokens=args.prompt_tokens,
                        answer_tokens=args.answer_tokens, message_tokens=args.message_tokens, rounds=args.rounds,
                        machine=machine_facts(), **medians)
    record["command"] = " ".join(["python", "benchmarks/hybrid_prefix_cache.py",
                                  *(argv if argv is not None else sys.argv[1:])])
    print(f"{args.shape} {args.quant}, {record['threads']} threads: turn 2 ({args.prompt_tokens} + "
          f"{args.answer_tokens} + {args.message_tokens} tokens) first token {medians['cached_turn2_ttft_s']:.2f} s "
          f"with prefix caching, {medians['plain_turn2_ttft_s']:.2f} s without; decode "
          f"{medians['cached_decode_tok_s']:.2f} / {medians['plain_decode_tok_s']:.2f} tok/s")
    append_record(args.output_json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
