"""Per-request beam search that reproduces Hugging Face transformers 5.x ``_beam_search``.

The runtime owns the model and the KV cache; this module only decides, step by step, which
beams live on and which hypotheses are finished. It works on one request at a time (requests
join and leave the in-flight batch independently) but keeps HF's float32 arithmetic, its
``-1e9`` sentinels and its ``torch.topk`` calls on the same shapes, so tokens and
``sequences_scores`` come out identical.

Candidate selection at one step (W = beam_width, K = max(2, 1 + len(end_ids)) * W)::

    live beam r:  log_probs[r, :] + score[r]      (W rows x V; step 1: the prompt row copied W
                        |                          times with scores [0, -1e9, ...] as in HF)
          top-K of all W*V  ->  c_0 >= c_1 >= ... >= c_{K-1}
             |                                 |
     c_0..c_{W-1} that end (end id, or   best W of the K that do not end
     max_new_tokens reached) are scored  (ending ones get -1e9) become the
     cum / gen_len**length_penalty and   next live beams; c_W.. only exist
     merged into the finished pool,      so that W survivors always exist
     which keeps its best W
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kiln.errors import RequestError

_NEG = -1.0e9  # HF's "impossible" score; same value so float32 sums and ties behave alike


@dataclass
class BeamSearchParams:
    """Beam search controls of one request (HF names and defaults).

    ``early_stopping``: True stops as soon as ``beam_width`` hypotheses are finished; False
    stops when the best live beam, scored at its current length, cannot beat the worst
    finished one; "never" does the same check at ``max_new_tokens`` when length_penalty > 0.
    ``diversity_rate``: within each parent beam its k-th best token (k = 0 for the best) loses
    ``k * diversity_rate`` for selection only (Li et al. 2016): it decides which K candidates
    are kept, which W of them may finish and which W live on; scores stay true log-prob sums.
    0 is plain HF beam search.
    ``max_new_tokens`` counts generated tokens; reaching it finishes every candidate.
    ``beam_width == 1`` is a one-beam beam search, not HF's greedy search.
    """

    beam_width: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    diversity_rate: float = 0.0
    end_ids: tuple[int, ...] = ()
    max_new_tokens: int = 16

    def validate(self) -> None:
        """Raise :class:`RequestError` naming the first field out of range."""
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.beam_width) or self.beam_width < 1:
            raise RequestError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.num_return_sequences) or not 1 <= self.num_return_sequences <= self.beam_width:
            raise RequestError(f"num_return_sequences must be an integer in [1, beam_width={self.beam_width}], "
                               f"got {self.num_return_sequences!r}")
        if not (self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"):
            raise RequestError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not is_real(self.length_penalty):
            raise RequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not is_real(self.diversity_rate) or self.diversity_rate < 0:
            raise RequestError(f"diversity_rate must be a finite number >= 0, got {self.diversity_rate!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not all(is_int(t) and t >= 0 for t in self.end_ids):
            raise RequestError(f"end_ids must be token ids >= 0, got {self.end_ids!r}")


@dataclass
class BeamHypothesis:
    """One returned sequence: generated tokens (end token included) and its scores."""

    token_ids: list[int]
    score: float  # HF sequences_scores: cum_log_prob / len(token_ids) ** length_penalty (float32)
    cum_log_prob: float  # float32 running sum of the chosen tokens' log-probs, as HF accumulates it
    log_probs: list[float] = field(default_factory=list)  # per generated token


@dataclass
class BeamStep:
    """What the runtime does next: new live beam i = live beam ``parents[i]`` + ``tokens[i]``.

    When ``done`` is True the lists are empty: no more forwards, call ``finalize()``.
    """

    parents: list[int]
    tokens: list[int]
    done: bool


class BeamSearch:
    """Beam search state of one request; feed ``step`` each step's processed log-probs."""

    def __init__(self, params: BeamSearchParams, prompt_len: int) -> None:
        params.validate()
        if not isinstance(prompt_len, int) or prompt_len < 0:
            raise RequestError(f"prompt_len must be an integer >= 0, got {prompt_len!r}")
        self.params = params
        self.prompt_len = prompt_len  # HF lengths are all relative to it; kept for the runtime
        w = params.beam_width
        self._k = max(2, 1 + len(params.end_ids)) * w  # enough candidates to keep W alive
        self._end = set(params.end_ids)
        self._live_scores = torch.tensor([0.0] + [_NEG] * (w - 1), dtype=torch.float32)
        self._live: list[tuple[list[int], list[float]]] = [([], []) for _ in range(w)]
        self._fin_scores = torch.full((w,), _NEG, dtype=torch.float32)
        self._fin_real = torch.zeros(w, dtype=torch.bool)  # HF is_sent_finished
        self._fin: list[BeamHypothesis | None] = [None] * w
        self._generated = 0
        self._done = False

    @property
    def num_live_beams(self) -> int:
        """Rows ``step`` expects: 1 before the first step (the prompt), then beam_width."""
        return 1 if self._generated == 0 else self.params.beam_width

    @property
    def done(self) -> bool:
        """True once the search has finished; only ``finalize`` is allowed then."""
        return self._done

    def step(self, log_probs: torch.Tensor) -> BeamStep:
        """Advance one token: ``log_probs`` is ``[num_live_beams, vocab]`` after log_softmax and
        the logits processors, row r for live beam r."""
        if self._done:
            raise RuntimeError("beam search is done; call finalize()")
        if log_probs.dim() != 2 or log_probs.shape[0] != self.num_live_beams:
            raise ValueError(f"log_probs must be [{self.num_live_beams}, vocab], got {tuple(log_probs.shape)}")
        p, w, k = self.params, self.params.beam_width, self._k
        first = self._generated == 0
        lp = log_probs.float()
        if first:
            lp = lp.expand(w, -1)  # HF's W copies of the prompt; only row 0 has score 0
        vocab = lp.shape[1]
        dev = lp.device
        acc = lp + self._live_scores.to(dev)[:, None]
        if p.diversity_rate == 0:
            cand, flat = torch.topk(acc.reshape(1, -1), k=k)  # exactly HF's call, for its tie order
            cand, flat = cand[0], flat[0]
            key = cand
        else:
            cand, flat, key = self._diverse_topk(acc, k)
        rows, toks, cand_l = (flat // vocab).tolist(), (flat % vocab).tolist(), cand.tolist()
        tok_lps = lp[flat // vocab, flat % vocab].tolist()
        at_max = self._generated + 1 >= p.max_new_tokens
        hits = torch.tensor([at_max or t in self._end for t in toks], dtype=torch.bool, device=dev)
        hit_pen = hits.to(torch.float32) * _NEG

        def hyp(c: int, score: float) -> BeamHypothesis:
            toks_so_far, lps_so_far = self._live[rows[c]]
            return BeamHypothesis(toks_so_far + [toks[c]], score, cand_l[c], lps_so_far + [tok_lps[c]])

        # Finished pool: only the top W candidates may enter, scored with the generated length
        # including the end token. (HF also bars entry when the pool is full under
        # early_stopping=True or hopeless, but both end the search the step they arise.)
        just = hits & (torch.arange(k, device=dev) < w)
        fin = cand / ((self._generated + 1) ** p.length_penalty)
        fin = fin + (~just).to(torch.float32) * _NEG
        fin_real = self._fin_real.to(dev)
        merged = torch.cat((self._fin_scores.to(dev), fin))
        top = torch.topk(merged, k=w).indices
        self._fin = [self._fin[j] if j < w else hyp(j - w, float(fin[j - w])) for j in top.tolist()]
        self._fin_scores = merged[top]
        self._fin_real = torch.cat((fin_real, just))[top]

        # Next live beams: the best W candidates that did not end (self._live is read above first).
        live_scores = cand + hit_pen
        nxt = torch.topk(key + hit_pen, k=w).indices
        self._live_scores = live_scores[nxt]
        nxt_l = nxt.tolist()
        self._live = [(self._live[rows[c]][0] + [toks[c]], self._live[rows[c]][1] + [tok_lps[c]]) for c in nxt_l]
        self._generated += 1

        # Stop when every candidate ended (max_new_tokens), when early_stopping=True has W
        # finished, or when the pool is full and the best live beam, scored at its current
        # length ("never" with length_penalty > 0: at max_new_tokens), cannot beat the worst
        # finished hypothesis. (HF keeps the last flag sticky; stopping at once is the same.)
        never = p.early_stopping == "never" and p.length_penalty > 0.0
        best_len = p.max_new_tokens if never else self._generated
        best = self._live_scores.max() / (best_len ** p.length_penalty)
        worst = torch.where(self._fin_real, self._fin_scores.min(), _NEG)
        hopeless = not bool((best > worst).any())
        full = bool(self._fin_real.all()) and p.early_stopping is True
        self._done = hopeless or full or bool(hits.all())
        if self._done:
            return BeamStep([], [], True)
        return BeamStep([0 if first else rows[c] for c in nxt_l], [toks[c] for c in nxt_l], False)

    def _diverse_topk(self, acc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k candidates ranked by score minus ``rank_in_parent * diversity_rate``; returns
        (true scores, flat indices into acc, penalised keys), best key first."""
        vocab = acc.shape[1]
        per_row = min(k, vocab)  # a token ranked >= k in its row can never make the global top k
        vals, idx = torch.topk(acc, k=per_row, dim=1)
        keys = vals - self.params.diversity_rate * torch.arange(per_row, device=acc.device, dtype=acc.dtype)
        key, pos = torch.topk(keys.reshape(-1), k=k)
        flat = (pos // per_row) * vocab + idx.reshape(-1)[pos]
        return vals.reshape(-1)[pos], flat, key

    def finalize(self) -> list[BeamHypothesis]:
        """The best ``num_return_sequences`` finished hypotheses, best first (HF's order)."""
        if not self._done:
            raise RuntimeError("beam search is not done; keep calling step()")
        return [h for h in self._fin[: self.params.num_return_sequences] if h is not None]
