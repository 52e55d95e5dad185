"""What the LLM API returns: a request's outputs, made from its finished sequences (the text and
finish reasons come from :mod:`kiln.runtime.request_processor`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.engine_core import SequenceGroup
from kiln.runtime.request_processor import FINISH_NAMES, TextTracker
from kiln.runtime.sequence import Sequence
from kiln.tokenizer import decode

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


def completion(index: int, seq: Sequence, tokenizer, tracker: TextTracker | None, want_logprobs: bool
               ) -> CompletionOutput:
    tokens = seq.output_token_ids
    if tracker is not None and tracker.stop_reason is not None:
        text = tracker.text
    else:
        text = decode(tokenizer, tokens)
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
    return [CompletionOutput(i, decode(tokenizer, h.token_ids), list(h.token_ids),
                             "stop" if h.token_ids and h.token_ids[-1] in ends else "length", h.cum_log_prob,
                             [{t: lp} for t, lp in zip(h.token_ids, h.log_probs)] if want_logprobs else None)
            for i, h in enumerate(request.hypotheses or [])]
