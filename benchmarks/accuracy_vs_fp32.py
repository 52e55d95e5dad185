"""How far engines in lower precision (bf16, W8A16, W4A16) stray from the float32 engine's
greedy output, on real prompts.

Every engine decodes the same chat-templated ShareGPT prompts greedily (``--new_tokens``
each, end token ignored). Reported per engine against the float32 reference: the share of
prompts whose continuation is identical, the mean number of leading tokens that agree, and
the share of all positions that agree. With ``--hf_gguf`` the same figures for Hugging Face
transformers' own bf16 against its fp32, as the yardstick of what bf16 rounding alone does
to this model.

    python benchmarks/accuracy_vs_fp32.py --fp32_engine ENGINE_FP32 --engine bf16=ENGINE_BF16 \
        --engine w8a16=ENGINE_W8 [--num_prompts 64] [--hf_gguf GGUF]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(reference: list[list[int]], other: list[list[int]], new_tokens: int) -> dict:
    leading = [leading_agreement(a, b) for a, b in zip(reference, other)]
    same = sum(x == y for a, b in zip(reference, other) for x, y in zip(a, b))
    return {"identical_continuations": round(sum(n == new_tokens for n in leading) / len(leading), 3),
            "mean_leading_agreement_tokens": round(statistics.mean(leading), 1),
            "position_agreement": round(same / (len(leading) * new_tokens), 3)}


def hf_greedy(gguf: str, dtype: str, prompts: list[list[int]], new_tokens: int, batch: int = 16) -> list[list[int]]:
    from kiln.bench.peer import left_padded, load_hf_peer

    model, _ = load_hf_peer(dtype, gguf=gguf)
    out = []
    for i in range(0, len(prompts), batch):
        ids, mask = left_padded(prompts[i:i + batch])
        width = ids.shape[1]
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out.extend(gen[:, width:].tolist())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fp32_engine", required=True, help="the float32 engine (the reference)")
    p.add_argument("--engine", action="append", required=True, metavar="NAME=DIR",
                   help="an engine of the same model to compare (repeat for several)")
    p.add_argument("--num_prompts", type=int, default=64, help="ShareGPT first turns to use (default 64)")
    p.add_argument("--max_prompt_len", type=int, default=256, help="skip longer prompts (default 256)")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--hf_gguf", help="also compare HF transformers' bf16 with its fp32 on this GGUF")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kiln import LLM, SamplingParams
    from kiln.data.sharegpt import first_turns
    from kiln.tokenizer import chat_prompt_ids

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engines = [("fp32", args.fp32_engine)]
    for spec in args.engine:
        name, sep, path = spec.partition("=")
        if not sep:
            p.error(f"--engine {spec!r}: expected NAME=DIR")
        engines.append((name, path))
    outputs = {}
    prompts: list[list[int]] = []
    for name, engine in engines:
        llm = LLM(engine, progress=False)
        if not prompts:
            for prompt, _ in first_turns():
                ids = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": prompt}])
                if len(ids) <= args.max_prompt_len:
                    prompts.append(ids)
                if len(prompts) == args.num_prompts:
                    break
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=True)]
        del llm
    result = {"prompts": len(prompts), "new_tokens": args.new_tokens}
    for name, _ in engines[1:]:
        result[f"kiln {name} vs kiln fp32"] = agreement(outputs["fp32"], outputs[name], args.new_tokens)
    if args.hf_gguf:
        hf = {dtype: hf_greedy(args.hf_gguf, dtype, prompts, args.new_tokens) for dtype in ("float32", "bfloat16")}
        result["hf bf16 vs hf fp32"] = agreement(hf["float32"], hf["bfloat16"], args.new_tokens)
        result["kiln_fp32_vs_hf_fp32"] = agreement(hf["float32"], outputs["fp32"], args.new_tokens)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
