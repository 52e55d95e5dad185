"""Logits controls and the sampler against references nobody here wrote.

Every test runs a batch whose rows carry DIFFERENT parameters and histories, so the
batched code paths (row subsets, per-row gathers, grouped n-gram sizes) are exercised; each
row must equal its own reference:

* repetition penalty, no-repeat n-gram, bad words, min new tokens: Hugging Face
  ``transformers.generation.logits_process`` processors, applied one row at a time;
* presence/frequency penalties: OpenAI's documented formula
  ``logit - frequency * count - presence * (count > 0)`` over the generated tokens only;
* temperature/top-k/top-p/min-p: HF's warper chain, compared on the kept set and, through
  seeded draws, on the distribution (chi-square);
* top-p decay: reference 003 / "Factuality Enhanced Language Models" rule, by hand.
"""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from torch.testing import assert_close
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kiln.runtime.logits_processors import TokenHistory, process_logits
from kiln.runtime.sampling import apply_top_k_top_p, sample
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence

MAX_SEQ_LEN = 512
NEG_INF = float("-inf")


# -- helpers ----------------------------------------------------------------------------------


def make_seq(seq_id: int, prompt: list[int], output: list[int], params: SamplingParams,
             end_id: int | None = None) -> Sequence:
    seq = Sequence(seq_id, list(prompt) + list(output), params, end_id, MAX_SEQ_LEN)
    seq.num_prompt_tokens = len(prompt)
    return seq


def kiln_process(logits: torch.Tensor, seqs: list[Sequence], history: TokenHistory | None = None) -> torch.Tensor:
    return process_logits(logits.clone(), seqs, history or TokenHistory(MAX_SEQ_LEN))


def hf(processor, ids: list[int], row: torch.Tensor) -> torch.Tensor:
    """One HF processor on one row: ``input_ids`` ``[1, len]``, ``scores`` ``[1, vocab]``."""
    return processor(torch.tensor([ids], dtype=torch.long), row[None].clone())[0]


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def random_tokens(rng: random.Random, n: int, alphabet: int) -> list[int]:
    return [rng.randrange(alphabet) for _ in range(n)]


def presence_frequency_reference(row: torch.Tensor, output: list[int], presence: float,
                                 frequency: float) -> torch.Tensor:
    """OpenAI: ``mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence`` over generated tokens."""
    out = row.clone()
    for token, count in Counter(output).items():
        out[token] = out[token] - count * frequency - presence
    return out


# -- repetition penalty -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_repetition_penalty_matches_hf_over_prompt_and_output(seed):
    rng = random.Random(seed)
    vocab = rng.randint(50, 300)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.05, rng.uniform(0.3, 3.0)]
    logits = random_logits(len(penalties), vocab, seed)
    seqs = []
    for i, penalty in enumerate(penalties):
        alphabet = rng.choice([vocab, 20])  # some rows repeat tokens a lot
        prompt = random_tokens(rng, rng.randint(1, 60), alphabet)
        output = random_tokens(rng, rng.randint(0, 40), alphabet)
        seqs.append(make_seq(i, prompt, output, SamplingParams(repetition_penalty=penalty)))
    got = kiln_process(logits, seqs)
    for i, (seq, penalty) in enumerate(zip(seqs, penalties)):
        want = hf(RepetitionPenaltyLogitsProcessor(penalty), seq.token_ids, logits[i])
        assert_close(got[i], want, msg=f"row {i} (penalty {penalty})")
        if penalty != 1.0:
            assert not torch.equal(got[i], logits[i])  # the row was really penalised


