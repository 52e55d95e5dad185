"""What the LLM API returns, and how token ids become text with stop strings applied.

Stop strings are matched on the detokenized text as it grows; the text is cut before the
stop string (or after it with ``include_stop_str_in_output``) and the sequence ends with
finish reason "stop".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.engine_core import SequenceGroup
from kiln.runtime.sequence import FinishReason, Sequence
from kiln.tokenizer import IncrementalDetokenizer

# What users of OpenAI-style APIs expect to see.
FINISH_NAMES = {FinishReason.END_ID: "stop", FinishReason.STOP_WORDS: "stop", FinishReason.LENGTH: "length",
                FinishReason.CANCELLED: "abort", FinishReason.TIMEOUT: "abort", FinishReason.ERROR: "error"}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: its log-prob and the top-k
    stop_reason: str | None = None  # the stop string that ended it, if any


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # None for the first prompt token
    finished: bool = True


@dataclass
class StreamDelta:
    """A piece of a streamed generation: new text and tokens, and whether it is the last."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


class TextTracker:
    """Incremental text of one sequence, with stop-string detection."""

    def __init__(self, tokenizer, stop: list[str], include_stop: bool):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop, self.include_stop = stop, include_stop
        self.text = ""
        self.emitted = 0  # characters handed out by delta()
        self.stop_reason: str | None = None
        self.num_tokens = 0

    def update(self, token_ids: list[int], final: bool) -> bool:
        """Take the sequence's output ids so far; True when a stop string has just been found."""
        self.num_tokens = len(token_ids)
        start = max(len(self.text) - max((len(s) for s in self.stop), default=0), 0)
        self.text += self.detok.step(token_ids, final=final)
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at >= 0:
                self.text = self.text[: at + (len(stop) if self.include_stop else 0)]
                self.stop_reason = stop
                return True
        return False

    def delta(self) -> str:
        """Text not handed out yet, holding back a tail that could still become a stop string."""
        hold = 0 if self.stop_reason else max((len(s) - 1 for s in self.stop), default=0)
        end = max(len(self.text) - hold, self.emitted)
        piece, self.emitted = self.text[self.emitted:end], end
        return piece


def completion(index: int, seq: Sequence, tokenizer, tracker: TextTracker | None, want_logprobs: bool
               ) -> CompletionOutput:
    tokens = seq.output_token_ids
    if tracker is not None and tracker.stop_reason is not None:
        text = tracker.text
    else:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
    logprobs = None
    if want_logprobs:
        logprobs = [{**(top or {}), token: lp} for token, lp, top in
                    zip(tokens, seq.logprobs, seq.top_logprobs or [None] * len(tokens))]
    reason = FINISH_NAMES[seq.finish_reason] if seq.finish_reason else None
    return CompletionOutput(index, text, list(tokens), reason,
                            seq.cum_logprob if seq.logprobs else None, logprobs,
                            tracker.stop_reason if tracker else None)


def beam_completions(request: SequenceGroup, tokenizer, want_logprobs: bool) -> list[CompletionOutput]:
    ends = set(request.beam.params.end_ids)
    return [CompletionOutput(i, tokenizer.decode(h.token_ids, skip_special_tokens=True), list(h.token_ids),
                             "stop" if h.token_ids and h.token_ids[-1] in ends else "length", h.cum_log_prob,
                             [{t: lp} for t, lp in zip(h.token_ids, h.log_probs)] if want_logprobs else None)
            for i, h in enumerate(request.hypotheses or [])]
