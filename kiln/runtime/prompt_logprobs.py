"""Prompt log-probs from context logits: how likely each prompt token was given those before it.

One function for every face that scores prompts (the LLM API's ``prompt_logprobs``, the server's
``echo`` and ``prompt_logprobs``), so they agree to the bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptLogprobs:
    """Per prompt token ``i``: ``entries[i]`` maps token id -> log-prob for the top-k tokens and
    prompt token ``i`` itself (the top-k first, most likely first), ``ranks[i]`` is that token's
    rank in the whole vocabulary (1: the most likely). Both are None for the first token (nothing
    comes before it) and for a token whose logits were never computed (a request cancelled or
    timed out during its prefill)."""

    entries: list[dict[int, float] | None]
    ranks: list[int | None]


def prompt_logprobs(context_logits: torch.Tensor | list[torch.Tensor] | None, prompt_ids: list[int],
                    k: int) -> PromptLogprobs:
    """The log-probs of ``prompt_ids`` from their context logits (rows of vocabulary logits, row
    ``j`` predicting prompt token ``j + 1``; chunks are concatenated) with the top ``k`` of each."""
    if isinstance(context_logits, list):
        context_logits = torch.cat(context_logits) if context_logits else None
    n = len(prompt_ids)
    rows = 0 if context_logits is None else min(context_logits.shape[0], n - 1)
    entries: list[dict[int, float] | None] = [None] * n
    ranks: list[int | None] = [None] * n
    if rows <= 0:
        return PromptLogprobs(entries, ranks)
    logprobs = context_logits[:rows].float().log_softmax(dim=-1)
    targets = torch.tensor(prompt_ids[1:rows + 1], dtype=torch.long)
    chosen = logprobs.gather(1, targets[:, None])
    rank = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(k, dim=1) if k else (None, None)
    chosen_list, rank_list = chosen[:, 0].tolist(), rank.tolist()
    for j, token in enumerate(targets.tolist()):
        entry = dict(zip(top_ids[j].tolist(), top_values[j].tolist())) if k else {}
        entry[token] = chosen_list[j]
        entries[j + 1], ranks[j + 1] = entry, rank_list[j]
    return PromptLogprobs(entries, ranks)


def top_of(entry: dict[int, float], token: int, k: int) -> dict[int, float]:
    """``entry`` (top-K and ``token``) cut to the top ``k <= K`` and ``token``: for an answer
    that asked for fewer alternatives than were computed for another part of it."""
    kept = dict(sorted(entry.items(), key=lambda item: -item[1])[:k])
    kept[token] = entry[token]
    return kept
