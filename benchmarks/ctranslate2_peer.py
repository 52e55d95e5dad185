"""Decode speed of CTranslate2 beside kiln, same model, prompts and run.

CTranslate2 is an optional benchmark dependency (``pip install ctranslate2``; its CPU wheel
computes in float32, int8 or int16, not bf16). The model reaches it the way its users convert
one: Hugging Face transformers loads the GGUF (dequantized to float32), its weights are saved
as a Hugging Face directory, which ``ctranslate2.converters.TransformersConverter`` turns into a CTranslate2 model per
``--compute_types`` entry. Each round of each engine runs in a fresh process (two OpenMP
runtimes in one process spin against each other). Figures, rounds alternating engines, medians:

* batch-1 decode tok/s: ``--prompt_len`` random tokens, ``--new_tokens`` greedy tokens (the
  end token never stops it), tokens after the first over the time after the first;
* output tok/s of ``--batch`` such prompts generated together (CTranslate2's
  ``generate_batch``, kiln's ``LLM.generate``).

    python benchmarks/ctranslate2_peer.py --engine_dir ENGINE --gguf SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.bench.common import stream_round


def convert_for_ctranslate2(gguf: Path, out_dir: Path, compute_type: str) -> Path:
    import ctranslate2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = out_dir / "hf"
    if not hf_dir.exists():
        from safetensors.torch import save_file

        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model; its weights are plain float32 by now.
        hf_dir.mkdir(parents=True)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(hf_dir)
        weights = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        save_file(weights, str(hf_dir / "model.safetensors"))
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(hf_dir)
    target = out_dir / f"ct2-{compute_type}"
    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(target), quantization=compute_type,
                                                                      force=True)
    return target


def ct2_batch1(generator, tokens: list[str], new_tokens: int) -> tuple[float, float]:
    started = time.perf_counter()
    first = None
    count = 0
    for _ in generator.generate_tokens(tokens, max_length=new_tokens, sampling_topk=1, end_token=[]):
        count += 1
        if first is None:
            first = time.perf_counter()
    return first - started, (count - 1) / (time.perf_counter() - first)


def ct2_batch(generator, prompts: list[list[str]], new_tokens: int) -> float:
    started = time.perf_counter()
    results = generator.generate_batch(prompts, max_length=new_tokens, sampling_topk=1, end_token=[],
                                       include_prompt_in_result=False)
    produced = sum(len(r.sequences_ids[0]) for r in results)
    return produced / (time.perf_counter() - started)


def kiln_batch(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def run_worker(kind: str, path: str, args) -> dict:
    """One round of one engine, in this (fresh) process: batch-1 then batched."""
    rng = random.Random(0)
    if kind == "kiln":
        from kiln import LLM

        llm = LLM(path, progress=False)
        vocab = llm.engine.config.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        stream_round(llm, prompts[0], 8)  # warm-up
        first, tps1 = stream_round(llm, prompts[0], args.new_tokens)
        return {"batch1": tps1, "ttft": first, "batch": kiln_batch(llm, prompts, args.new_tokens)}
    import ctranslate2

    compute_type = Path(path).name.removeprefix("ct2-")
    generator = ctranslate2.Generator(path, device="cpu", compute_type=compute_type, intra_threads=args.threads,
                                      inter_threads=1)
    vocab = args.vocab_size
    prompts = [[str(rng.randrange(100, vocab)) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    ct2_batch1(generator, prompts[0], 8)
    first, tps1 = ct2_batch1(generator, prompts[0], args.new_tokens)
    return {"batch1": tps1, "ttft": first, "batch": ct2_batch(generator, prompts, args.new_tokens)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine_dir", required=True, help="kiln engine of the same model")
    p.add_argument("--gguf", required=True, help="the GGUF file both start from")
    p.add_argument("--compute_types", nargs="+", default=["float32", "int8"],
                   help="CTranslate2 compute types to measure (default: float32 int8)")
    p.add_argument("--prompt_len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new_tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    p.add_argument("--batch", type=int, default=32, help="prompts generated together (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians (default 3)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for every engine")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--vocab_size", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(run_worker(*args.worker, args)))
        return 0

    # Each round of each engine runs in its own process: two OpenMP runtimes in one process
    # spin-wait against each other on two cores and halve both engines' speed.
    from kiln.checkpoint.format import read_config

    config = read_config(args.engine_dir)
    kiln_name = f"kiln {config.quantization.quant_algo or config.dtype}"
    common = ["--prompt_len", str(args.prompt_len), "--new_tokens", str(args.new_tokens), "--batch",
              str(args.batch), "--threads", str(args.threads), "--vocab_size", str(config.vocab_size)]
    with tempfile.TemporaryDirectory() as tmp:
        engines = [(kiln_name, "kiln", args.engine_dir)] + [
            (f"ctranslate2 {t}", "ct2", str(convert_for_ctranslate2(Path(args.gguf), Path(tmp), t)))
            for t in args.compute_types]
        results = {name: [] for name, _, _ in engines}
        for _ in range(args.rounds):
            for name, kind, path in engines:
                out = subprocess.run([sys.executable, __file__, "--engine_dir", args.engine_dir, "--gguf", args.gguf,
                                      "--worker", kind, path, *common], capture_output=True, text=True, check=True)
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.rounds}, each round of each engine in its own process:")
    base1 = statistics.median(r["batch1"] for r in results[kiln_name])
    base = statistics.median(r["batch"] for r in results[kiln_name])
    for name, runs in results.items():
        tps1 = statistics.median(r["batch1"] for r in runs)
        tps = statistics.median(r["batch"] for r in runs)
        print(f"  {name:22} batch-1 {tps1:7.1f} tok/s (kiln / this {base1 / tps1:.2f}x)   "
              f"{args.batch} prompts {tps:7.1f} out tok/s (kiln / this {base / tps:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
