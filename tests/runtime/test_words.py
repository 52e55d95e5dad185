"""Reference 003's stop/bad words encoding, and request validation (SamplingParams, SamplingConfig).

The words tensor layout is checked against the document's own example (tokens row, then the
exclusive prefix sum of word lengths padded with -1), its "+1" rule for single-token words,
the per-sequence ``[batch, 2, len]`` form and the tool's inclusive-ends variant. Every bad
request must raise :class:`RequestError` naming the field (or list) and what is allowed.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import RequestError
from kiln.runtime.sampling import SamplingConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.words import decode_batch_words, decode_words, encode_words

DOC_WORDS = [[5, 7, 3], [9, 2], [6, 2, 4, 1]]
DOC_TENSOR = [[5, 7, 3, 9, 2, 6, 2, 4, 1],
              [0, 3, 5, 9, -1, -1, -1, -1, -1]]


# -- encoding ---------------------------------------------------------------------------------


def test_encode_matches_the_documents_example():
    encoded = encode_words(DOC_WORDS)
    assert encoded.shape == (2, 9)
    assert encoded.tolist() == DOC_TENSOR
    assert decode_words(encoded) == DOC_WORDS
    assert decode_words(torch.tensor(DOC_TENSOR, dtype=torch.int32)) == DOC_WORDS


def test_single_token_words_need_one_more_column():
    """Four single-token words: shape [2, 5] (the document's +1 rule), token row padded with -1."""
    words = [[11], [3], [42], [0]]
    encoded = encode_words(words)
    assert encoded.shape == (2, 5)
    assert encoded.tolist() == [[11, 3, 42, 0, -1], [0, 1, 2, 3, 4]]
    assert decode_words(encoded) == words


def test_empty_list_round_trips():
    assert decode_words(encode_words([])) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=6), max_size=8))
def test_round_trip(words):
    encoded = encode_words(words)
    tokens = sum(len(w) for w in words)
    assert encoded.shape == (2, max(tokens, len(words) + 1))
    assert encoded[0, :tokens].tolist() == [t for w in words for t in w]
    assert decode_words(encoded) == words


def test_inclusive_ends_variant_decodes_the_same():
    """The tool's output omits the leading 0: offsets [3, 5, 9] are the words' inclusive ends."""
    inclusive = torch.tensor([[5, 7, 3, 9, 2, 6, 2, 4, 1],
                              [3, 5, 9, -1, -1, -1, -1, -1, -1]], dtype=torch.int32)
    assert decode_words(inclusive) == DOC_WORDS
    singles = torch.tensor([[11, 3, 42, 0], [1, 2, 3, 4]], dtype=torch.int32)
    assert decode_words(singles) == [[11], [3], [42], [0]]


def test_per_sequence_lists():
    lists = [DOC_WORDS, [[8]], [[1, 2], [3]]]
    width = max(encode_words(w).shape[1] for w in lists)
    batch = torch.full((3, 2, width), -1, dtype=torch.int32)
    for b, words in enumerate(lists):
        encoded = encode_words(words)
        batch[b, :, : encoded.shape[1]] = encoded
    assert decode_batch_words(batch, 3, "bad_words_list") == lists
    # A [2, len] list is shared by every sequence; None gives empty lists.
    assert decode_batch_words(encode_words(DOC_WORDS), 2, "stop_words_list") == [DOC_WORDS, DOC_WORDS]
    assert decode_batch_words(None, 2, "stop_words_list") == [[], []]


def raises_naming(*fragments: str):
    """``pytest.raises(RequestError)`` whose message must contain every fragment."""
    return pytest.raises(RequestError, match=".*".join(re.escape(f) for f in fragments))