def test_repetition_penalty_counts_prompt_tokens_too():
    """A token seen only in the prompt is penalised (HF/CTRL rule), unlike presence/frequency."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    seq = make_seq(0, [0, 1], [2], SamplingParams(repetition_penalty=2.0))
    assert kiln_process(logits, [seq]).tolist() == [[1.0, -4.0, 0.5, 3.0]]


# -- no-repeat n-gram -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_no_repeat_ngram_matches_hf(seed):
    rng = random.Random(100 + seed)
    vocab = rng.randint(50, 300)
    sizes = [0, 1, 2, 3, 4, 2, 3, rng.randint(1, 5)]
    logits = random_logits(len(sizes), vocab, seed)
    seqs = []
    for i, size in enumerate(sizes):
        alphabet = rng.choice([4, 6, 10])  # small alphabets make repeated n-grams likely
        prompt = random_tokens(rng, rng.randint(1, 30), alphabet)
        output = random_tokens(rng, rng.randint(0, 30), alphabet)
        if i == 6:
            prompt, output = [1], []  # shorter than the n-gram: nothing to ban
        seqs.append(make_seq(i, prompt, output, SamplingParams(no_repeat_ngram_size=size)))
    got = kiln_process(logits, seqs)
    banned_somewhere = False
    for i, (seq, size) in enumerate(zip(seqs, sizes)):
        want = logits[i] if size == 0 else hf(NoRepeatNGramLogitsProcessor(size), seq.token_ids, logits[i])
        assert_close(got[i], want, msg=f"row {i} (ngram size {size}, tokens {seq.token_ids})")
        banned_somewhere |= bool(torch.isinf(want).any())
    assert banned_somewhere


# -- bad words --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_bad_words_single_and_multi_token_match_hf(seed):
    rng = random.Random(200 + seed)
    vocab = rng.randint(50, 300)
    eos = vocab - 1  # never among the words
    num_rows = 7
    logits = random_logits(num_rows, vocab, seed)
    seqs, words_per_row = [], []
    for i in range(num_rows):
        words = []
        if i != 0:  # row 0 bans nothing
            for _ in range(rng.randint(1, 4)):
                words.append(random_tokens(rng, rng.choice([1, 1, 2, 3, 4]), vocab - 1))
        history = random_tokens(rng, rng.randint(1, 25), vocab - 1)
        multi = [w for w in words if len(w) > 1]
        if multi and rng.random() < 0.7:  # end the history with a word's whole prefix...
            word = rng.choice(multi)
            cut = 0 if rng.random() < 0.8 else 1  # ...or only part of it
            history += word[cut:-1]
        split = rng.randint(0, len(history) - 1)
        seqs.append(make_seq(i, history[:split + 1], history[split + 1:], SamplingParams(bad_words_ids=words)))
        words_per_row.append(words)
    # One row surely exercises the multi-token rule: its history ends with the prefix [3, 4].
    words_per_row[-1] = [[3, 4, 5], [6]]
    seqs[-1] = make_seq(num_rows - 1, [9, 3], [4], SamplingParams(bad_words_ids=words_per_row[-1]))
    got = kiln_process(logits, seqs)
    for i, (seq, words) in enumerate(zip(seqs, words_per_row)):
        want = logits[i] if not words else hf(NoBadWordsLogitsProcessor(words, eos_token_id=eos),
                                              seq.token_ids, logits[i])
        assert_close(got[i], want, msg=f"row {i} (words {words}, tokens {seq.token_ids})")
    assert got[-1, 5] == NEG_INF and got[-1, 6] == NEG_INF


def test_multi_token_bad_word_needs_its_whole_prefix():
    logits = torch.zeros(3, 10)
    words = [[1, 2, 3]]
    seqs = [make_seq(0, [1], [2], SamplingParams(bad_words_ids=words)),  # prefix matches: ban 3
            make_seq(1, [2], [2], SamplingParams(bad_words_ids=words)),  # only the last prefix token
            make_seq(2, [2], [], SamplingParams(bad_words_ids=words))]  # shorter than the prefix
    got = kiln_process(logits, seqs)
    assert torch.isinf(got[0]).nonzero().flatten().tolist() == [3]
    assert not torch.isinf(got[1:]).any()


# -- min_tokens -------------------------------------------------------------------------------


def test_min_tokens_matches_hf_min_new_tokens():
    # (prompt len, output len, min_tokens, end_id, stop_token_ids, ignore_eos)
    cases = [(5, 0, 3, 7, [], False), (5, 3, 3, 7, [], False), (2, 2, 5, 7, [9, 11], False),
             (4, 1, 0, 7, [], False), (3, 1, 4, None, [3], False), (6, 0, 2, 7, [8], True),
             (1, 4, 5, 0, [], False), (8, 9, 5, 12, [2], False)]
    rng = random.Random(7)
    vocab = 64
    logits = random_logits(len(cases), vocab, 7)
    seqs, eos_lists = [], []
    for i, (n_prompt, n_out, min_tokens, end_id, stops, ignore_eos) in enumerate(cases):
        params = SamplingParams(min_tokens=min_tokens, stop_token_ids=stops, ignore_eos=ignore_eos, max_tokens=32)
        seqs.append(make_seq(i, random_tokens(rng, n_prompt, 20), random_tokens(rng, n_out, 20), params, end_id))
        eos = ([] if end_id is None or ignore_eos else [end_id]) + stops
        eos_lists.append(eos)
        assert sorted(seqs[-1].stop_ids) == sorted(eos)
    got = kiln_process(logits, seqs)
    for i, (seq, (n_prompt, _, min_tokens, *_), eos) in enumerate(zip(seqs, cases, eos_lists)):
        want = hf(MinNewTokensLengthLogitsProcessor(n_prompt, min_tokens, eos), seq.token_ids, logits[i])
        assert_close(got[i], want, msg=f"row {i} case {cases[i]}")
    assert torch.isinf(got[0, 7]) and not torch.isinf(got[1]).any()  # the boundary: 3 generated, min 3


# -- presence / frequency -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_presence_frequency_follow_openai_formula_over_output_only(seed):
    rng = random.Random(300 + seed)
    vocab = rng.randint(50, 300)
    settings = [(0.0, 0.0), (0.5, 0.0), (0.0, 0.7), (1.2, 0.3), (-0.5, 1.5), (2.0, -2.0),
                (rng.uniform(-2, 2), rng.uniform(-2, 2))]
    logits = random_logits(len(settings), vocab, seed)
    seqs = []
    for i, (presence, frequency) in enumerate(settings):
        prompt = random_tokens(rng, rng.randint(1, 40), vocab)
        output = random_tokens(rng, rng.randint(0, 40), 15)  # repeats, so counts exceed 1
        seqs.append(make_seq(i, prompt, output,
                             SamplingParams(presence_penalty=presence, frequency_penalty=frequency)))
    got = kiln_process(logits, seqs)
    for i, (seq, (presence, frequency)) in enumerate(zip(seqs, settings)):
        want = presence_frequency_reference(logits[i], seq.output_token_ids, presence, frequency)
        assert_close(got[i], want, msg=f"row {i} presence {presence} frequency {frequency}")


def test_presence_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 6)
    seq = make_seq(0, [0, 0, 1], [1, 2, 2, 2], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert kiln_process(logits, [seq])[0].tolist() == [0.0, -0.75, -1.25, 0.0, 0.0, 0.0]


# -- biases -----------------------------------------------------------------------------------


def test_logit_bias_and_embedding_bias_are_added_as_given():
    vocab = 97
    logits = random_logits(5, vocab, 11)
    g = torch.Generator().manual_seed(12)
    emb_a, emb_b = torch.randn(vocab, generator=g), torch.randn(vocab, generator=g)
    biases = [({}, None), ({3: 5.0, 40: -7.5, 96: 0.25}, None), ({}, emb_a), ({0: -100.0, 3: 2.0}, emb_b),
              ({10: 1.0}, None)]
    seqs = [make_seq(i, [1, 2], [], SamplingParams(logit_bias=dict(lb), embedding_bias=eb))
            for i, (lb, eb) in enumerate(biases)]
    got = kiln_process(logits, seqs)
    for i, (lb, eb) in enumerate(biases):
        want = logits[i].clone()
        if eb is not None:
            want += eb
        for token, value in lb.items():
            want[token] += value
        assert_close(got[i], want, msg=f"row {i}")


# -- all controls together, in the documented order -----------------------------------------


def documented_order_reference(row: torch.Tensor, seq: Sequence, eos: list[int]) -> torch.Tensor:
    p = seq.params
    ids = seq.token_ids
    out = row.clone()
    if p.embedding_bias is not None:  # 1. biases
        out += p.embedding_bias
    for token, value in p.logit_bias.items():
        out[token] += value
    out = hf(RepetitionPenaltyLogitsProcessor(p.repetition_penalty), ids, out)  # 2. repetition
    out = presence_frequency_reference(out, seq.output_token_ids, p.presence_penalty,  # 3. OpenAI
                                       p.frequency_penalty)
    if p.bad_words_ids:  # 4. bans
        out = hf(NoBadWordsLogitsProcessor(p.bad_words_ids, eos_token_id=eos[0]), ids, out)
    if p.no_repeat_ngram_size:
        out = hf(NoRepeatNGramLogitsProcessor(p.no_repeat_ngram_size), ids, out)
    return hf(MinNewTokensLengthLogitsProcessor(seq.num_prompt_tokens, p.min_tokens, eos), ids, out)


def test_combined_controls_apply_in_the_documented_order():
    vocab = 80
    end_id = 79
    logits = random_logits(3, vocab, 21)
    logits[0, 13] = 4.0  # a seen token with a positive logit: order of bias/penalties shows on it
    emb = torch.randn(vocab, generator=torch.Generator().manual_seed(22))
    prompt, output = [5, 8, 9, 5, 8], [12, 5, 13, 12]
    full = SamplingParams(logit_bias={13: 1.5, 12: -0.5, 30: 2.0}, embedding_bias=emb, repetition_penalty=1.4,
                          presence_penalty=0.6, frequency_penalty=0.4, no_repeat_ngram_size=2,
                          bad_words_ids=[[13, 12, 20], [31], [9, 44]], min_tokens=6, max_tokens=20)
    seqs = [make_seq(0, prompt, output, full, end_id),
            make_seq(1, [1, 2, 3], [4], SamplingParams(repetition_penalty=0.8, min_tokens=1), end_id),
            make_seq(2, [7, 7], [7, 6], SamplingParams(frequency_penalty=1.0, bad_words_ids=[[7, 6, 3]]), end_id)]
    got = kiln_process(logits, seqs)
    for i, seq in enumerate(seqs):
        assert_close(got[i], documented_order_reference(logits[i], seq, [end_id]), msg=f"row {i}")
    # Row 0: what each control contributed is visible.
    assert got[0, 20] == NEG_INF and got[0, 31] == NEG_INF and got[0, end_id] == NEG_INF  # bad words, min_tokens
    assert got[0, 5] == NEG_INF  # the bigram (12, 5) already occurred: 5 may not follow the last 12
    expected_13 = (4.0 + emb[13] + 1.5) / 1.4 - 0.4 * 1 - 0.6  # bias, repetition, frequency x1, presence
    assert math.isclose(float(got[0, 13]), float(expected_13), rel_tol=1e-5)
    # The order matters: penalising before biasing would give another value.
    assert not math.isclose(float(got[0, 13]), float((4.0 + emb[13]) / 1.4 + 1.5 - 0.4 - 0.6), rel_tol=1e-3)
    assert not math.isclose(float(got[0, 13]), float((4.0 + emb[13] + 1.5 - 0.4 - 0.6) / 1.4), rel_tol=1e-3)


# -- sampling: temperature, top-k, top-p, min-p vs the HF warper chain ------------------------


def hf_warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """HF's chain in ``generate``'s order: temperature, top-k, top-p, min-p."""
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = row[None].clone()
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return scores[0]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs``; a zero-probability token seen is an outright failure."""
    probs = probs.double()
    n = counts.sum().double()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    support = probs > 0
    expected = n * probs[support]
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("seed", range(6))
def test_top_k_top_p_mask_equals_hf_kept_set(seed):
    rng = random.Random(400 + seed)
    vocab = rng.randint(50, 300)
    rows = 6
    logits = random_logits(rows, vocab, seed, scale=2.0)
    ks = [rng.choice([vocab, rng.randint(1, vocab)]) for _ in range(rows)]
    ps = [rng.choice([1.0, rng.uniform(0.05, 0.99)]) for _ in range(rows)]
    got = apply_top_k_top_p(logits.clone(), torch.tensor(ks), torch.tensor(ps))
    for i in range(rows):
        want = hf_warp(logits[i], 1.0, ks[i] if ks[i] < vocab else 0, ps[i], 0.0)
        assert torch.isfinite(got[i]).tolist() == torch.isfinite(want).tolist(), f"row {i} k={ks[i]} p={ps[i]}"
        kept = torch.isfinite(want)
        assert_close(got[i][kept], logits[i][kept])


