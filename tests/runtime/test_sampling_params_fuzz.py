"""Property tests over SamplingParams: any value either fails validation with a RequestError
naming a field, or runs through a whole step (biases, penalties, bans, sampling, the
sequence's own state) without an exception, drawing tokens inside the vocabulary with
log-probs that are never NaN. These are the inputs a server request turns into."""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.errors import RequestError
from kiln.runtime.logits_processors import TokenHistory, process_logits
from kiln.runtime.sampling import sample
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence

VOCAB = 24
MAX_SEQ_LEN = 64
FIELDS = ("max_tokens", "min_tokens", "n", "best_of", "temperature", "top_k", "top_p", "min_p", "top_p_decay",
          "top_p_min", "repetition_penalty", "presence_penalty", "frequency_penalty", "no_repeat_ngram_size",
          "logit_bias", "bad_words_ids", "stop_token_ids", "stop_words_ids", "stop", "logprobs", "seed",
          "length_penalty", "ignore_eos", "top_p_reset_ids")

# Numbers around every boundary: zero, tiny, huge, negative, inf, nan, 64-bit edges, and types that are wrong.
huge_ints = st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1, 2**80])
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), st.integers(-5, 50),
                    st.sampled_from([0.0, 1e-300, 1e-6, 1e-5, 2.0, 1e308, -1e308]), huge_ints)
token = st.integers(-2, VOCAB + 2)
token_lists = st.lists(st.one_of(token, st.lists(token, max_size=3)), max_size=4)
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.just([]))
unit = st.floats(0, 1)
# Plausible values (in or near each field's range), drawn three times as often as hostile ones.
plausible = {
    "max_tokens": st.one_of(st.integers(1, 8), huge_ints), "min_tokens": st.integers(0, 8), "n": st.integers(1, 3),
    "best_of": st.integers(1, 4), "temperature": st.sampled_from([0.0, 1e-300, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e308]),
    "top_k": st.one_of(st.integers(-1, VOCAB + 1), huge_ints), "top_p": unit, "min_p": unit, "top_p_decay": unit, "top_p_min": unit,
    "repetition_penalty": st.sampled_from([0.01, 0.5, 1.0, 1.3, 100.0]), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "no_repeat_ngram_size": st.one_of(st.integers(0, 4), huge_ints),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=VOCAB),
    "bad_words_ids": token_lists, "stop_words_ids": token_lists, "stop_token_ids": st.lists(token, max_size=3),
    "top_p_reset_ids": st.lists(token, max_size=3), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "logprobs": st.integers(0, 21), "seed": huge_ints, "length_penalty": st.floats(-10, 10),
    "ignore_eos": st.booleans(),
}
hostile = {
    "logit_bias": st.dictionaries(token, numbers, max_size=4), "bad_words_ids": token_lists,
    "stop_words_ids": token_lists, "stop": st.text(max_size=3),
}


@st.composite
def raw_params(draw) -> dict:
    chosen = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=10))
    if draw(st.integers(0, 2)):  # plausible values only: most of these pass validation and run
        return {name: draw(plausible[name]) for name in chosen}
    return {name: draw(st.one_of(plausible[name], hostile.get(name, numbers), junk)) for name in chosen}


def _validated(kwargs: dict) -> SamplingParams | None:
    try:
        params = SamplingParams(**kwargs)
        params.validate(vocab_size=VOCAB)
    except RequestError as e:
        assert str(e).split()[0].rstrip(":") in FIELDS or " must " in str(e), e  # names what is wrong
        return None
    return params


@given(kwargs=raw_params(), logits_seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.0, 1.0, 30.0]))
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          database=None)
def test_valid_params_survive_a_step_and_invalid_ones_name_a_field(kwargs, logits_seed, scale):
    params = _validated(kwargs)
    if params is None:
        return
    if params.logprobs is None:  # report log-probs: they reach clients as JSON, where NaN is no number
        params.logprobs = 0
    history = TokenHistory(MAX_SEQ_LEN, VOCAB)
    seqs = [Sequence(i, [1, 2, 3, 2], params if i else SamplingParams(temperature=0.7, seed=i), end_id=0,
                     max_seq_len=MAX_SEQ_LEN) for i in range(2)]
    g = torch.Generator().manual_seed(logits_seed)
    for _ in range(min(params.max_tokens, 6)):
        live = [s for s in seqs if not s.is_finished]
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=g) * scale  # scale 0: every logit ties
        out = sample(process_logits(logits, live, history), live)
        tokens = out.tokens.tolist()
        assert all(0 <= t < VOCAB for t in tokens), tokens
        if out.logprobs is not None:
            assert not any(math.isnan(lp) for lp in out.logprobs.tolist()), out.logprobs
        for seq, t in zip(live, tokens):
            seq.append_token(t, None if out.logprobs is None else float(out.logprobs[live.index(seq)]))


@given(seed=st.integers(-2**63, 2**64 - 1))
@settings(max_examples=50, deadline=None, database=None)
def test_every_64_bit_seed_seeds_a_generator_and_each_sample_its_own(seed):
    params = SamplingParams(temperature=1.0, seed=seed)
    assert params.make_generator() is not None
    assert params.seed_for(0) == seed % 2**64 and params.seed_for(1) == (seed + 1) % 2**64
    SamplingParams(temperature=1.0, seed=params.seed_for(1))  # still a valid seed past 2**64 - 1


def test_seed_outside_64_bits_is_refused_naming_it():
    for seed in (2**64, -2**63 - 1, 1208925819614629174706176):
        try:
            SamplingParams(seed=seed)
        except RequestError as e:
            assert str(e).startswith("seed must be")
        else:
            raise AssertionError(f"seed {seed} accepted")
