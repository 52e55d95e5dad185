"""ROUGE-1/2/L/Lsum of generated summaries against references, through Google's ``rouge-score``.

Each score is the F-measure x 100 with Porter stemming (``use_stemmer=True``); ROUGE-Lsum
is the summary-level LCS over the newline-separated lines of each text, as ``rouge-score``
splits them (no sentence splitter, so nothing needs nltk data). The corpus figure is the
plain mean over samples; Hugging Face ``evaluate``'s default is instead the median ("mid")
of a bootstrap over samples, which lands close to the mean but is not the same number.
"""
from __future__ import annotations

from kiln.errors import KilnError

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def _scorer():
    try:
        from rouge_score import rouge_scorer  # an optional dependency (the eval extra)
    except ImportError:
        raise KilnError("ROUGE needs the rouge-score package: pip install rouge-score") from None
    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def rouge_scores(predictions: list[str], references: list[str]) -> list[dict[str, float]]:
    """Per sample ``{"rouge1", "rouge2", "rougeL", "rougeLsum"}``: F-measure x 100 of each
    prediction against its reference."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    scorer = _scorer()
    out = []
    for prediction, reference in zip(predictions, references):
        scores = scorer.score(reference, prediction)  # rouge-score takes (target, prediction)
        out.append({key: 100.0 * scores[key].fmeasure for key in ROUGE_KEYS})
    return out


def mean_scores(per_sample: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each ROUGE key over samples (0 for every key when there are none)."""
    n = len(per_sample)
    return {key: (sum(s[key] for s in per_sample) / n if n else 0.0) for key in ROUGE_KEYS}


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus ROUGE: the mean over samples of each sample's F-measure x 100."""
    return mean_scores(rouge_scores(predictions, references))
