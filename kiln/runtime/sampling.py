"""Reference 003's SamplingConfig and the batched sampler.

The sampler works on a whole step's processed logits ``[n, vocab]``; each row has its own
temperature, top-k, top-p (after decay), min-p and random generator (one RNG per request,
so a seeded request draws the same tokens whatever else shares its batch).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.errors import RequestError
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence


@dataclass
class SamplingConfig:
    """Sampling controls of reference 003, for a whole batch. Each field but ``beam_width`` is a
    scalar or a list with one value per sequence.

    Defaults follow reference 003, except where Hugging Face has the knob and the reference
    engines disagree: ``length_penalty`` 1.0 and ``early_stopping`` False (HF's), and
    ``min_length`` 1 (at least one token, which is always true). ``top_k == 0`` and
    ``top_p == 0`` together mean greedy search; ``top_p_reset_ids`` -1 means none.
    """

    temperature: Any = 1.0
    min_length: Any = 1
    repetition_penalty: Any = 1.0
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    random_seed: Any = 0
    top_k: Any = 0
    top_p: Any = 0.0
    min_p: Any = 0.0
    top_p_decay: Any = 1.0
    top_p_min: Any = 1e-6
    top_p_reset_ids: Any = -1
    no_repeat_ngram_size: Any = 0
    beam_width: int = 1
    beam_search_diversity_rate: Any = 0.0
    length_penalty: Any = 1.0
    early_stopping: Any = False
    num_return_sequences: Any = None  # None: beam_width

    def per_sequence(self, batch_size: int, max_new_tokens: int) -> list[SamplingParams]:
        """One validated :class:`SamplingParams` per sequence of the batch."""
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise RequestError(f"SamplingConfig.beam_width must be an integer >= 1, got {self.beam_width!r}")
        out = []
        for i in range(batch_size):
            v = {f.name: self._pick(f.name, i, batch_size) for f in dataclasses.fields(self) if f.name != "beam_width"}
            greedy = v["top_k"] == 0 and v["top_p"] == 0
            reset = v["top_p_reset_ids"]
            reset_ids = [] if reset in (-1, None) else (list(reset) if isinstance(reset, (list, tuple)) else [reset])
            beams = self.beam_width
            num_return = v["num_return_sequences"] or beams
            try:
                out.append(SamplingParams(
                    max_tokens=max_new_tokens, min_tokens=min(max(v["min_length"], 0), max_new_tokens),
                    n=num_return, best_of=beams if beams > 1 else None, use_beam_search=beams > 1,
                    temperature=0.0 if greedy else v["temperature"], top_k=v["top_k"],
                    top_p=v["top_p"] if v["top_p"] > 0 else 1.0, min_p=v["min_p"],
                    top_p_decay=v["top_p_decay"], top_p_min=v["top_p_min"], top_p_reset_ids=reset_ids,
                    repetition_penalty=v["repetition_penalty"], presence_penalty=v["presence_penalty"],
                    frequency_penalty=v["frequency_penalty"], no_repeat_ngram_size=v["no_repeat_ngram_size"],
                    seed=v["random_seed"], length_penalty=v["length_penalty"], early_stopping=v["early_stopping"],
                    beam_search_diversity_rate=v["beam_search_diversity_rate"]))
            except RequestError as e:
                raise RequestError(f"SamplingConfig (sequence {i}): {e}") from None
        return out

    def _pick(self, name: str, i: int, batch_size: int) -> Any:
        value = getattr(self, name)
        if name == "top_p_reset_ids" and isinstance(value, (list, tuple)) and len(value) != batch_size:
            return value  # one list of ids shared by every sequence
        if isinstance(value, (list, tuple)):
            if len(value) not in (1, batch_size):
                raise RequestError(f"SamplingConfig.{name} has {len(value)} values for a batch of {batch_size}")
            return value[0] if len(value) == 1 else value[i]
        return value


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [n] int64
    logprobs: torch.Tensor | None = None  # [n]: log-prob of each chosen token
    top_logprobs: list[dict[int, float]] | None = None  # per row, when asked
    extra: dict = field(default_factory=dict)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
    """Draw one token per row of processed ``logits`` ``[n, vocab]`` (float32).

    Temperature, then top-k, top-p (each sequence's current, decayed value) and min-p, then
    a draw with the sequence's generator; greedy rows take the argmax.
    """
    params = [s.params for s in seqs]
    temperature = torch.tensor([p.temperature if not p.is_greedy and p.temperature > 0 else 1.0 for p in params])
    scaled = logits / temperature[:, None]
    tokens = scaled.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        idx = torch.tensor(rows)
        sub = scaled[idx]
        top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else sub.shape[1] for i in rows])
        top_p = torch.tensor([seqs[i].current_top_p for i in rows], dtype=sub.dtype)
        min_p = torch.tensor([params[i].min_p for i in rows], dtype=sub.dtype)
        sub = apply_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one generator per row.
        noise = torch.empty_like(probs)
        for r, i in enumerate(rows):
            noise[r].exponential_(generator=seqs[i].generator)
        tokens[idx] = (probs / noise).argmax(dim=-1)
    out = SampleOutput(tokens)
    if any(p.logprobs is not None for p in params):
        logprobs = scaled.log_softmax(dim=-1)
        out.logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
        k = max(p.logprobs or 0 for p in params)
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            out.top_logprobs = [dict(zip(ids[r, : p.logprobs or 0].tolist(), values[r, : p.logprobs or 0].tolist()))
                                for r, p in enumerate(params)]
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, then outside its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1])[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p (the first always stays).
    # top_p 1 filters nothing: float32 cumsum reaches 1.0 before the tail's tiny probabilities.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
