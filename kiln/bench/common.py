"""Pieces shared by the benchmarks: prompts, a forward-pass timer, weight bytes, records."""
from __future__ import annotations

import datetime
import json
import random
import subprocess
import time
from pathlib import Path

import torch

from kiln.checkpoint.lora import LORA_MODULE_IDS, LoraModule
from kiln.layers.expert_linear import ExpertLinear
from kiln.layers.linear import Linear
from kiln.layers.moe import MixtureOfExperts
from kiln.models.lora_targets import lora_module_shapes
from kiln.runtime.sampling_params import SamplingParams


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (ids below 100 avoided: special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


class ForwardTimer:
    """Times every forward pass of a module (hooks, so the model code is untouched) and every
    call of its ``decode_logits``: a decode step the native step runs whole, layers to logits,
    goes there instead of through ``forward``."""

    def __init__(self, module: torch.nn.Module):
        self.durations: list[float] = []
        self.ends: list[float] = []
        self._started = 0.0
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]
        self._module = module
        self._wrapped = "decode_logits" in dir(module)
        if self._wrapped:
            decode_logits = module.decode_logits

            def timed(*args, **kwargs):
                self._pre(module, args)
                logits = decode_logits(*args, **kwargs)
                if logits is not None:  # None: nothing ran, forward (timed by the hooks) follows
                    self._post(module, args, logits)
                return logits

            module.decode_logits = timed

    def _pre(self, module, args):
        self._started = time.perf_counter()

    def _post(self, module, args, output):
        now = time.perf_counter()
        self.durations.append(now - self._started)
        self.ends.append(now)

    def reset(self) -> None:
        self.durations.clear()
        self.ends.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._wrapped:
            del self._module.decode_logits  # back to the class's method


class CollectTimer:
    """Times when each step's results reach rank 0 (``ModelRunner.collect``): in a pipeline the
    model forward rank 0 runs is only the first stage's."""

    def __init__(self, runner):
        self.ends: list[float] = []
        self._runner = runner
        collect = runner.collect

        def timed():
            result = collect()
            self.ends.append(time.perf_counter())
            return result

        runner.collect = timed

    def reset(self) -> None:
        self.ends.clear()

    def remove(self) -> None:
        del self._runner.collect  # back to the class's method


def stream_round(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """Time to first token and decode tok/s (tokens after the first) of one greedy stream of
    ``new_tokens`` tokens, the end token ignored."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    first = None
    for _ in llm.stream(prompt, params):
        if first is None:
            first = time.perf_counter()
    return first - started, (new_tokens - 1) / (time.perf_counter() - first)


def decoder_linears(model: torch.nn.Module) -> list:
    """The linear layers of a model's decoder stack (the LM head excluded) and their FLOPs per
    token (2 per weight)."""
    linears = [m for m in model.transformer.layers.modules() if isinstance(m, Linear)]
    return linears, 2 * sum(m.in_features * m.out_features for m in linears)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter once, except an untied
    input embedding (a lookup reads one row) and, in a mixture of experts, the experts a token
    is not routed to (``top_k`` of ``num_experts`` are read)."""
    seen, total = set(), 0
    embedding = getattr(getattr(model, "transformer", None), "vocab_embedding", None)
    lm_head = getattr(model, "lm_head", None)
    skip = None
    if embedding is not None and lm_head is not None and embedding.weight.data_ptr() != lm_head.weight.data_ptr():
        skip = embedding.weight.data_ptr()
    read_fraction = {}  # an expert tensor's parameter -> the share of it one token reads
    for block in model.modules():
        if isinstance(block, MixtureOfExperts):
            for module in block.modules():
                if isinstance(module, ExpertLinear):  # codes, scales, offsets, biases alike
                    for param in module.parameters(recurse=False):
                        read_fraction[id(param)] = block.top_k / block.num_experts
    for p in model.parameters():
        if p.data_ptr() in seen or p.data_ptr() == skip:
            continue
        seen.add(p.data_ptr())
        total += int(p.numel() * p.element_size() * read_fraction.get(id(p), 1.0))
    return total


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def precision(record: dict) -> str:
    """A record's compute dtype, and its weights' format when that differs (a quantized engine)."""
    weights = record.get("weights", record["dtype"])
    return record["dtype"] if weights == record["dtype"] else f"{record['dtype']}, weights {weights}"


def new_record(kind: str, **fields) -> dict:
    return {"kind": kind, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "kiln_commit": _git_commit(), **fields}


def append_record(path: str | Path, record: dict) -> None:
    """Append one JSON line (results accumulate across runs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def random_lora_modules(config, rank: int, modules: tuple[str, ...], seed: int = 0, scale: float = 0.01) -> list:
    """A random LoRA adapter (``kiln.checkpoint.lora.LoraModule`` rows): rank ``rank`` on the
    reference ``modules`` of every layer of a model of ``config`` that has them, entries ``scale``
    x N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    shapes = lora_module_shapes(config)
    rows = []
    for layer in range(config.num_hidden_layers):
        for name in modules:
            if (layer, LORA_MODULE_IDS[name]) not in shapes:
                continue
            size_in, size_out = shapes[layer, LORA_MODULE_IDS[name]]
            rows.append(LoraModule(LORA_MODULE_IDS[name], layer, torch.randn(rank, size_in, generator=g) * scale,
                                   torch.randn(size_out, rank, generator=g) * scale))
    return rows
