"""Verifying proposed tokens against the target model (speculative decoding).

A sequence with ``k`` proposed tokens is computed as a chunk of ``k + 1`` tokens (its last
token and the proposals); logits row ``j`` is the target's next-token distribution after the
first ``j`` proposals. Rows are taken in order, each processed exactly as plain decoding
processes a sequence's one row (biases, penalties, bans, min_tokens, the grammar mask), with the
proposals before it counted as the sequence's tokens:

* greedy: a proposal is kept while it is the target's argmax; the first row where it is not
  gives the target's own token instead, so the output is plain greedy's, token for token;
* sampled: the rejection rule of speculative sampling for a proposer that puts all its mass on
  its token (n-gram): keep proposal ``x`` with probability ``p(x)`` under the target's filtered
  distribution (temperature, top-k, top-p, min-p), else draw from ``p`` without ``x``
  (renormalized). The kept tokens then follow the target distribution exactly.

After the last proposal is kept, the final row gives one more token (drawn as plain decoding
would). Each sequence ends up with between 1 and ``k + 1`` new tokens per step.
"""
from __future__ import annotations

import torch

from kiln.runtime.grammar_masks import GrammarMasks
from kiln.runtime.logits_processors import TokenHistory, process_logits
from kiln.runtime.sampling import check_allowed, filtered_distribution
from kiln.runtime.scheduler import TokenResult
from kiln.runtime.sequence import Sequence


def verify(logits: torch.Tensor, seq: Sequence, proposals: list[int], history: TokenHistory,
           grammars: GrammarMasks) -> list[TokenResult]:
    """The tokens ``seq`` gains from its ``len(proposals) + 1`` logits rows (float32, processed in
    place): the proposals kept, then the target's own token."""
    base = seq.num_tokens
    results: list[TokenResult] = []
    rows_alike = _rows_alike(seq)
    if rows_alike:  # no row's processing depends on the proposals before it: process all at once
        process_logits(logits, [seq] * logits.shape[0], history)
    greedy = logits.argmax(dim=-1).tolist() if rows_alike and seq.params.is_greedy else None
    try:
        for j in range(len(proposals) + 1):
            row = logits[j:j + 1]
            if not rows_alike:
                process_logits(row, [seq], history)
                grammars.apply(row, [seq])
            proposal = proposals[j] if j < len(proposals) else None
            token = _choose(row, seq, proposal, None if greedy is None else greedy[j])
            results.append(_result(row, seq, token))
            if token != proposal or token in seq.stop_ids:
                break
            seq.token_ids.append(token)  # the next row follows it (its history, its grammar state)
    finally:
        del seq.token_ids[base:]
        history.rewind(seq)
        grammars.rewind(seq)
    return results


def _rows_alike(seq: Sequence) -> bool:
    """Whether every row is processed alike whatever the proposals before it: no penalty, n-gram
    or multi-token ban reads the history, no grammar, and min_tokens is behind."""
    p = seq.params
    return not p.needs_history and p.structured_outputs is None and seq.num_output_tokens >= p.min_tokens


def _choose(row: torch.Tensor, seq: Sequence, proposal: int | None, argmax: int | None) -> int:
    params = seq.params
    if params.is_greedy:
        token = argmax if argmax is not None else int(row.argmax(dim=-1))
    else:
        row.div_(params.temperature)
        p = filtered_distribution(row, [seq])[0]
        g = seq.generator
        if proposal is not None and float(torch.rand((), generator=g)) < float(p[proposal]):
            return proposal
        if proposal is not None:
            p[proposal] = 0.0  # the residual of p minus a one-token proposal
        token = int(torch.multinomial(p / p.sum(), 1, generator=g))
    return int(check_allowed(row, torch.tensor([token]), [seq])[0])


def _result(row: torch.Tensor, seq: Sequence, token: int) -> TokenResult:
    """``token`` with its log-prob (and top-k) under the row, when the request asks for them
    (the row is temperature-scaled already for sampled requests, as plain sampling reports)."""
    k = seq.params.logprobs
    if k is None:
        return TokenResult(token)
    normalizer = torch.logsumexp(row[0], dim=-1)
    top = None
    if k:
        values, ids = row[0].topk(k)
        top = dict(zip(ids.tolist(), (values - normalizer).tolist()))
    return TokenResult(token, float(row[0, token] - normalizer), top)