SAMPLE_ROWS = [  # (temperature, top_k, top_p, min_p)
    (0.7, 8, 1.0, 0.0),
    (1.3, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.9, 20, 0.8, 0.05),
    (1.6, 30, 0.9, 0.2),
]


def test_sample_draws_match_hf_warpers_in_set_and_distribution():
    vocab, draws = 120, 4000
    logits = random_logits(len(SAMPLE_ROWS) + 1, vocab, 31, scale=1.5)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1000 + i)
              for i, (t, k, p, m) in enumerate(SAMPLE_ROWS)]
    params.append(SamplingParams(temperature=0.0))  # a greedy row shares the batch
    seqs = [make_seq(i, [1], [], p) for i, p in enumerate(params)]
    counts = torch.zeros(len(seqs), vocab, dtype=torch.long)
    for _ in range(draws):
        tokens = sample(logits.clone(), seqs).tokens
        counts[torch.arange(len(seqs)), tokens] += 1
    assert counts[-1, logits[-1].argmax()] == draws  # greedy: always the argmax
    for i, (t, k, p, m) in enumerate(SAMPLE_ROWS):
        warped = hf_warp(logits[i], t, k, p, m)
        hf_probs = warped.softmax(-1)
        kept = torch.isfinite(warped)
        # Preconditions that make the checks below meaningful: every kept token is expected
        # often enough to be seen, and truncation removes real mass.
        assert draws * hf_probs[kept].min() >= 10, f"row {i}: a kept token is too rare for the test"
        unfiltered = (logits[i] / t).softmax(-1)
        assert unfiltered[~kept].sum() > 0.05, f"row {i}: truncation removes too little mass"
        drawn = counts[i] > 0
        assert drawn.tolist() == kept.tolist(), f"row {i}: drawable set differs from HF's kept set"
        p_value = chi_square_p_value(counts[i], hf_probs)
        assert p_value > 1e-3, f"row {i}: draws do not follow HF's distribution (p={p_value:.2e})"
        # The test would catch a sampler that ignored the filters (or the temperature).
        assert chi_square_p_value(counts[i], unfiltered) < 1e-6
        assert chi_square_p_value(counts[i], logits[i].softmax(-1)) < 1e-6


