"""``kiln run``: generate text from a prompt with an engine (or anything LLM accepts)."""
from __future__ import annotations

import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text for a prompt",
                       description="Generate text for one prompt and print it, with decode speed. "
                                   "--engine_dir may also name a checkpoint, HF dir or GGUF file; "
                                   "those are converted and built into the engine cache first.")
    p.add_argument("--engine_dir", required=True, help="engine directory (or checkpoint / HF dir / GGUF file)")
    p.add_argument("--tokenizer_dir", help="tokenizer to use (default: the one stored in the engine)")
    p.add_argument("--input_text", required=True, help="the prompt (a user message with --chat)")
    p.add_argument("--max_output_len", type=int, default=64, help="most new tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (the default) is greedy decoding")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: no limit)")
    p.add_argument("--top_p", type=float, default=1.0, help="sample within this probability mass (1.0: no limit)")
    p.add_argument("--seed", type=int, help="random seed for sampling (default: random)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--streaming", action="store_true", help="print text as it is generated")
    p.add_argument("--cache_dir", help="engine cache for non-engine inputs (default ~/.cache/kiln)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from kiln.llm import LLM
    from kiln.runtime.sampling import SamplingParams
    from kiln.tokenizer import chat_prompt_ids

    params = SamplingParams(max_tokens=args.max_output_len, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    llm = LLM(args.engine_dir, tokenizer=args.tokenizer_dir, cache_dir=args.cache_dir)
    prompt = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": args.input_text}]) if args.chat \
        else llm._encode(args.input_text)
    started = time.perf_counter()
    first_token_at = None
    tokens: list[int] = []
    reason = None
    text_parts = []
    for delta in llm.stream(prompt, params):
        if first_token_at is None:
            first_token_at = time.perf_counter()
        tokens.extend(delta.token_ids)
        text_parts.append(delta.text)
        reason = delta.finish_reason
        if args.streaming:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    ended = time.perf_counter()
    if args.streaming:
        sys.stdout.write("\n")
    else:
        print("".join(text_parts))
    decode_s = ended - (first_token_at or ended)
    rate = (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else float("nan")
    print(f"[{len(prompt)} prompt tokens, {len(tokens)} generated, finish: {reason}; "
          f"first token {1000 * ((first_token_at or ended) - started):.0f} ms, decode {rate:.1f} tok/s; "
          f"engine load {llm.engine.load_seconds:.2f} s]", file=sys.stderr)
    return 0
