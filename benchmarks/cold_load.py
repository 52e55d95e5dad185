"""Load to first token from a cold and a warm page cache, kiln beside llama.cpp, bf16 weights.

    python benchmarks/cold_load.py --shape llama-3.2-3b [--work_dir /tmp/kiln-cold-load] [--rounds 3]

The scale benchmark's rounds cycle through eight engines whose files together may outgrow the
page cache, so whether a load finds its file cached depends on the order. Here it is set: each
round, per engine, the kernel's page cache is dropped (``/proc/sys/vm/drop_caches``, as root)
and a fresh process loads the engine and makes one token (cold), then a second process does the
same again (warm). The models are the scale benchmark's (random weights of the real shape,
SmolLM2's tokenizer): a kiln bf16 engine and a bf16 GGUF of the same numbers. Prints medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import scale  # benchmarks/ is on the path: scripts run from it
from kiln.bench.machine import machine_facts

_KILN = """
import time
from kiln.llm import LLM
from kiln.runtime.sampling_params import SamplingParams
started = time.perf_counter()
llm = LLM({path!r}, progress=False)
llm.generate([{prompt}], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
print(time.perf_counter() - started)
"""
_LLAMACPP = """
import time
import llama_cpp
started = time.perf_counter()
llm = llama_cpp.Llama(model_path={path!r}, n_ctx=1024, n_threads={threads}, verbose=False)
next(iter(llm.generate({prompt}, temp=0.0, top_k=1, reset=True)))
print(time.perf_counter() - started)
"""


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"cannot drop the page cache ({e}): run as root on Linux") from None


def load_seconds(code: str) -> float:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(scale.SHAPES), required=True, help="model shape to write and load")
    p.add_argument("--work_dir", default="/tmp/kiln-cold-load", help="where the models and the engine go (reused)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians (default 3)")
    args = p.parse_args(argv)
    work = Path(args.work_dir) / args.shape
    hf, gguf, engine = work / "hf", work / "model-bf16.gguf", work / "engine-bf16"
    kiln = [str(Path(sys.executable).parent / "kiln")]
    if not (engine / "config.json").is_file():
        if not (hf / "config.json").is_file():
            scale.write_hf(args.shape, hf)
        scale.timed_child([*kiln, "convert", "--model_dir", str(hf), "--output_dir", str(work / "ckpt"), "--dtype",
                           "bfloat16"])
        scale.timed_child([*kiln, "build", "--checkpoint_dir", str(work / "ckpt"), "--output_dir", str(engine)])
        subprocess.run(["rm", "-rf", str(work / "ckpt")], check=True)
    if not gguf.is_file():
        scale.write_gguf(args.shape, hf, gguf)
    prompt = scale._prompts(0)[0]
    codes = {"kiln bf16": _KILN.format(path=str(engine), prompt=prompt),
             "llama.cpp bf16": _LLAMACPP.format(path=str(gguf), prompt=prompt, threads=torch.get_num_threads())}
    seconds: dict[str, dict[str, list[float]]] = {name: {"cold": [], "warm": []} for name in codes}
    for r in range(args.rounds):
        for name, code in codes.items():
            drop_page_cache()
            seconds[name]["cold"].append(load_seconds(code))
            seconds[name]["warm"].append(load_seconds(code))
            print(f"round {r + 1}: {name}: cold {seconds[name]['cold'][-1]:.2f} s, warm "
                  f"{seconds[name]['warm'][-1]:.2f} s", flush=True)
    machine = machine_facts()
    print(f"{args.shape} bf16, load to first token (after the imports, as the scale benchmark times it), median of {args.rounds}; "
          f"{machine.get('cpu')}")
    for name, by_cache in seconds.items():
        print(f"  {name:16s} cold {statistics.median(by_cache['cold']):6.2f} s   warm "
              f"{statistics.median(by_cache['warm']):6.2f} s")
    print(json.dumps({name: {k: statistics.median(v) for k, v in d.items()} for name, d in seconds.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
