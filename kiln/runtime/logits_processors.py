"""Batched logits processing: biases, penalties and bans for a whole step at once.

One call handles every row of the step's logits ``[n, vocab]``; each row follows its own
request's :class:`SamplingParams` (the order is documented there). Work is tensor ops over
the batch; per-row Python only gathers parameters. Rows whose requests use none of these
controls cost nothing.

Token history (for penalties, n-gram bans and multi-token bad words) comes from
:class:`TokenHistory`, which keeps each sequence's tokens in a tensor updated incrementally.
"""
from __future__ import annotations

import torch

from kiln.runtime.sequence import Sequence

NEG_INF = float("-inf")


class TokenHistory:
    """Each live sequence's token ids as a tensor, appended to as tokens arrive.

    A prompt-tuning prompt's virtual tokens (ids from ``vocab_size`` up) have no logit: they are
    recorded as the prompt's first real token (0 when it has none), which penalties and bans
    index safely and which, being in the prompt already, changes nothing they compute."""

    def __init__(self, max_seq_len: int, vocab_size: int | None = None):
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self._buffers: dict[int, list] = {}  # seq_id -> [tensor [max_seq_len] int64, length]

    def _sync(self, seq: Sequence) -> torch.Tensor:
        entry = self._buffers.get(seq.seq_id)
        if entry is None:
            entry = self._buffers[seq.seq_id] = [torch.zeros(self.max_seq_len, dtype=torch.int64), 0]
        buf, n = entry
        if seq.num_tokens < n:  # the sequence was rewound (beam reordering): rewrite it
            n = 0
        if seq.num_tokens > n:
            ids = seq.token_ids[n:]
            if self.vocab_size is not None and seq.prompt_table is not None:
                real = next((t for t in seq.token_ids if t < self.vocab_size), 0)
                ids = [t if t < self.vocab_size else real for t in ids]
            buf[n:seq.num_tokens] = torch.tensor(ids, dtype=torch.int64)
            entry[1] = seq.num_tokens
        return buf

    def rewind(self, seq: Sequence) -> None:
        """Forget what the buffer holds past the sequence's length (tokens tried and taken back)."""
        entry = self._buffers.get(seq.seq_id)
        if entry is not None:
            entry[1] = min(entry[1], seq.num_tokens)

    def reset(self, seq: Sequence) -> None:
        """Forget a sequence's buffer (its tokens were replaced, or it finished)."""
        self._buffers.pop(seq.seq_id, None)

    def batch(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [n, max_len], lengths [n])``; positions past a row's length hold 0."""
        lengths = torch.tensor([s.num_tokens for s in seqs])
        width = int(lengths.max())
        tokens = torch.stack([self._sync(s)[:width] for s in seqs])
        tokens = tokens.masked_fill(torch.arange(width)[None, :] >= lengths[:, None], 0)
        return tokens, lengths


def process_logits(logits: torch.Tensor, seqs: list[Sequence], history: TokenHistory) -> torch.Tensor:
    """Apply every request's biases, penalties and bans to ``logits`` ``[n, vocab]`` (float32, in place)."""
    params = [s.params for s in seqs]
    _add_biases(logits, params)
    rows = [i for i, p in enumerate(params) if p.needs_history]
    if rows:
        tokens, lengths = history.batch([seqs[i] for i in rows])
        every_row = len(rows) == len(seqs)
        sub = logits if every_row else logits[rows]
        prompt_lens = torch.tensor([seqs[i].num_prompt_tokens for i in rows])
        _apply_penalties(sub, [params[i] for i in rows], tokens, lengths, prompt_lens)
        _ban_ngram_repeats(sub, [params[i].no_repeat_ngram_size for i in rows], tokens, lengths)
        if not every_row:
            logits[rows] = sub
    _ban_bad_words(logits, seqs, history)
    _ban_end_before_min_tokens(logits, seqs)
    return logits


def _add_biases(logits: torch.Tensor, params) -> None:
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for token, value in p.logit_bias.items():
            rows.append(i)
            cols.append(token)
            vals.append(float(value))
    biased = [i for i, p in enumerate(params) if p.embedding_bias is not None]
    if biased:
        logits[biased] += torch.stack([params[i].embedding_bias for i in biased]).to(logits.dtype)
    if rows:
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals, dtype=logits.dtype),
                          accumulate=True)