def test_chi_square_rejects_a_wrongly_tempered_but_same_support_distribution():
    """Same kept set, wrong temperature: the distribution check alone must catch it."""
    vocab, draws = 60, 4000
    logits = random_logits(1, vocab, 41, scale=1.5)
    seq = make_seq(0, [1], [], SamplingParams(temperature=1.0, top_k=6, seed=5))
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(draws):
        counts[sample(logits.clone(), [seq]).tokens[0]] += 1
    assert chi_square_p_value(counts, hf_warp(logits[0], 1.0, 6, 1.0, 0.0).softmax(-1)) > 1e-3
    assert chi_square_p_value(counts, hf_warp(logits[0], 0.5, 6, 1.0, 0.0).softmax(-1)) < 1e-6


def test_sample_uses_the_sequences_decayed_top_p():
    vocab = 100
    logits = random_logits(1, vocab, 51, scale=2.0)
    seq = make_seq(0, [1], [], SamplingParams(top_p=0.95, top_p_decay=0.5, seed=3))
    seq.current_top_p = 0.3  # as if decayed
    kept = torch.isfinite(hf_warp(logits[0], 1.0, 0, 0.3, 0.0))
    assert kept.sum() < torch.isfinite(hf_warp(logits[0], 1.0, 0, 0.95, 0.0)).sum()
    drawn = {int(sample(logits.clone(), [seq]).tokens[0]) for _ in range(500)}
    assert drawn <= set(kept.nonzero().flatten().tolist())
    assert len(drawn) == int(kept.sum())


