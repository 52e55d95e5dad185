"""``kiln run``: generate text from a prompt with an engine (or anything LLM accepts)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kiln.cli.world import add_world_flags, rank_zero
from kiln.engine_cache import resolve_engine
from kiln.errors import RequestError
from kiln.llm import LLM
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import chat_prompt_ids


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text for a prompt",
                       description="Generate text for one prompt and print it, with decode speed. "
                                   "--engine_dir may also name a checkpoint, HF dir or GGUF file; "
                                   "those are converted and built into the engine cache first.")
    p.add_argument("--engine_dir", required=True, help="engine directory (or checkpoint / HF dir / GGUF file)")
    p.add_argument("--tokenizer_dir", help="tokenizer to use (default: the one stored in the engine)")
    p.add_argument("--input_text", required=True, help="the prompt (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--streaming", action="store_true", help="print text as it is generated")
    p.add_argument("--cache_dir", help="engine cache for non-engine inputs (default ~/.cache/kiln)")
    g = p.add_argument_group("length")
    g.add_argument("--max_output_len", type=int, default=64, help="most new tokens to generate (default 64)")
    g.add_argument("--min_length", type=int, default=0, help="generate at least this many tokens (default 0)")
    g.add_argument("--ignore_eos", action="store_true", help="keep generating past the end-of-sequence token")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 (default) is greedy")
    g.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: no limit)")
    g.add_argument("--top_p", type=float, default=1.0, help="sample within this probability mass (1.0: no limit)")
    g.add_argument("--min_p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0: off)")
    g.add_argument("--top_p_decay", type=float, default=1.0, help="multiply top_p by this after each token (1: off)")
    g.add_argument("--top_p_min", type=float, default=1e-6, help="floor for the decayed top_p (default 1e-6)")
    g.add_argument("--top_p_reset_ids", type=int, nargs="*", default=[],
                   help="token ids that reset the decayed top_p to its start value")
    g.add_argument("--seed", type=int, help="random seed for sampling (default: random)")
    g = p.add_argument_group("penalties and biases")
    g.add_argument("--repetition_penalty", type=float, default=1.0,
                   help="divide (positive) / multiply (negative) logits of seen tokens by this (1: off)")
    g.add_argument("--presence_penalty", type=float, default=0.0, help="subtract from generated tokens' logits (-2..2)")
    g.add_argument("--frequency_penalty", type=float, default=0.0,
                   help="subtract this x count of each generated token (-2..2)")
    g.add_argument("--no_repeat_ngram_size", type=int, default=0, help="never repeat an n-gram of this size (0: off)")
    g.add_argument("--logit_bias", type=json.loads, default={},
                   help='JSON object of token id -> bias added to its logit, e.g. \'{"50256": -100}\'')
    g = p.add_argument_group("stop and bad words")
    g.add_argument("--stop", nargs="*", default=[], help="stop when any of these strings appears in the text")
    g.add_argument("--include_stop_str_in_output", action="store_true", help="keep the stop string in the text")
    g.add_argument("--stop_token_ids", type=int, nargs="*", default=[], help="token ids that end generation")
    g.add_argument("--bad_words", nargs="*", default=[], help="words never to generate")
    g = p.add_argument_group("beam search and several outputs")
    g.add_argument("--num_beams", type=int, default=1, help="beam search with this width (1: off)")
    g.add_argument("--length_penalty", type=float, default=1.0, help="beam score = logprob / length^this (default 1)")
    g.add_argument("--early_stopping", choices=["true", "false", "never"], default="false",
                   help="beam search stop rule, as in Hugging Face (default false)")
    g.add_argument("--beam_search_diversity_rate", type=float, default=0.0,
                   help="penalise a beam's k-th best continuation by k x this (default 0)")
    g.add_argument("--num_return_sequences", type=int, default=1, help="outputs to print (<= beams or samples)")
    g.add_argument("--best_of", type=int, help="sample this many and print the num_return_sequences most likely")
    g.add_argument("--logprobs", type=int, help="also print the top-k log-probs of each generated token")
    add_world_flags(p)
    p.set_defaults(handler=run)


def sampling_params(args):
    beams = args.num_beams > 1
    return SamplingParams(
        max_tokens=args.max_output_len, min_tokens=args.min_length, ignore_eos=args.ignore_eos,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        top_p_decay=args.top_p_decay, top_p_min=args.top_p_min, top_p_reset_ids=args.top_p_reset_ids, seed=args.seed,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
        logit_bias={int(k): v for k, v in args.logit_bias.items()} if isinstance(args.logit_bias, dict)
        else args.logit_bias,
        stop=args.stop, include_stop_str_in_output=args.include_stop_str_in_output,
        stop_token_ids=args.stop_token_ids, bad_words=args.bad_words, n=args.num_return_sequences,
        best_of=args.num_beams if beams else args.best_of, use_beam_search=beams,
        length_penalty=args.length_penalty,
        early_stopping={"true": True, "false": False}.get(args.early_stopping, args.early_stopping),
        beam_search_diversity_rate=args.beam_search_diversity_rate, logprobs=args.logprobs)


def run(args) -> int:
    try:
        params = sampling_params(args)
    except (ValueError, AttributeError) as e:
        raise RequestError(f"--logit_bias: {e}") from None
    engine_dir = engine_dir_for(args)
    with rank_zero(engine_dir, args.tp_size, args.pp_size):
        llm = LLM(engine_dir, tokenizer=args.tokenizer_dir)
        try:
            return _generate(args, llm, params)
        finally:
            llm.close()


def _generate(args, llm, params) -> int:
    prompt = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": args.input_text}]) if args.chat \
        else llm._encode(args.input_text)
    if params.use_beam_search or params.num_samples > 1 or params.logprobs is not None:
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
    return resolve_engine(args.engine_dir, cache_dir=args.cache_dir, tp_size=args.tp_size, pp_size=args.pp_size)