def _apply_penalties(logits: torch.Tensor, params, tokens: torch.Tensor, lengths: torch.Tensor,
                     prompt_lens: torch.Tensor) -> None:
    """Repetition, presence and frequency penalties, touching only the tokens each row has seen."""
    positions = torch.arange(tokens.shape[1])[None, :]
    valid = positions < lengths[:, None]
    in_output = (valid & (positions >= prompt_lens[:, None])).to(logits.dtype)
    # Padding points at the row's first token, so every index is a real token of the row and
    # duplicate writes below carry the same value.
    tokens = torch.where(valid, tokens, tokens[:, :1])
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)[:, None]
    if (repetition != 1).any():
        seen = logits.gather(1, tokens)
        logits.scatter_(1, tokens, torch.where(seen > 0, seen / repetition, seen * repetition))
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)[:, None]
    if (frequency != 0).any():  # subtracted once per occurrence in the output
        logits.scatter_add_(1, tokens, -frequency * in_output)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)[:, None]
    if (presence != 0).any():  # subtracted once per distinct output token
        # Sort each row's output tokens (others become -1) and keep each token's first copy.
        ordered = torch.where(in_output > 0, tokens, -1).sort(dim=1).values
        first = ordered >= 0
        first[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
        logits.scatter_add_(1, ordered.clamp(min=0), -presence * first.to(logits.dtype))


def _ban_ngram_repeats(logits: torch.Tensor, sizes: list[int], tokens: torch.Tensor, lengths: torch.Tensor) -> None:
    """Ban any token that would complete an n-gram already in the sequence (Hugging Face's rule)."""
    for size in sorted(set(sizes) - {0}):
        rows = torch.tensor([i for i, s in enumerate(sizes) if s == size])
        if tokens.shape[1] < size:
            continue
        hist, lens = tokens[rows], lengths[rows]
        windows = hist.unfold(1, size, 1)  # [rows, num_windows, size]
        starts = torch.arange(windows.shape[1])[None, :]
        # The last size-1 tokens of each row, right-aligned.
        tail_pos = (lens[:, None] - (size - 1) + torch.arange(size - 1)[None, :]).clamp(min=0)
        tail = hist.gather(1, tail_pos)
        match = (windows[:, :, : size - 1] == tail[:, None, :]).all(-1)
        match &= (starts + size <= lens[:, None]) & (lens[:, None] >= size - 1)
        r, w = match.nonzero(as_tuple=True)
        logits[rows[r], windows[r, w, size - 1]] = NEG_INF


def _ban_bad_words(logits: torch.Tensor, seqs: list[Sequence], history: TokenHistory) -> None:
    """A bad word's last token is banned when the tokens before it end the sequence."""
    single_rows, single_tokens, multi = [], [], []
    for i, seq in enumerate(seqs):
        for word in seq.params.bad_words_ids:
            if len(word) == 1:
                single_rows.append(i)
                single_tokens.append(word[0])
            else:
                multi.append((i, word))
    if single_rows:
        logits[torch.tensor(single_rows), torch.tensor(single_tokens)] = NEG_INF
    if not multi:
        return
    rows = sorted({i for i, _ in multi})
    tokens, lengths = history.batch([seqs[i] for i in rows])
    where = {row: k for k, row in enumerate(rows)}
    width = max(len(w) for _, w in multi) - 1
    # Each word's prefix, right-aligned against its row's last `width` tokens.
    prefixes = torch.full((len(multi), width), -1, dtype=torch.int64)
    for k, (_, word) in enumerate(multi):
        prefixes[k, width - (len(word) - 1):] = torch.tensor(word[:-1])
    hist_rows = torch.tensor([where[i] for i, _ in multi])
    tail_pos = lengths[hist_rows][:, None] - width + torch.arange(width)[None, :]
    tail = tokens[hist_rows].gather(1, tail_pos.clamp(min=0)).masked_fill(tail_pos < 0, -2)
    match = ((prefixes == tail) | (prefixes == -1)).all(-1)
    ok = match.nonzero(as_tuple=True)[0]
    if ok.numel():
        logits[torch.tensor([multi[k][0] for k in ok.tolist()]), torch.tensor([multi[k][1][-1] for k in ok.tolist()])] = NEG_INF


def _ban_end_before_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            for token in seq.stop_ids:
                rows.append(i)
                cols.append(token)
    if rows:
        logits[torch.tensor(rows), torch.tensor(cols)] = NEG_INF
