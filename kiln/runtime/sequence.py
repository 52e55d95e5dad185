"""Sequence: the plain state of one request as it is generated (no model tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from kiln.runtime.sampling_params import SamplingParams


class FinishReason(str, Enum):
    END_ID = "end_id"
    STOP_WORDS = "stop_words"
    LENGTH = "length"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"  # the request failed alone (its error goes to its caller)


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt and what has been generated for it.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; each step gives the
    sequence tokens to catch up with ``num_tokens``. When it has caught up, the step's
    logits at its last token yield the next token.
    """

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    end_id: int | None
    max_seq_len: int
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained content hash of each full block
    state_slots: list[int] = field(default_factory=list)  # hybrid models: [current, spare] (runtime.state_slots)
    state_restore: int | None = None  # hybrid prefix caching: the checkpoint slot its state starts from
    state_checkpoint: tuple[int, int] | None = None  # hybrid prefix caching: (hash, slot) of its latest save
    num_released_blocks: int = 0  # leading block_ids given back out of a sliding window (a hint)
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    current_top_p: float = 1.0  # top-p after decay (reference 003's top_p_decay rule)
    logprobs: list[float] = field(default_factory=list)  # of each generated token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # when params.logprobs > 0
    cum_logprob: float = 0.0
    group: object = None  # the beam search or sample group this sequence belongs to, if any
    return_context_logits: bool = False
    return_generation_logits: bool = False
    priority: float = 0.5  # higher is admitted first; equal priorities keep arrival order
    lora: object = None  # the kiln.layers.lora.LoraAdapter its tokens run with, if any
    prompt_table: object = None  # its prompt-tuning table (kiln.runtime.prompt_tuning.PromptTable), if any
    in_flight: bool = False  # scheduled in a step whose results have not come back (pipeline parallelism)
    spec_tokens: list[int] = field(default_factory=list)  # proposed for the next step (speculative decoding)
    spec_limit: int | None = None  # the most tokens to propose next (follows what was kept; None: the config's)
    spec_misses: int = 0  # verifications in a row that kept nothing
    spec_pause: int = 0  # steps to decode plainly before proposing again (after misses)

    @property
    def cache_salt(self) -> object:
        """What its prefix blocks' hashes start from: K/V computed under an adapter, or from
        a prompt-tuning table's virtual tokens, is only theirs to share."""
        if self.lora is None and self.prompt_table is None:
            return None
        return (None if self.lora is None else self.lora.key,
                None if self.prompt_table is None else self.prompt_table.key)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.generator = self.params.make_generator()
        self.current_top_p = self.params.top_p

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_total_tokens(self) -> int:
        """The longest this sequence can become."""
        return min(self.num_prompt_tokens + self.params.max_tokens, self.max_seq_len)

    @property
    def stop_ids(self) -> list[int]:
        """Single tokens that end the sequence (held back while below min_tokens)."""
        ids = list(self.params.stop_token_ids)
        if self.end_id is not None and not self.params.ignore_eos:
            ids.append(self.end_id)
        return ids

    def append_token(self, token: int, logprob: float | None = None,
                     top_logprobs: dict[int, float] | None = None) -> None:
        """Add a generated token, update the sampling state, and decide whether the sequence is done."""
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.cum_logprob += logprob
        if top_logprobs is not None:
            self.top_logprobs.append(top_logprobs)
        p = self.params
        if p.top_p_decay < 1:
            self.current_top_p = p.top_p if token in p.top_p_reset_ids else max(
                self.current_top_p * p.top_p_decay, p.top_p_min)
        if token == self.end_id and not p.ignore_eos:
            self.finish_reason = FinishReason.END_ID
        elif token in p.stop_token_ids or self._ends_with_stop_word():
            self.finish_reason = FinishReason.STOP_WORDS
        elif self.num_output_tokens >= p.max_tokens or self.num_tokens >= self.max_seq_len:
            self.finish_reason = FinishReason.LENGTH

    def _ends_with_stop_word(self) -> bool:
        for word in self.params.stop_words_ids:
            n = len(word)
            if self.num_output_tokens >= 1 and self.token_ids[-n:] == word and n <= self.num_tokens:
                return True
        return False