# -- top-p decay ------------------------------------------------------------------------------


def test_top_p_decay_follows_reference_rule():
    params = SamplingParams(top_p=0.9, top_p_decay=0.5, top_p_min=0.2, top_p_reset_ids=[7], max_tokens=50)
    seq = make_seq(0, [1, 2], [], params)
    assert seq.current_top_p == pytest.approx(0.9)
    seen = []
    for token in [3, 4, 5, 7, 3]:
        seq.append_token(token)
        seen.append(seq.current_top_p)
    assert seen == pytest.approx([0.45, 0.225, 0.2, 0.9, 0.45])
    assert not seq.is_finished


def test_no_decay_keeps_top_p():
    seq = make_seq(0, [1], [], SamplingParams(top_p=0.8, top_p_reset_ids=[7], max_tokens=10))
    for token in [3, 7, 4]:
        seq.append_token(token)
    assert seq.current_top_p == pytest.approx(0.8)


# -- TokenHistory -----------------------------------------------------------------------------


def check_history(history: TokenHistory, seqs: list[Sequence]) -> None:
    tokens, lengths = history.batch(seqs)
    assert lengths.tolist() == [s.num_tokens for s in seqs]
    for row, seq in zip(tokens.tolist(), seqs):
        assert row[: seq.num_tokens] == seq.token_ids
        assert all(t == 0 for t in row[seq.num_tokens:])


