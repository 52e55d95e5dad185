"""Calibration time: one prompt per step against several prompts packed per step.

Runs the float model over the same calibration texts with the hooks AWQ uses
(``collect_linear_inputs`` on every quantizable linear), alternating the two packings
``--rounds`` times so both see the same load on a shared machine, and checks that the
statistics agree. Prints one JSON object (wall and process-CPU seconds of each round).

    python benchmarks/calibration_packing.py [--gguf FILE] [--calib_size 32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from kiln.checkpoint.sources import open_source
    from kiln.config import QuantConfig
    from kiln.examples import smollm2_gguf_path
    from kiln.models import get_model_class
    from kiln.quantization.calibration import (DEFAULT_STEP_TOKENS, calibration_texts, calibration_token_ids,
                                               collect_linear_inputs)
    from kiln.quantization.weight_only import quantizable_modules
    from kiln.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="model (default: the bundled SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--calib_size", type=int, default=32, help="ShareGPT calibration texts (default 32)")
    p.add_argument("--calib_max_len", type=int, default=512, help="tokens kept of each text (default 512)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of both packings (default 2)")
    args = p.parse_args(argv)

    torch.set_num_threads(2)
    source = open_source(args.gguf or smollm2_gguf_path())
    model = get_model_class(source.hf_config()["architectures"][0]).from_hugging_face(source, "float32")
    with tempfile.TemporaryDirectory() as tmp:
        source.save_tokenizer(Path(tmp))
        tokens = calibration_token_ids(load_tokenizer(tmp), calibration_texts("sharegpt", args.calib_size),
                                       args.calib_max_len)
    names = [n for n, _ in quantizable_modules(model, QuantConfig(quant_algo="W4A16_AWQ"))[0]]
    packings = {"one_prompt_per_step": 1, f"packed_{DEFAULT_STEP_TOKENS}_tokens": DEFAULT_STEP_TOKENS}
    times: dict[str, list[dict]] = {k: [] for k in packings}
    stats = {}
    for _ in range(args.rounds):
        for label, budget in packings.items():
            wall, cpu = time.perf_counter(), time.process_time()
            stats[label] = collect_linear_inputs(model, tokens, names, max_step_tokens=budget)
            times[label].append({"wall_s": round(time.perf_counter() - wall, 1),
                                 "cpu_s": round(time.process_time() - cpu, 1)})
    a, b = stats.values()
    max_rel = max(((a[n].abs_mean - b[n].abs_mean).abs().max() / a[n].abs_mean.abs().max()).item() for n in names)
    print(json.dumps({"calib_texts": len(tokens), "tokens": sum(map(len, tokens)), "linears": len(names),
                      "times": times, "max_relative_abs_mean_difference": max_rel}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
