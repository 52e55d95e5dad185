"""What lies between a user's request and the engine, the same for ``LLM``, the server and the
executor's requests: the model's end ids, a request's engine params (extra end ids, bad words
as token ids, the i-th sample's seed, the log-probs ``best_of`` ranks by), its text as tokens
arrive with stop strings applied, and the finish reasons users see.

Stop strings are matched on the detokenized text as it grows; the text is cut before the stop
string (or after it with ``include_stop_str_in_output``) and the sequence ends with finish
reason "stop". The engine never sees them: they are text, not tokens.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from kiln.errors import ConfigError, RequestError
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import FinishReason
from kiln.runtime.structured_outputs import StructuredOutputsParams, check_grammar, grammar_tokenizer
from kiln.tokenizer import IncrementalDetokenizer, end_ids, load_tokenizer

# What users of OpenAI-style APIs expect to see.
FINISH_NAMES = {FinishReason.END_ID: "stop", FinishReason.STOP_WORDS: "stop", FinishReason.LENGTH: "length",
                FinishReason.CANCELLED: "abort", FinishReason.TIMEOUT: "abort", FinishReason.ERROR: "error"}


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


# What a request may not ask for without a tokenizer (LLM(skip_tokenizer_init=True)), and why.
NEEDS_TOKENIZER = {"stop": "stop strings are matched on the text; use stop_token_ids",
                   "bad_words": "words are banned by their tokens; use bad_words_ids",
                   "structured_outputs": "grammars are compiled against the tokenizer's vocabulary"}


class RequestProcessor:
    """A model's tokenizer (or none, for token ids only) and end ids, and what every front end
    does with them."""

    def __init__(self, tokenizer, end_token_ids: list[int], vocab_size: int | None = None):
        self.tokenizer = tokenizer  # None: prompts and outputs are token ids only, texts are ""
        self.end_id = end_token_ids[0] if end_token_ids else None
        self.extra_stop_ids = list(end_token_ids[1:])  # a model may end on several ids (Llama 3)
        self.vocab_size = vocab_size or len(tokenizer)  # the model's logits (a padded vocabulary may be wider)
        self._grammar_tokenizer = None
        self._checked_grammars: dict[str, None] = {}  # grammar texts that compiled, oldest first

    @classmethod
    def load(cls, tokenizer_dir: str | Path | None, engine_dir: str | Path,
             vocab_size: int | None = None) -> "RequestProcessor":
        """The processor of the tokenizer in ``tokenizer_dir`` (an engine's stored one) for a
        model of ``vocab_size`` logits."""
        if tokenizer_dir is None:
            raise ConfigError(f"{engine_dir}: the engine carries no tokenizer; pass a tokenizer directory")
        tokenizer = load_tokenizer(tokenizer_dir)
        return cls(tokenizer, end_ids(tokenizer_dir, tokenizer), vocab_size)

    @classmethod
    def without_tokenizer(cls, engine_dir: str | Path, vocab_size: int) -> "RequestProcessor":
        """A processor of token ids only (no tokenizer is loaded). The end ids are the engine's
        generation_config.json's ``eos_token_id``; without one, generation ends only at
        ``max_tokens`` or a request's ``stop_token_ids``."""
        return cls(None, end_ids(engine_dir, None), vocab_size)

    def grammar_tokenizer(self):
        """The tokenizer as structured outputs' grammar engine sees it (built on first use)."""
        if self._grammar_tokenizer is None:
            ends = [] if self.end_id is None else [self.end_id, *self.extra_stop_ids]
            try:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, ends)
            except RequestError as e:  # remembered: every constrained request would fail alike
                self._grammar_tokenizer = e
        if isinstance(self._grammar_tokenizer, RequestError):
            raise self._grammar_tokenizer
        return self._grammar_tokenizer

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (a string is tokenized; a list of ids is taken as it is)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt must be token ids: no tokenizer was loaded (skip_tokenizer_init=True)")
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def check_structured_outputs(self, constraint: StructuredOutputsParams) -> None:
        """A RequestError with llguidance's reason if ``constraint``'s grammar cannot compile for
        this tokenizer (the last 256 that did are remembered, so a repeated schema costs nothing)."""
        if constraint.grammar_text in self._checked_grammars:
            return
        check_grammar(constraint, self.grammar_tokenizer())
        self._checked_grammars[constraint.grammar_text] = None
        if len(self._checked_grammars) > 256:
            del self._checked_grammars[next(iter(self._checked_grammars))]

    def engine_params(self, params: SamplingParams, sample: int | None = None) -> SamplingParams:
        """The params the engine runs ``params`` with: the model's extra end ids (unless
        ``ignore_eos``), ``bad_words`` as token ids (at a word start and mid-text alike), no stop
        strings (matched on the text instead). With ``sample`` ``i``: the ``i``-th of ``n``
        independent samples (one sequence, seed ``params.seed_for(i)``); else the whole group,
        with the log-probs ``best_of`` ranks its samples by."""
        if self.tokenizer is None:
            for name, why in NEEDS_TOKENIZER.items():
                if getattr(params, name) not in (None, []):
                    raise RequestError(f"{name} must not be set without a tokenizer (skip_tokenizer_init=True): "
                                       f"{why}")
        if params.use_beam_search and (params.stop or params.stop_words_ids):
            raise RequestError("stop strings and multi-token stop words are not supported with beam search")
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)
        changes: dict = {"stop": []} if params.stop else {}
        if self.extra_stop_ids and not params.ignore_eos:  # ignore_eos ignores every end id
            changes["stop_token_ids"] = list(params.stop_token_ids) + self.extra_stop_ids
        if params.bad_words:
            words = list(params.bad_words_ids)
            for word in params.bad_words:
                for variant in {word, " " + word.lstrip()}:
                    ids = self.tokenizer(variant, add_special_tokens=False)["input_ids"]
                    if ids and ids not in words:
                        words.append(ids)
            changes.update(bad_words_ids=words, bad_words=[])
        if sample is not None:
            changes.update(n=1, best_of=None, seed=params.seed_for(sample))
        elif not params.use_beam_search and params.num_samples > params.n and params.logprobs is None:
            changes["logprobs"] = 0
        return dataclasses.replace(params, **changes) if changes else params  # a copy re-validates

    def text_tracker(self, params: SamplingParams) -> TextTracker:
        """The incremental text of one of ``params``' sequences, with its stop strings."""
        return TextTracker(self.tokenizer, params.stop, params.include_stop_str_in_output)

    @staticmethod
    def finish_name(reason: FinishReason | str | None) -> str | None:
        """The finish reason users see ("stop", "length", "abort", "error"), None while running."""
        return None if reason is None else FINISH_NAMES[FinishReason(reason)]
