"""The masks structured outputs put on a step's logits (``kiln.runtime.structured_outputs``).

``GrammarMasks`` lives where the sampler runs: one llguidance matcher per constrained sequence,
advanced by the tokens the sequence gained since the last step (so it follows a sequence however
its tokens arrive, as ``TokenHistory`` does), and before temperature, top-k and top-p the logits
of every token its grammar does not allow next are set to -inf. A finished grammar allows only
the end tokens.
"""
from __future__ import annotations

from typing import Callable

import llguidance
import torch

from kiln.errors import KilnError, RequestError
from kiln.runtime.sequence import Sequence


class GrammarMasks:
    """Each constrained sequence's matcher, and the masks they put on a step's logits."""

    def __init__(self, tokenizer_source: Callable[[], llguidance.LLTokenizer] | None = None):
        self.source = tokenizer_source  # the front end's (EngineCore.use_grammar_tokenizer), else the engine's
        self._tokenizer: llguidance.LLTokenizer | RequestError | None = None
        self._matchers: dict[int, list] = {}  # seq_id -> [matcher, output tokens consumed]

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set to -inf, in ``logits`` ``[n, vocab]``, every token a row's grammar does not allow."""
        rows = [i for i, s in enumerate(seqs) if s.params.structured_outputs is not None]
        if not rows:
            return
        words = (logits.shape[1] + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        for r, i in enumerate(rows):
            # (llguidance.torch's helper does this; importing it loads torch.compile's machinery, seconds)
            self._matcher(seqs[i]).unsafe_compute_mask_ptr(bitmask[r].data_ptr(), words * 4)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        banned = bits.view(len(rows), -1)[:, : logits.shape[1]] == 0
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(banned, float("-inf"))

    def rewind(self, seq: Sequence) -> None:
        """Take back the tokens the matcher consumed past the sequence's output (tried and not kept)."""
        entry = self._matchers.get(seq.seq_id)
        if entry is not None and entry[1] > seq.num_output_tokens:
            entry[0].rollback(entry[1] - seq.num_output_tokens)
            entry[1] = seq.num_output_tokens

    def release(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)

    def _matcher(self, seq: Sequence) -> llguidance.LLMatcher:
        entry = self._matchers.get(seq.seq_id)
        if entry is None:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), seq.params.structured_outputs.grammar_text)
            entry = self._matchers[seq.seq_id] = [matcher, 0]
        matcher, consumed = entry
        new = seq.output_token_ids[consumed:]
        if new:
            matcher.consume_tokens(new)
            entry[1] = len(seq.output_token_ids)
        if matcher.is_error():
            raise RequestError(f"sequence {seq.seq_id}: structured output: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self.source is None:
                raise RequestError("structured outputs need the model's tokenizer where the sampler runs: this "
                                   "engine core was given none (EngineCore.use_grammar_tokenizer)")
            try:
                self._tokenizer = self.source()
            except KilnError as e:  # remembered: every constrained request would fail alike
                self._tokenizer = e if isinstance(e, RequestError) else RequestError(f"structured outputs: {e}")
        if isinstance(self._tokenizer, RequestError):
            raise self._tokenizer
        return self._tokenizer