def test_token_history_follows_growth_reset_and_rewind():
    rng = random.Random(61)
    history = TokenHistory(MAX_SEQ_LEN)
    seqs = [make_seq(i, random_tokens(rng, rng.randint(1, 20), 50), [], SamplingParams(repetition_penalty=1.2))
            for i in range(3)]
    check_history(history, seqs)
    for step in range(15):  # grow at different paces
        for i, seq in enumerate(seqs):
            if step % (i + 1) == 0:
                seq.token_ids.append(rng.randrange(50))
        check_history(history, seqs)
        check_history(history, seqs[1:])  # a subset of the batch
    # Token list replaced by one of the same length: reset tells the history.
    seqs[0].token_ids = [rng.randrange(50) for _ in range(seqs[0].num_tokens)]
    history.reset(seqs[0])
    check_history(history, seqs)
    # Replaced by a longer list.
    seqs[1].token_ids = [rng.randrange(50) for _ in range(seqs[1].num_tokens + 7)]
    history.reset(seqs[1])
    check_history(history, seqs)
    # Rewound (shorter) without a reset: detected from the length.
    seqs[2].token_ids = seqs[2].token_ids[:3]
    check_history(history, seqs)
    seqs[2].token_ids += [49, 48]
    check_history(history, seqs)


def test_processing_stays_right_across_steps_with_a_shared_history():
    """Engine-like use: one TokenHistory, sequences grow step by step, one is replaced midway."""
    rng = random.Random(71)
    vocab = 90
    history = TokenHistory(MAX_SEQ_LEN)
    params = [SamplingParams(repetition_penalty=1.5, no_repeat_ngram_size=2),
              SamplingParams(no_repeat_ngram_size=3, bad_words_ids=[[4, 5], [6, 7, 8]]),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.5),
              SamplingParams(repetition_penalty=0.9)]
    seqs = [make_seq(i, random_tokens(rng, rng.randint(2, 10), 10), [], p) for i, p in enumerate(params)]
    for step in range(12):
        logits = random_logits(len(seqs), vocab, 1000 + step)
        got = process_logits(logits.clone(), seqs, history)
        for i, seq in enumerate(seqs):
            p, ids = seq.params, seq.token_ids
            want = logits[i]
            want = hf(RepetitionPenaltyLogitsProcessor(p.repetition_penalty), ids, want)
            want = presence_frequency_reference(want, seq.output_token_ids, p.presence_penalty, p.frequency_penalty)
            if p.bad_words_ids:
                want = hf(NoBadWordsLogitsProcessor(p.bad_words_ids, eos_token_id=vocab - 1), ids, want)
            if p.no_repeat_ngram_size:
                want = hf(NoRepeatNGramLogitsProcessor(p.no_repeat_ngram_size), ids, want)
            assert_close(got[i], want, msg=f"step {step} row {i}")
        for seq in seqs:
            seq.token_ids.append(rng.choice([4, 5, 6, 7, 8, rng.randrange(10)]))
        if step == 6:  # beam-like reordering: sequence 1 takes sequence 0's tokens
            seqs[1].token_ids = list(seqs[0].token_ids)
            seqs[1].num_prompt_tokens = seqs[0].num_prompt_tokens
            history.reset(seqs[1])


# -- log-probs from sample() ------------------------------------------------------------------


def test_sample_logprobs_are_of_the_processed_tempered_distribution():
    vocab = 150
    rows = [  # (temperature, top_k, logprobs k)
        (0.0, 0, 3),     # greedy
        (0.7, 10, 5),
        (1.4, 0, 0),     # just the chosen token
        (1.0, 40, None),  # not asked: rows share the batch
        (0.5, 0, 20),
    ]
    logits = random_logits(len(rows), vocab, 81)
    seqs = []
    for i, (t, k, n) in enumerate(rows):
        params = SamplingParams(temperature=t, top_k=k, logprobs=n, seed=i, repetition_penalty=1.3,
                                logit_bias={i: 3.0})
        seqs.append(make_seq(i, [1, 2, 3], [i + 10, 4], params))
    processed = kiln_process(logits, seqs)
    out = sample(processed.clone(), seqs)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, (t, k, n) in enumerate(rows):
        ref = torch.log_softmax(processed[i].double() / (t if t > 0 else 1.0), dim=-1)
        token = int(out.tokens[i])
        assert math.isclose(float(out.logprobs[i]), float(ref[token]), abs_tol=1e-5), f"row {i}"
        values, ids = ref.topk(n or 0)
        want_top = dict(zip(ids.tolist(), values.tolist()))
        got_top = out.top_logprobs[i]
        assert set(got_top) == set(want_top), f"row {i}"
        for token_id, value in want_top.items():
            assert math.isclose(got_top[token_id], value, abs_tol=1e-5)
    assert int(out.tokens[0]) == int(processed[0].argmax())
