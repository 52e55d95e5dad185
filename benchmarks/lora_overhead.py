"""Decode speed with LoRA adapters against the same engine without, in one run.

For each batch size: random prompts of ``--prompt_len`` tokens generate ``--new_tokens``
greedy tokens each, all together, (a) with no adapter, (b) every sequence with one adapter,
(c) sequences spread over ``--adapters`` adapters (round robin). Adapters are random, rank
``--rank``, on every attention and MLP projection of every layer (q, k, v, dense, gate, up,
down), applied by the runtime as a request's ``LoraAdapter``. Rounds alternate the cases;
medians; decode tok/s and the ratio to (a).

Decode steps run the adapters inside the native decode step where the model takes it.
``--layer_path`` makes every step take the layers' Python path instead (what prompt steps and
other models run), where ``--gathered`` adds (d): the mixed case with the other way to batch
LoRA (Punica's, S-LoRA's): every row gathers its adapter's ``A`` and ``B`` (padded to one rank
and the linear's width) and one pair of ``bmm`` serves all rows, instead of the runtime's
grouping of rows by adapter.

    python benchmarks/lora_overhead.py ENGINE_DIR [--batches 1 8 32] [--rank 8] [--adapters 3] [--rounds 3]
                                      [--layer_path [--gathered]]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

MODULES = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h")


def random_adapter(config, rank: int, seed: int):
    from kiln.bench.common import random_lora_modules
    from kiln.layers.lora import LoraAdapter

    return LoraAdapter(random_lora_modules(config, rank, MODULES, seed))


class GatheredLoraStep:
    """LoRA for a step by per-row gather and bmm (the alternative ``--gathered`` measures)."""

    _stacks: dict = {}  # (targets, adapter keys) -> (A [n, R, in], B [n, out, R], start, stop)

    def __init__(self, groups):
        self.groups = groups
        self.rows = torch.cat([rows for _, rows in groups])
        self.slots = torch.cat([torch.full((len(rows),), i) for i, (_, rows) in enumerate(groups)])

    def _stack(self, targets):
        key = (targets, tuple(adapter.key for adapter, _ in self.groups))
        if key not in self._stacks:
            fused = [adapter.fused(targets) for adapter, _ in self.groups]
            start, stop = min(f.start for f in fused), max(f.stop for f in fused)
            rank = max(f.a.shape[0] for f in fused)
            a = torch.zeros(len(fused), rank, fused[0].a.shape[1])
            b = torch.zeros(len(fused), stop - start, rank)
            for i, f in enumerate(fused):
                a[i, :f.a.shape[0]] = f.a
                b[i, f.start - start:f.stop - start, :f.b.shape[1]] = f.b
            self._stacks[key] = (a, b, start, stop)
        return self._stacks[key]

    def apply(self, targets, x, y, bias=None):
        a, b, start, stop = self._stack(targets)
        x = x.reshape(-1, x.shape[-1])
        inputs = x.index_select(0, self.rows).float().unsqueeze(-1)  # [T, in, 1]
        delta = torch.bmm(b.index_select(0, self.slots), torch.bmm(a.index_select(0, self.slots), inputs))
        y[:, start:stop].index_add_(0, self.rows, delta.squeeze(-1).to(y.dtype))
        return y


def decode_tok_s(core, prompts: list[list[int]], adapters: list, new_tokens: int) -> float:
    """Decode tok/s of the steps after every prompt's first token."""
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    requests = [core.add_request(p, params, None, lora=a) for p, a in zip(prompts, adapters)]
    core.step()  # the prompts (every one fits in the first step)
    started = time.perf_counter()
    while core.has_unfinished:
        core.step()
    elapsed = time.perf_counter() - started
    assert all(len(r.seqs[0].output_token_ids) == new_tokens for r in requests)
    return len(prompts) * (new_tokens - 1) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine_dir", help="a kiln engine (LoRA needs nothing from the build yet)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="sequences decoding together")
    p.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    p.add_argument("--adapters", type=int, default=3, help="adapters in the mixed case (default 3)")
    p.add_argument("--prompt_len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens per sequence (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds alternating the cases; medians (default 3)")
    p.add_argument("--layer_path", action="store_true",
                   help="run every step layer by layer in Python (no native decode step)")
    p.add_argument("--gathered", action="store_true",
                   help="with --layer_path: also run the mixed case with per-row gathered A/B and bmm instead of rows "
                        "grouped by adapter")
    args = p.parse_args()
    if args.gathered and not args.layer_path:
        p.error("--gathered compares the layers' Python path: add --layer_path")

    from kiln.bench.common import random_prompts
    from kiln.runtime.engine import Engine
    from kiln.runtime import model_runner
    from kiln.runtime.engine_core import EngineCore

    grouped = model_runner.LoraStep
    if args.layer_path:
        import kiln.models.base as base

        base.native_decode_for = lambda *a: None

    engine = Engine(args.engine_dir)
    adapters = [random_adapter(engine.config, args.rank, seed) for seed in range(args.adapters)]
    print(f"{engine.config.architecture} {engine.config.dtype}, rank {args.rank} on {len(MODULES)} modules x "
          f"{engine.config.num_hidden_layers} layers, {args.prompt_len}-token prompts, {args.new_tokens} tokens, "
          f"{torch.get_num_threads()} threads{', layer by layer' if args.layer_path else ''}; decode tok/s, medians of "
          f"{args.rounds}")
    gathered = " gathered bmm | vs none |" if args.gathered else ""
    print("| batch | no adapter | one adapter | vs none | "
          f"{args.adapters} adapters mixed | vs none |{gathered}\n|---:|---:|---:|---:|---:|---:|"
          + "---:|---:|" * args.gathered)
    for batch in args.batches:
        core = EngineCore(engine, max_num_seqs=batch, max_num_tokens=max(batch * args.prompt_len, 256))
        cases = {"none": [None] * batch, "one": [adapters[0]] * batch,
                 "mixed": [adapters[i % len(adapters)] for i in range(batch)]}
        decode_tok_s(core, random_prompts(batch, args.prompt_len, engine.config.vocab_size, 99), cases["none"], 4)
        if args.gathered:
            cases["gathered"] = cases["mixed"]
        runs = {name: [] for name in cases}
        for r in tqdm(range(args.rounds), desc=f"batch {batch}", leave=False):
            prompts = random_prompts(batch, args.prompt_len, engine.config.vocab_size, r)
            for name, assigned in cases.items():
                model_runner.LoraStep = GatheredLoraStep if name == "gathered" else grouped
                runs[name].append(decode_tok_s(core, prompts, assigned, args.new_tokens))
        model_runner.LoraStep = grouped
        med = {name: statistics.median(v) for name, v in runs.items()}
        extra = f" {med['gathered']:.1f} | {med['gathered'] / med['none']:.2f}x |" if args.gathered else ""
        print(f"| {batch} | {med['none']:.1f} | {med['one']:.1f} | {med['one'] / med['none']:.2f}x | "
              f"{med['mixed']:.1f} | {med['mixed'] / med['none']:.2f}x |{extra}", flush=True)


if __name__ == "__main__":
    main()
