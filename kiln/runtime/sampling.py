"""Per-request sampling parameters and the batched sampler.

The sampler works on a whole batch of logits rows at once; each row has its own
temperature, top-k, top-p and random generator (one RNG per request, so a seeded request
gives the same tokens whatever else shares its batch).

Order of operations per row: temperature, then top-k, then top-p within the top-k
survivors, then a draw. A temperature of 0 means greedy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.errors import RequestError


@dataclass(slots=True)
class SamplingParams:
    """How to generate for one request (the names users know from vLLM).

    ``top_k`` 0 or -1 and ``top_p`` 1.0 mean no filtering; ``temperature`` 0 means greedy.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise RequestError(f"seed must be an integer, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def make_generator(self) -> torch.Generator | None:
        if self.is_greedy:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits`` ``[n, vocab]`` (float32). Returns ``[n]`` int64."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return tokens
    idx = torch.tensor(rows)
    sub = logits[idx]
    temperature = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype)
    sub = sub / temperature[:, None]
    top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else sub.shape[1] for i in rows])
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=sub.dtype)
    sub = apply_top_k_top_p(sub, top_k, top_p)
    probs = sub.softmax(dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one generator per row.
    noise = torch.empty_like(probs)
    for r, i in enumerate(rows):
        noise[r].exponential_(generator=generators[i])
    tokens[idx] = (probs / noise).argmax(dim=-1)
    return tokens


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
