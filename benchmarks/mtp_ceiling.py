"""The ceiling of Qwen3.5's multi-token-prediction draft (``speculative_config={"method": "mtp"}``)
at a real size: batch-1 decode with every proposal kept, beside plain decode, one engine, one run.

    python benchmarks/mtp_ceiling.py [--shape qwen3.5-9b-mtp] [--k 1 2 3] [--new_tokens 64]

The model (``moe_scale.py``'s writer, Q4_0, random weights, with the MTP block llama.cpp's
converter keeps without ``--no-mtp``) proposes nothing a random target keeps, so each k runs with
the MTP layer doing all its work (its K/V for every row, k guesses through the LM head a step)
while its guesses are replaced by the plain answer's next tokens: the verification and drafting
cost of k proposals a step with every one kept, what a trained checkpoint gains at most. llama.cpp
decodes the same file plainly beside it (the same threads). Appends a record (kind
"mtp_ceiling") to ``--output_json``.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

import torch

import moe_scale  # benchmarks/ is on the path: scripts run from it
import scale
from kiln import LLM, SamplingParams
from kiln.bench.common import append_record, new_record, stream_round
from kiln.bench.machine import machine_facts
from kiln.runtime import mtp


def oracle(answer: list[int], prompt_len: int):
    """``MtpProposer.propose`` proposing the plain answer's next tokens instead of its guesses
    (which it still makes, at their full cost)."""
    def propose(self, wanted) -> None:
        for seq, k in wanted:
            self.drafts.pop(seq.seq_id, None)
            done = seq.num_tokens - prompt_len
            seq.spec_tokens = answer[done:done + k]
    return propose


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-9b-mtp", choices=[s for s in moe_scale.ALL_SHAPES if "mtp" in s],
                   help="a moe_scale shape with an MTP block (default qwen3.5-9b-mtp)")
    p.add_argument("--k", nargs="+", type=int, default=[1, 2, 3], help="proposals a step to measure (default 1 2 3)")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens a stream (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; medians (default 2)")
    p.add_argument("--work_dir", default="/tmp/kiln-moe", help="where the file and engine go (reused)")
    p.add_argument("--output_json", default=str(Path(__file__).parent / "results.jsonl"),
                   help="append the record here (default benchmarks/results.jsonl)")
    args = p.parse_args(argv)
    work = Path(args.work_dir) / f"{args.shape}-q4_0"
    work.mkdir(parents=True, exist_ok=True)
    gguf_path, engine = work / "model.gguf", str(work / "engine")
    if not gguf_path.is_file():
        print(f"writing {gguf_path}", flush=True)
        moe_scale.write_gguf(args.shape, "q4_0", gguf_path.with_suffix(".partial"))
        gguf_path.with_suffix(".partial").rename(gguf_path)
    if not (work / "engine" / "config.json").is_file():
        print("kiln convert + build", flush=True)
        kiln = str(Path(sys.executable).parent / "kiln")
        scale.timed_child([kiln, "convert", "--model_dir", str(gguf_path), "--output_dir", str(work / "ckpt")])
        scale.timed_child([kiln, "build", "--checkpoint_dir", str(work / "ckpt"), "--output_dir", engine,
                           "--max_batch_size", "4", "--max_seq_len", "1024"])
        shutil.rmtree(work / "ckpt")
    prompt = scale._prompts(0)[0]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    plain = LLM(engine, progress=False)
    answer = plain.generate([prompt], params)[0].outputs[0].token_ids
    figures: dict[str, list[float]] = {"plain": []}
    spec = {k: LLM(engine, speculative_config={"method": "mtp", "num_speculative_tokens": k}, progress=False)
            for k in args.k}
    mtp.MtpProposer.propose = oracle(answer, len(prompt))
    for _ in range(args.rounds):
        figures["plain"].append(stream_round(plain, prompt, args.new_tokens)[1])
        for k, llm in spec.items():
            figures.setdefault(f"mtp k={k}", []).append(stream_round(llm, prompt, args.new_tokens)[1])
    llama = scale.child("llamacpp", str(work / "model.gguf"), args.new_tokens)["decode_tok_s"]
    record = new_record("mtp_ceiling", shape=args.shape, quant="q4_0", random_weights=True,
                        threads=torch.get_num_threads(), new_tokens=args.new_tokens, rounds=args.rounds,
                        machine=machine_facts(), llamacpp_decode_tok_s=llama,
                        kiln_decode_tok_s={name: statistics.median(v) for name, v in figures.items()},
                        kept={k: llm.core.stats.spec.mean_accepted_length for k, llm in spec.items()})
    record["command"] = " ".join(["python", "benchmarks/mtp_ceiling.py", *(argv if argv is not None else sys.argv[1:])])
    base = record["kiln_decode_tok_s"]["plain"]
    print(f"{args.shape} q4_0, {record['threads']} threads: llama.cpp plain {llama:.2f} tok/s; kiln plain {base:.2f}")
    for name, value in record["kiln_decode_tok_s"].items():
        if name != "plain":
            k = int(name.rpartition("=")[2])
            print(f"  kiln {name}, every proposal kept ({record['kept'][k]:.2f} tokens a step): {value:.2f} tok/s, "
                  f"{value / base:.2f}x plain, {value / llama:.2f}x llama.cpp plain")
    append_record(args.output_json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