@pytest.mark.parametrize("tensor, what", [
    (torch.tensor([5, 7, 3]), "[2, len]"),  # 1-D
    (torch.zeros(3, 4, dtype=torch.int32), "[2, len]"),  # three rows
    ([[5, 7], [0, 2]], "[2, len]"),  # not a tensor
    (torch.tensor([[5, 7, 3, 9, 2], [0, 3, 2, 5, -1]]), "offsets"),  # decreasing offsets
    (torch.tensor([[5, 7, 3, 9, 2], [0, 3, 3, 5, -1]]), "offsets"),  # an empty word
    (torch.tensor([[5, 7, 3, 9, 2], [0, 3, 7, -1, -1]]), "offsets"),  # past the tokens
    (torch.tensor([[5, -1, 3, 9, 2], [0, 3, 5, -1, -1]]), "negative token"),  # padding inside a word
])
def test_malformed_lists_raise_naming_the_list(tensor, what):
    with raises_naming("bad_words_list", what):
        decode_words(tensor, "bad_words_list")


def test_malformed_per_sequence_lists_name_the_sequence():
    batch = torch.stack([encode_words([[1, 2], [3]]), torch.tensor([[1, 2, 3], [0, 2, 9]], dtype=torch.int32)])
    with raises_naming("stop_words_list[1]", "offsets"):
        decode_batch_words(batch, 2, "stop_words_list")
    with raises_naming("stop_words_list", "2 lists for a batch of 3"):
        decode_batch_words(batch, 3, "stop_words_list")


def test_encode_rejects_an_empty_word():
    with pytest.raises(RequestError, match="at least one token"):
        encode_words([[1], []])


# -- SamplingParams validation ------------------------------------------------------------------


INVALID = [  # (field values, fragments the message must contain: the field and its allowed range)
    (dict(temperature=-0.1), ["temperature", ">= 0"]),
    (dict(temperature=float("nan")), ["temperature", ">= 0"]),
    (dict(top_p=0.0), ["top_p", "(0, 1]"]),
    (dict(top_p=1.01), ["top_p", "(0, 1]"]),
    (dict(top_k=-2), ["top_k", "0 or -1"]),
    (dict(top_k=2.5), ["top_k", "integer"]),
    (dict(min_p=-0.01), ["min_p", "[0, 1]"]),
    (dict(min_p=1.5), ["min_p", "[0, 1]"]),
    (dict(repetition_penalty=0.0), ["repetition_penalty", "[0.01, 100"]),
    (dict(repetition_penalty=-1.0), ["repetition_penalty", "[0.01, 100"]),
    (dict(repetition_penalty=1e6), ["repetition_penalty", "[0.01, 100"]),
    (dict(seed=2**64), ["seed", "64-bit"]),
    (dict(length_penalty=50.0), ["length_penalty", "[-10, 10]"]),
    (dict(logit_bias={3: 101.0}), ["logit_bias", "[-100, 100]"]),
    (dict(presence_penalty=2.5), ["presence_penalty", "[-2, 2]"]),
    (dict(presence_penalty=-2.01), ["presence_penalty", "[-2, 2]"]),
    (dict(frequency_penalty=-3), ["frequency_penalty", "[-2, 2]"]),
    (dict(frequency_penalty=2.1), ["frequency_penalty", "[-2, 2]"]),
    (dict(no_repeat_ngram_size=-1), ["no_repeat_ngram_size", ">= 0"]),
    (dict(bad_words_ids=[[1, 2], []]), ["bad_words_ids", "non-empty lists of token ids >= 0"]),
    (dict(bad_words_ids=[[1, -3]]), ["bad_words_ids", "token ids >= 0"]),
    (dict(bad_words_ids=[["a"]]), ["bad_words_ids", "token ids"]),
    (dict(bad_words_ids=5), ["bad_words_ids", "list"]),
    (dict(min_tokens=20, max_tokens=10), ["min_tokens", "[0, max_tokens=10]"]),
    (dict(min_tokens=-1), ["min_tokens", "[0, max_tokens"]),
    (dict(logprobs=21), ["logprobs", "[0, 20]"]),
    (dict(logprobs=-1), ["logprobs", "[0, 20]"]),
    (dict(prompt_logprobs=25), ["prompt_logprobs", "[0, 20]"]),
    (dict(early_stopping="sometimes"), ["early_stopping", "True, False or 'never'"]),
    (dict(early_stopping=None), ["early_stopping", "True, False or 'never'"]),
    (dict(n=3, best_of=2), ["best_of", ">= n (3)"]),
    (dict(top_p_decay=0.0), ["top_p_decay", "(0, 1]"]),
    (dict(top_p_min=0.0), ["top_p_min", "(0, 1]"]),
    (dict(logit_bias={3: float("inf")}), ["logit_bias", "[-100, 100]"]),
    (dict(stop_token_ids=[-1]), ["stop_token_ids", ">= 0"]),
    (dict(embedding_bias=torch.zeros(2, 3)), ["embedding_bias", "1-D"]),
]


