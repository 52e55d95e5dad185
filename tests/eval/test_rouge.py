"""kiln.eval.rouge against rouge-score computed directly in the test."""
from __future__ import annotations

import pytest
from rouge_score import rouge_scorer

from kiln.eval.rouge import ROUGE_KEYS, mean_scores, rouge, rouge_scores

PAIRS = [  # (prediction, reference)
    ("The cat sat on the mat.", "A cat was sitting on the mat."),
    ("Police arrested two men after the robbery.\nThe bank was closed.",
     "Two men were arrested by police.\nThe bank closed after the robbery on Monday."),
    ("Stocks rose sharply\nInvestors cheered the news\nOil fell",
     "Oil prices fell\nstocks rising sharply as investors cheered"),
    ("completely unrelated words here", "nothing in common at all"),
    ("running runners ran", "the runner runs"),  # stemming makes run/running/runs one token
]


def _direct(prediction: str, reference: str) -> dict[str, float]:
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    scores = scorer.score(reference, prediction)
    return {"rouge1": scores["rouge1"].fmeasure * 100, "rouge2": scores["rouge2"].fmeasure * 100,
            "rougeL": scores["rougeL"].fmeasure * 100, "rougeLsum": scores["rougeLsum"].fmeasure * 100}


def test_per_sample_scores_equal_rouge_score():
    predictions, references = zip(*PAIRS)
    ours = rouge_scores(list(predictions), list(references))
    for (prediction, reference), got in zip(PAIRS, ours):
        assert set(got) == set(ROUGE_KEYS)
        expected = _direct(prediction, reference)
        for key in ROUGE_KEYS:
            assert got[key] == pytest.approx(expected[key], abs=1e-9), key


def test_lsum_splits_on_newlines():
    # The multi-line pair scores differently at summary level than as one sequence
    prediction, reference = PAIRS[2]
    got = rouge_scores([prediction], [reference])[0]
    assert got["rougeLsum"] != pytest.approx(got["rougeL"])
    assert 0 < got["rouge1"] <= 100 and got["rouge2"] >= 0


def test_corpus_score_is_the_mean_over_samples():
    predictions, references = zip(*PAIRS)
    corpus = rouge(list(predictions), list(references))
    for key in ROUGE_KEYS:
        expected = sum(_direct(p, r)[key] for p, r in PAIRS) / len(PAIRS)
        assert corpus[key] == pytest.approx(expected, abs=1e-9)
    assert rouge(["same words"], ["same words"]) == {key: 100.0 for key in ROUGE_KEYS}
    assert mean_scores([]) == {key: 0.0 for key in ROUGE_KEYS}


def test_prediction_and_reference_counts_must_match():
    with pytest.raises(ValueError):
        rouge_scores(["a", "b"], ["a"])
