"""``kiln run``: generate text from a prompt with an engine (or anything LLM accepts)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from kiln.cli.sampling_flags import add_sampling_flags, sampling_params_from
from kiln.cli.world import add_world_flags, rank_zero
from kiln.config.engine_args import EngineArgs
from kiln.engine_cache import engine_for
from kiln.llm import LLM
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import chat_prompt_ids


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text for a prompt",
                       description="Generate text for one prompt and print it, with decode speed. "
                                   "--engine_dir may also name a checkpoint, HF dir or GGUF file; "
                                   "those are converted and built into the engine cache first.")
    p.add_argument("--engine_dir", required=True, help="engine directory (or checkpoint / HF dir / GGUF file)")
    p.add_argument("--input_text", required=True, help="the prompt (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--streaming", action="store_true", help="print text as it is generated")
    EngineArgs.add_cli_args(p, "run")
    groups = add_sampling_flags(p, defaults={"max_tokens": 64, "temperature": 0.0})
    groups["several outputs"].add_argument(
        "--num_beams", type=int, default=1, help="beam search of this width: --use_beam_search --best_of N (1: off)")
    add_world_flags(p)
    p.set_defaults(handler=run)


def sampling_params(args) -> SamplingParams:
    """The request the flags describe; --num_beams N is beam search of width N."""
    if args.num_beams > 1:
        return sampling_params_from(args, use_beam_search=True, best_of=args.num_beams)
    return sampling_params_from(args)


def run(args) -> int:
    params = sampling_params(args)
    engine_dir = engine_dir_for(args)
    with rank_zero(engine_dir, args.tp_size, args.pp_size):
        llm = LLM(EngineArgs.from_cli_args(args).for_engine(engine_dir))
        try:
            return _generate(args, llm, params)
        finally:
            llm.close()


def _generate(args, llm, params) -> int:
    prompt = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": args.input_text}]) if args.chat \
        else llm._encode(args.input_text)
    if params.use_beam_search or params.num_samples > 1 or params.logprobs is not None \
            or params.prompt_logprobs is not None:
        return _run_many(llm, prompt, params)  # the streamed path prints no log-probs
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


def _run_many(llm, prompt: list[int], params) -> int:
    started = time.perf_counter()
    (result,) = llm.generate([prompt], params)
    if result.prompt_logprobs:
        print("--- prompt log-probs")
        for token, entry in zip(prompt, result.prompt_logprobs):
            print(f"    {token}: {'-' if entry is None else f'{entry[token]:.4f}  top {entry}'}")
    for out in result.outputs:
        score = f", cumulative logprob {out.cumulative_logprob:.3f}" if out.cumulative_logprob is not None else ""
        print(f"--- output {out.index} (finish: {out.finish_reason}{score})")
        print(out.text)
        if out.logprobs:
            for token, entry in zip(out.token_ids, out.logprobs):
                print(f"    {token}: {entry[token]:.4f}  top {entry}")
    print(f"[{len(prompt)} prompt tokens, {len(result.outputs)} outputs in {time.perf_counter() - started:.2f} s]",
          file=sys.stderr)
    return 0


def engine_dir_for(args) -> Path:
    """The engine ``--engine_dir`` names, built into the cache from any other source exactly as
    ``LLM(source)`` and ``kiln serve source`` build it."""
    return engine_for(EngineArgs.from_cli_args(args, model=args.engine_dir), tp_size=args.tp_size,
                      pp_size=args.pp_size)
