"""Stop/bad words lists in reference 003's ``[2, len]`` tensor encoding.

Row 0 holds the words' tokens back to back; row 1 the word boundaries as an exclusive
prefix sum followed by the total (``[0, 3, 5, 9]`` for words of 3, 2 and 4 tokens), padded
with -1. Words ``[5, 7, 3]``, ``[9, 2]``, ``[6, 2, 4, 1]``::

    [[5, 7, 3, 9, 2, 6, 2, 4, 1],
     [0, 3, 5, 9, -1, -1, -1, -1, -1]]

When every word is a single token the boundaries outnumber the tokens by one, so ``len``
is the number of words + 1 (the token row is padded with -1). A ``[batch, 2, len]`` tensor
gives each sequence its own list. Decoding also accepts TensorRT-LLM's tool output, whose
offsets row omits the leading 0 (inclusive ends).
"""
from __future__ import annotations

import torch

from kiln.errors import RequestError


def encode_words(words: list[list[int]]) -> torch.Tensor:
    """``[2, len]`` int32 encoding of ``words`` (each a non-empty list of token ids)."""
    tokens = [t for w in words for t in w]
    bounds = [0]
    for w in words:
        if not w:
            raise RequestError("a stop/bad word must have at least one token")
        bounds.append(bounds[-1] + len(w))
    length = max(len(tokens), len(bounds), 1)
    out = torch.full((2, length), -1, dtype=torch.int32)
    out[0, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    if words:
        out[1, : len(bounds)] = torch.tensor(bounds, dtype=torch.int32)
    return out


def decode_words(encoded: torch.Tensor, name: str = "words list") -> list[list[int]]:
    """The words of one ``[2, len]`` list; a :class:`RequestError` naming ``name`` if malformed."""
    if not isinstance(encoded, torch.Tensor) or encoded.dim() != 2 or encoded.shape[0] != 2:
        raise RequestError(f"{name} must be a [2, len] tensor, got shape "
                           f"{list(encoded.shape) if isinstance(encoded, torch.Tensor) else type(encoded).__name__}")
    tokens, offsets = encoded[0].tolist(), encoded[1].tolist()
    bounds = []
    for value in offsets:
        if value < 0:
            break
        bounds.append(int(value))
    if not bounds:
        return []
    if bounds[0] != 0:  # inclusive ends: the tool's form without the leading 0
        bounds = [0] + bounds
    if any(b <= a for a, b in zip(bounds, bounds[1:])) or bounds[-1] > len(tokens):
        raise RequestError(f"{name}: offsets row {offsets} must rise strictly and stay within the "
                           f"{len(tokens)} tokens")
    words = [tokens[a:b] for a, b in zip(bounds, bounds[1:])]
    if any(t < 0 for w in words for t in w):
        raise RequestError(f"{name}: negative token id inside a word {words}")
    return words


def decode_batch_words(encoded: torch.Tensor | None, batch_size: int, name: str) -> list[list[list[int]]]:
    """Per-sequence word lists from a ``[2, len]`` (shared) or ``[batch, 2, len]`` tensor."""
    if encoded is None:
        return [[] for _ in range(batch_size)]
    if isinstance(encoded, torch.Tensor) and encoded.dim() == 3:
        if encoded.shape[0] != batch_size:
            raise RequestError(f"{name} has {encoded.shape[0]} lists for a batch of {batch_size}")
        return [decode_words(encoded[b], f"{name}[{b}]") for b in range(batch_size)]
    shared = decode_words(encoded, name)
    return [shared for _ in range(batch_size)]
