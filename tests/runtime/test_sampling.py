"""The batched sampler: greedy, top-k/top-p filtering, seeded draws, temperature, parameter checks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kiln.errors import RequestError
from kiln.runtime.sampling import apply_top_k_top_p, sample
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence


def draw(logits: torch.Tensor, params: list[SamplingParams], generators) -> list[int]:
    seqs = []
    for i, (p, g) in enumerate(zip(params, generators)):
        seq = Sequence(i, [0], p, end_id=None, max_seq_len=1 << 20)
        seq.generator = g
        seqs.append(seq)
    return sample(logits.clone(), seqs).tokens.tolist()


def test_greedy_is_argmax():
    """Temperature 0 (and top_k 1) pick each row's argmax."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=1.5, top_k=1)] * 3
    assert draw(logits, params, [p.make_generator() for p in params]) == logits.argmax(-1).tolist()


def reference_kept(row: list[float], k: int, p: float) -> tuple[set[int], float]:
    """Indices kept by top-k then top-p (the smallest top set holding mass >= p), and how close
    any cumulative mass came to p (float32 cannot decide ties at the boundary)."""
    order = sorted(range(len(row)), key=lambda i: -row[i])[:k]
    top = max(row[i] for i in order)
    weights = [math.exp(row[i] - top) for i in order]
    total = sum(weights)
    kept, mass, margin = set(), 0.0, math.inf
    for i, w in zip(order, weights):
        if p < 1:
            margin = min(margin, abs(mass - p))
            if mass >= p:
                break
        kept.add(i)
        mass += w / total
    return kept, margin


@st.composite
def filter_cases(draw_):
    vocab = draw_(st.integers(2, 12))
    rows = draw_(st.lists(st.lists(st.integers(-400, 400), min_size=vocab, max_size=vocab, unique=True),
                          min_size=1, max_size=4))
    ks = draw_(st.lists(st.integers(1, vocab), min_size=len(rows), max_size=len(rows)))
    ps = draw_(st.lists(st.one_of(st.just(1.0), st.floats(0.01, 1.0)), min_size=len(rows), max_size=len(rows)))
    return [[v / 20 for v in r] for r in rows], ks, ps  # distinct logits in [-20, 20]


@settings(max_examples=200, deadline=None)
@given(filter_cases())
def test_top_k_top_p_keeps_exactly_the_reference_set(case):
    """Per row, exactly the top-k survive, then the smallest nucleus of them; kept logits are unchanged."""
    rows, ks, ps = case
    expected = [reference_kept(r, k, p) for r, k, p in zip(rows, ks, ps)]
    assume(all(margin > 1e-4 for _, margin in expected))
    logits = torch.tensor(rows, dtype=torch.float32)
    out = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps, dtype=torch.float32))
    for b, (kept, _) in enumerate(expected):
        finite = set(torch.isfinite(out[b]).nonzero().flatten().tolist())
        assert finite == kept, f"row {b} (k={ks[b]}, p={ps[b]}): kept {sorted(finite)}, expected {sorted(kept)}"
        assert torch.equal(out[b, sorted(kept)], logits[b, sorted(kept)])


def test_top_p_one_keeps_even_negligible_tokens():
    """top_p 1.0 filters nothing, even tokens whose probability rounds away in float32."""
    logits = torch.tensor([[0.0, -20.0, -30.0]])
    out = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert torch.equal(out, logits)


def test_draws_stay_inside_the_filtered_set():
    """Sampling with top_k 2 only ever yields the two most likely tokens."""
    logits = torch.tensor([[0.5, 3.0, 0.0, 2.5, 1.0]]).repeat(500, 1)
    params = [SamplingParams(temperature=5.0, top_k=2, seed=1)] * 500
    g = params[0].make_generator()
    assert set(draw(logits, params, [g] * 500)) == {1, 3}


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    """The same seed gives the same tokens for a row, alone or batched with other requests."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    target = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    others = [SamplingParams(temperature=1.3, seed=7), SamplingParams(temperature=0), SamplingParams(top_p=0.5)]

    def run_alone() -> list[int]:
        g = target.make_generator()
        return [draw(logits[2:3], [target], [g])[0] for _ in range(30)]

    def run_batched() -> list[int]:
        params = [others[0], others[1], target, others[2]]
        gens = [p.make_generator() for p in params]
        return [draw(logits, params, gens)[2] for _ in range(30)]

    alone = run_alone()
    assert alone == run_alone() == run_batched()
    other_seed = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=4321)
    g = other_seed.make_generator()
    assert [draw(logits[2:3], [other_seed], [g])[0] for _ in range(30)] != alone


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_scales_the_distribution():
    """4000 draws at T=0.7 match softmax(logits / 0.7), and clearly not softmax(logits)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    n = 4000
    params = [SamplingParams(temperature=0.7, seed=0)] * n
    g = params[0].make_generator()
    tokens = draw(logits.repeat(n, 1), params, [g] * n)
    # chi-square with 4 degrees of freedom: 18.47 is the 0.1% critical value.
    assert chi_square(tokens, (logits / 0.7).softmax(-1)) < 18.47
    assert chi_square(tokens, logits.softmax(-1)) > 50


@pytest.mark.parametrize("field, value", [("top_p", 2.0), ("top_p", 0.0), ("temperature", -1.0),
                                          ("max_tokens", 0), ("top_k", -2), ("seed", 1.5)])
def test_invalid_parameters_raise_request_error_naming_the_field(field, value):
    """Out-of-range sampling parameters are rejected with a RequestError that names the field."""
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})
