"""SamplingParams: how to generate for one request, with the names users know (vLLM/OpenAI).

Order in which the controls act on a step's logits (one batched pass, see
``kiln.runtime.logits_processors``):

1. ``logit_bias`` (token -> value) and ``embedding_bias`` (a ``[vocab]`` tensor) are added;
2. ``repetition_penalty`` (Hugging Face/CTRL rule, over prompt and output tokens): a seen
   token's logit is divided by the penalty when positive, multiplied when negative;
3. ``presence_penalty`` (subtracted once if the token appeared in the output) and
   ``frequency_penalty`` (subtracted per appearance in the output), OpenAI's rule;
4. bans to -inf: ``bad_words`` (a multi-token word bans its last token only when the
   tokens before it match), ``no_repeat_ngram_size``, and the end/stop tokens while fewer
   than ``min_tokens`` tokens have been generated;
5. ``temperature``; then ``top_k``, ``top_p`` within the top-k survivors (decayed per the
   "Factuality Enhanced Language Models" rule when ``top_p_decay`` < 1), ``min_p``; then a
   draw with the request's own generator (``seed``).

Greedy decoding is ``temperature == 0`` (or ``top_k == 1``): steps 1-4 still apply. A
temperature below ``GREEDY_TEMPERATURE`` (1e-5) also decodes greedily, as vLLM does: dividing
float32 logits by less would overflow them to inf.

Ranges (checked by :meth:`SamplingParams.validate`, the same for the Python API and the
server) keep every value inside what float32 logits and the beam scores can hold: OpenAI's
[-100, 100] for ``logit_bias`` values, [0.01, 100] for ``repetition_penalty``, [-10, 10] for
``length_penalty``. A ``seed`` may be any signed or unsigned 64-bit integer,
[-2**63, 2**64); the generator is seeded with it modulo 2**64 (so -1 and 2**64 - 1 draw
alike), and the ``i``-th of several samples uses ``seed + i`` modulo 2**64.
Reported log-probs are those of the distribution after steps 1-4 and the temperature,
before the top-k/top-p/min-p truncation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.errors import RequestError
from kiln.runtime.structured_outputs import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # below it sampling is greedy (float32 logits / T would overflow)
SEED_RANGE = (-2**63, 2**64)  # signed or unsigned 64-bit
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
REPETITION_PENALTY_RANGE = (0.01, 100.0)
LENGTH_PENALTY_RANGE = (-10.0, 10.0)  # a sequence length ** length_penalty stays a finite float


def _check(ok: bool, field_name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise RequestError(f"{field_name} must be {allowed}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_lists(value: Any, field_name: str) -> list[list[int]]:
    """Normalise a list of words (each a token-id list) and validate it."""
    _check(isinstance(value, (list, tuple)), field_name, "a list of token-id lists", value)
    words = []
    for word in value:
        if _is_int(word):
            word = [word]
        _check(isinstance(word, (list, tuple)) and len(word) > 0 and all(_is_int(t) and t >= 0 for t in word),
               field_name, "a list of non-empty lists of token ids >= 0", value)
        words.append(list(word))
    return words


def knob(default, group: str | None, help: str, *aliases: str):
    """A SamplingParams field: its default (a type such as ``list`` makes a fresh one per
    request), the group and help of its command-line flag (``kiln run``; None: no flag, as for a
    tensor), and older flag names it also answers to (TensorRT-LLM's)."""
    metadata = {"group": group, "help": help, "aliases": aliases}
    if isinstance(default, type):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation controls. Defaults change nothing but ``max_tokens``.

    ``n`` sequences are returned. With ``use_beam_search`` they are the best ``n`` of a
    beam search of width ``best_of`` (default ``n``); otherwise ``best_of`` samples are
    drawn and the ``n`` with the highest cumulative log-prob returned.
    """

    max_tokens: int = knob(16, "length", "most new tokens to generate", "--max_output_len")
    min_tokens: int = knob(0, "length", "generate at least this many tokens (0: no minimum)", "--min_length")
    n: int = knob(1, "several outputs", "outputs to return (<= best_of)", "--num_return_sequences")
    best_of: int | None = knob(None, "several outputs",
                               "sample this many (or beam width) and return the n most likely (default n)")
    temperature: float = knob(1.0, "sampling", "sampling temperature; 0 is greedy")
    top_k: int = knob(0, "sampling", "sample among the k most likely tokens (0 or -1: no limit)")
    top_p: float = knob(1.0, "sampling", "sample within this probability mass (1: no limit)")
    min_p: float = knob(0.0, "sampling", "drop tokens below min_p x the top probability (0: off)")
    top_p_decay: float = knob(1.0, "sampling", "multiply top_p by this after each token (1: off)")
    top_p_min: float = knob(1e-6, "sampling", "floor for the decayed top_p")
    top_p_reset_ids: list[int] = knob(list, "sampling", "token ids that reset the decayed top_p to its start value")
    repetition_penalty: float = knob(1.0, "penalties and biases",
                                     "divide (positive) / multiply (negative) logits of seen tokens by this (1: off)")
    presence_penalty: float = knob(0.0, "penalties and biases", "subtract from generated tokens' logits (-2..2)")
    frequency_penalty: float = knob(0.0, "penalties and biases",
                                    "subtract this x count of each generated token (-2..2)")
    no_repeat_ngram_size: int = knob(0, "penalties and biases", "never repeat an n-gram of this size (0: off)")
    logit_bias: dict[int, float] = knob(dict, "penalties and biases",
                                        'token id -> bias added to its logit, a JSON object: \'{"50256": -100}\'')
    embedding_bias: torch.Tensor | None = knob(None, None, "a [vocab] tensor added to the logits")
    bad_words_ids: list[list[int]] = knob(list, "stop and bad words",
                                          "token-id sequences never to generate, JSON: '[[1, 2], [3]]'")
    stop_token_ids: list[int] = knob(list, "stop and bad words", "token ids that end generation")
    stop_words_ids: list[list[int]] = knob(list, "stop and bad words",
                                           "token-id sequences that end generation, JSON: '[[1, 2], [3]]'")
    stop: list[str] = knob(list, "stop and bad words", "stop when any of these strings appears in the text")
    bad_words: list[str] = knob(list, "stop and bad words", "words never to generate (tokenized by the LLM API)")
    include_stop_str_in_output: bool = knob(False, "stop and bad words", "keep the stop string in the text")
    ignore_eos: bool = knob(False, "length", "keep generating past the end-of-sequence token")
    logprobs: int | None = knob(None, "log-probs",
                                "top-k log-probs of each generated token (0: just the chosen token's)")
    prompt_logprobs: int | None = knob(None, "log-probs", "top-k log-probs of each prompt token")
    seed: int | None = knob(None, "sampling", "random seed for sampling (default: random)")
    use_beam_search: bool = knob(False, "several outputs", "beam search of width best_of instead of sampling")
    length_penalty: float = knob(1.0, "several outputs", "beam score = logprob / length^this")
    early_stopping: bool | str = knob(False, "several outputs",
                                      "beam search stop rule, as in Hugging Face: true, false or never")
    beam_search_diversity_rate: float = knob(0.0, "several outputs",
                                             "penalise a beam's k-th best continuation by k x this")
    structured_outputs: StructuredOutputsParams | None = knob(
        None, None, "hold the output to a JSON Schema, JSON object, regex, choice or grammar")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()

    def validate(self, vocab_size: int | None = None, max_beam_width: int | None = None) -> None:
        """Check every field; with ``vocab_size`` also that token ids lie in the vocabulary."""
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n), "best_of",
               f"None or an integer >= n ({self.n})", self.best_of)
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", ">= 0", self.temperature)
        # A top_k at or above the vocabulary size keeps every token.
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "an integer >= -1 (0 or -1: off)", self.top_k)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(_is_number(self.top_p_decay) and 0 < self.top_p_decay <= 1, "top_p_decay", "in (0, 1]",
               self.top_p_decay)
        _check(_is_number(self.top_p_min) and 0 < self.top_p_min <= 1, "top_p_min", "in (0, 1]", self.top_p_min)
        low, high = REPETITION_PENALTY_RANGE
        _check(_is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high, "repetition_penalty",
               f"in [{low}, {high}]", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        _check(_is_int(self.no_repeat_ngram_size) and self.no_repeat_ngram_size >= 0, "no_repeat_ngram_size",
               "an integer >= 0", self.no_repeat_ngram_size)
        _check(isinstance(self.logit_bias, dict) and all(_is_int(k) and k >= 0 and _is_number(v)
                                                           and abs(v) <= MAX_LOGIT_BIAS
                                                           for k, v in self.logit_bias.items()),
               "logit_bias", f"a dict of token id -> number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
               self.logit_bias)
        self.bad_words_ids = _token_lists(self.bad_words_ids, "bad_words_ids")
        self.stop_words_ids = _token_lists(self.stop_words_ids, "stop_words_ids")
        for name in ("stop_token_ids", "top_p_reset_ids"):
            ids = getattr(self, name)
            _check(isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids), name,
                   "a list of token ids >= 0", ids)
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
               "a list of non-empty strings", self.stop)
        _check(isinstance(self.bad_words, list) and all(isinstance(s, str) and s for s in self.bad_words),
               "bad_words", "a list of non-empty strings", self.bad_words)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= 20), name, "None or an integer in [0, 20]", value)
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]), "seed",
               "None or a 64-bit integer in [-2**63, 2**64)", self.seed)
        low, high = LENGTH_PENALTY_RANGE
        _check(_is_number(self.length_penalty) and low <= self.length_penalty <= high, "length_penalty",
               f"in [{low:g}, {high:g}]", self.length_penalty)
        _check(any(self.early_stopping is v for v in (True, False)) or self.early_stopping == "never",
               "early_stopping", "True, False or 'never'", self.early_stopping)
        _check(_is_number(self.beam_search_diversity_rate) and self.beam_search_diversity_rate >= 0,
               "beam_search_diversity_rate", ">= 0", self.beam_search_diversity_rate)
        if self.embedding_bias is not None:
            _check(isinstance(self.embedding_bias, torch.Tensor) and self.embedding_bias.dim() == 1,
                   "embedding_bias", "a 1-D tensor of vocab_size values", self.embedding_bias)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs)
        _check(self.structured_outputs is None or not self.use_beam_search, "structured_outputs",
               "used without beam search", "with use_beam_search")
        if vocab_size is not None:
            self._validate_vocab(vocab_size)
        if self.use_beam_search and max_beam_width is not None:
            _check(self.beam_width <= max_beam_width, "best_of (beam width)",
                   f"at most the engine's max_beam_width {max_beam_width}", self.beam_width)

    def _validate_vocab(self, vocab: int) -> None:
        fields = {"logit_bias": list(self.logit_bias), "stop_token_ids": self.stop_token_ids,
                  "top_p_reset_ids": self.top_p_reset_ids,
                  "bad_words_ids": [t for w in self.bad_words_ids for t in w],
                  "stop_words_ids": [t for w in self.stop_words_ids for t in w]}
        for name, ids in fields.items():  # name the field at fault (kiln.errors' rule)
            bad = [t for t in ids if t >= vocab]
            _check(not bad, f"{name} token ids", f"inside the vocabulary [0, {vocab})", bad[:5])
        if self.embedding_bias is not None:
            _check(self.embedding_bias.numel() == vocab, "embedding_bias", f"of length vocab_size {vocab}",
                   f"length {self.embedding_bias.numel()}")

    # -- derived ----------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def beam_width(self) -> int:
        return (self.best_of or self.n) if self.use_beam_search else 1

    @property
    def num_samples(self) -> int:
        """Independent sequences to run without beam search (``best_of`` or ``n``)."""
        return 1 if self.use_beam_search else (self.best_of or self.n)

    @property
    def needs_history(self) -> bool:
        """Whether processing needs the token history (penalties, n-grams, multi-token bans)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.no_repeat_ngram_size > 0 or any(len(w) > 1 for w in self.bad_words_ids))

    @property
    def may_ban_tokens(self) -> bool:
        """Whether processing can set logits to -inf (bad words, n-gram bans, min_tokens, an
        embedding bias, a grammar), and so perhaps every one of them."""
        return (bool(self.bad_words_ids) or self.no_repeat_ngram_size > 0 or self.min_tokens > 0
                or self.embedding_bias is not None or self.structured_outputs is not None)

    def seed_for(self, i: int) -> int | None:
        """The seed of the ``i``-th of several samples drawn for one request (None: unseeded)."""
        return None if self.seed is None else (self.seed + i) % 2**64

    def make_generator(self) -> torch.Generator | None:
        if self.is_greedy or self.use_beam_search:
            return None  # nothing random to draw
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed % 2**64)
        return g