@pytest.mark.parametrize("fields, fragments", INVALID, ids=[f"{next(iter(f))}={list(f.values())[-1]!r}"
                                                            for f, _ in INVALID])
def test_invalid_sampling_params_raise_naming_field_and_range(fields, fragments):
    with raises_naming(*fragments):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields, field_name", [
    (dict(logit_bias={100: 1.0}), "logit_bias"),
    (dict(bad_words_ids=[[1, 2], [3, 150]]), "bad_words_ids"),
    (dict(stop_token_ids=[100]), "stop_token_ids"),
    (dict(stop_words_ids=[[5, 1000]]), "stop_words_ids"),
    (dict(top_p_reset_ids=[7, 100]), "top_p_reset_ids"),
])
def test_token_ids_outside_the_vocabulary_raise_naming_the_field(fields, field_name):
    params = SamplingParams(**fields)  # fine without a vocabulary
    with raises_naming(field_name, "[0, 100)"):
        params.validate(vocab_size=100)
    params.validate(vocab_size=2000)


def test_embedding_bias_of_the_wrong_length():
    params = SamplingParams(embedding_bias=torch.zeros(50))
    with raises_naming("embedding_bias", "vocab_size 64", "50"):
        params.validate(vocab_size=64)
    params.validate(vocab_size=50)


def test_valid_edge_values_are_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   logprobs=20, min_tokens=16, max_tokens=16, early_stopping="never", n=2, best_of=2,
                   bad_words_ids=[[0], [1, 2]]).validate(vocab_size=3)


# -- SamplingConfig -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
                                  "min_length", "random_seed", "no_repeat_ngram_size"])
def test_sampling_config_per_sequence_list_of_wrong_length(name):
    value = {"temperature": [0.5, 0.7, 0.9], "top_k": [1, 2, 3], "top_p": [0.5, 0.6, 0.7],
             "repetition_penalty": [1.1, 1.2, 1.3], "presence_penalty": [0.1, 0.2, 0.3],
             "min_length": [1, 2, 3], "random_seed": [1, 2, 3], "no_repeat_ngram_size": [1, 2, 3]}[name]
    config = SamplingConfig(**{name: value})
    with raises_naming(f"SamplingConfig.{name}", "3 values for a batch of 2"):
        config.per_sequence(2, 8)
    assert len(config.per_sequence(3, 8)) == 3  # the right length works...
    one = SamplingConfig(**{name: value[:1]}).per_sequence(4, 8)  # ...and so does one shared value
    assert len(one) == 4


def test_sampling_config_lists_give_each_sequence_its_value():
    params = SamplingConfig(temperature=[0.5, 0.9], top_k=[5, 0], top_p=[0.0, 0.8]).per_sequence(2, 8)
    assert [p.temperature for p in params] == [0.5, 0.9]
    assert [p.top_k for p in params] == [5, 0]
    assert [p.top_p for p in params] == [1.0, 0.8]
    # top_k == 0 and top_p == 0 mean greedy.
    assert SamplingConfig(top_k=0, top_p=0.0).per_sequence(1, 4)[0].is_greedy


def test_sampling_config_invalid_value_names_the_sequence_and_field():
    with raises_naming("sequence 1", "temperature", ">= 0"):
        SamplingConfig(temperature=[0.5, -1.0], top_k=5).per_sequence(2, 8)
    with raises_naming("sequence 0", "top_p", "(0, 1]"):
        SamplingConfig(top_p=[1.5, 0.5]).per_sequence(2, 8)
    with raises_naming("sequence 1", "repetition_penalty", "in"):
        SamplingConfig(repetition_penalty=[1.0, 0.0]).per_sequence(2, 8)
    with raises_naming("SamplingConfig.beam_width", ">= 1"):
        SamplingConfig(beam_width=0).per_sequence(1, 8)
