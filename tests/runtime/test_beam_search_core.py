"""kiln's per-request beam search against Hugging Face ``generate(num_beams=...)``.

A naive driver (no KV cache: every step re-runs each live beam's full sequence) feeds
``BeamSearch`` and must reproduce HF's sequences, ``sequences_scores`` and per-token
transition scores, across beam widths, length penalties, early-stopping modes, end ids and
``num_return_sequences``.
"""
from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Callable

import pytest
import torch

from kiln.errors import RequestError
from kiln.runtime.beam_search import BeamHypothesis, BeamSearch, BeamSearchParams, BeamStep
from tests.utils.tiny_models import make_gpt2, make_llama

PROMPT = [5, 17, 33, 9, 60, 3]
N = 10  # max_new_tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and spinning threads crawl on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Tiny Llama and GPT-2 with a sharpened head (peaky distributions: no near-ties between
    the cached HF forward and the uncached driver), plus end ids taken from their own beams."""
    out = {}
    for name, make in (("llama", make_llama), ("gpt2", make_gpt2)):
        model = make(tmp_path_factory.mktemp(name), vocab=128)
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)
        free = _hf(model, 4, 1.0, False, 4, None)  # no end id at all: every beam runs N tokens
        # The beams' most frequent tokens as end ids: many hypotheses finish, early stopping bites.
        counts = Counter(t for s in free.sequences for t in s[len(PROMPT) + 1:].tolist()).most_common()
        hit = counts[0][0]
        other = counts[1][0] if len(counts) > 1 else (hit + 1) % 128
        out[name] = {"model": model, "end": {"none": None, "hit": [hit], "multi": [other, hit]}}
    return out


def _hf(model, beams: int, lp: float, es, nrs: int, eos: list[int] | None, **kw):
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = eos  # None: no end id (the tiny configs default to 2)
    config.update(num_beams=beams, do_sample=False, length_penalty=lp, early_stopping=es,
                  num_return_sequences=nrs, max_new_tokens=N, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0, **kw)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)


def _kiln(model, params: BeamSearchParams,
          processor: Callable[[list[list[int]], torch.Tensor], torch.Tensor] | None = None):
    """Drive BeamSearch with full-sequence forwards; return (hypotheses, steps taken)."""
    search = BeamSearch(params, len(PROMPT))
    beams, steps = [list(PROMPT)], 0
    while True:
        assert len(beams) == search.num_live_beams
        with torch.no_grad():
            logits = model(torch.tensor(beams)).logits[:, -1, :].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        if processor is not None:
            log_probs = processor(beams, log_probs)
        result = search.step(log_probs)
        steps += 1
        if result.done:
            return search.finalize(), steps
        beams = [beams[p] + [t] for p, t in zip(result.parents, result.tokens)]


def _compare(model, out, hyps: list[BeamHypothesis], lp: float) -> None:
    """Tokens, sequences_scores and transition scores of HF's output against kiln's."""
    assert len(hyps) == out.sequences.shape[0]
    trans = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    for i, h in enumerate(hyps):
        n = int((out.beam_indices[i] != -1).sum())  # generated length; the rest is padding
        assert h.token_ids == out.sequences[i, len(PROMPT):len(PROMPT) + n].tolist(), i
        assert h.score == pytest.approx(float(out.sequences_scores[i]), abs=1e-4), i
        assert h.log_probs == pytest.approx(trans[i, :n].tolist(), abs=1e-4), i
        assert h.cum_log_prob == pytest.approx(math.fsum(h.log_probs), abs=1e-4)
        assert h.score == pytest.approx(h.cum_log_prob / len(h.token_ids) ** lp, abs=1e-4)


@pytest.mark.parametrize("end", ["none", "hit", "multi"])
@pytest.mark.parametrize("es", [True, False, "never"])
@pytest.mark.parametrize("lp", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("width,nrs", [(2, 1), (2, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_matches_hf(models, arch, width, nrs, lp, es, end):
    model, eos = models[arch]["model"], models[arch]["end"][end]
    out = _hf(model, width, lp, es, nrs, eos)
    params = BeamSearchParams(beam_width=width, length_penalty=lp, early_stopping=es, num_return_sequences=nrs,
                              end_ids=tuple(eos or ()), max_new_tokens=N)
    hyps, steps = _kiln(model, params)
    _compare(model, out, hyps, lp)
    assert steps == len(out.scores)  # HF ran as many steps: same stopping decision


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_end_ids_and_early_stopping_take_effect(models, arch):
    """The chosen end id really ends hypotheses early, and early_stopping=True stops sooner."""
    model, hit = models[arch]["model"], models[arch]["end"]["hit"]
    base = dict(beam_width=4, num_return_sequences=4, max_new_tokens=N)
    free, steps_free = _kiln(model, BeamSearchParams(**base))
    assert steps_free == N and all(len(h.token_ids) == N for h in free)
    ended, steps = _kiln(model, BeamSearchParams(**base, end_ids=tuple(hit), early_stopping=True))
    assert steps < N and all(h.token_ids[-1] == hit[0] and len(h.token_ids) < N for h in ended)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_min_new_tokens_processor(models, arch):
    """A min-new-tokens processor (end ids at -inf early) applied by the runtime matches HF."""
    model, eos = models[arch]["model"], models[arch]["end"]["multi"]

    def processor(beams: list[list[int]], log_probs: torch.Tensor) -> torch.Tensor:
        if len(beams[0]) - len(PROMPT) < 4:
            log_probs[:, eos] = -math.inf
        return log_probs

    out = _hf(model, 4, 1.0, False, 4, eos, min_new_tokens=4)
    hyps, steps = _kiln(model, BeamSearchParams(beam_width=4, num_return_sequences=4, end_ids=tuple(eos),
                                                max_new_tokens=N), processor)
    _compare(model, out, hyps, 1.0)
    assert steps == len(out.scores)
    assert all(len(h.token_ids) >= 4 for h in hyps)


def test_diversity_rate_spreads_parents():
    """Hand-made log-probs: beam 0's two best tokens beat beam 1's best, unless the second
    sibling pays the diversity penalty. Scores stay true log-prob sums."""
    first = torch.tensor([[-0.1, -1.0, -3.0, -4.0]])
    second = torch.tensor([[-0.5, -0.6, -5.0, -5.0],   # after token 0: cum -0.6, -0.7
                           [-0.2, -4.0, -4.0, -4.0]])  # after token 1: cum -1.2
    third = torch.log_softmax(torch.zeros(2, 4), dim=-1)
    third[:, 0] += 0.01  # token 0 always best

    def run(rate: float) -> tuple[BeamStep, list[BeamHypothesis]]:
        search = BeamSearch(BeamSearchParams(beam_width=2, num_return_sequences=2, diversity_rate=rate,
                                             max_new_tokens=3), prompt_len=1)
        assert search.step(first) == BeamStep([0, 0], [0, 1], False)
        picked = search.step(second)
        assert search.step(third).done
        return picked, search.finalize()

    assert run(0.0)[0] == BeamStep([0, 0], [0, 1], False)
    assert run(0.4)[0] == BeamStep([0, 0], [0, 1], False)  # -0.7 - 0.4 still beats -1.2
    picked, hyps = run(1.0)  # -0.7 - 1.0 < -1.2: beam 1 survives
    assert picked == BeamStep([0, 1], [0, 0], False)
    assert [h.token_ids for h in hyps] == [[0, 0, 0], [1, 0, 0]]
    t = float(third[0, 0])
    assert hyps[0].log_probs == pytest.approx([-0.1, -0.5, t])
    assert hyps[1].log_probs == pytest.approx([-1.0, -0.2, t])
    for h in hyps:
        assert h.cum_log_prob == pytest.approx(sum(h.log_probs), abs=1e-6)
        assert h.score == pytest.approx(h.cum_log_prob / 3, abs=1e-6)


def test_many_end_ids_keep_beam_width_live_beams():
    """K = (1 + len(end_ids)) * W candidates: even when the 2W best all end, W live beams remain."""
    params = BeamSearchParams(beam_width=2, num_return_sequences=2, end_ids=(0, 1), early_stopping="never")
    search = BeamSearch(params, prompt_len=1)
    assert search.step(torch.tensor([[-1.0, -1.1, -0.5, -0.6, -3.0, -3.0]])) == BeamStep([0, 0], [2, 3], False)
    ending = torch.tensor([-0.01, -0.02, -0.3, -0.45, -6.0, -6.1]).expand(2, -1)  # best 4 all end
    assert search.step(ending) == BeamStep([0, 1], [2, 2], False)
    search.step(torch.tensor([[0.0, -9.0, -9.0, -9.0, -9.0, -9.0]] * 2))  # both live beams end
    assert search.done
    assert [h.token_ids for h in search.finalize()] == [[2, 0], [2, 1]]


@pytest.mark.parametrize("field,value", [
    ("beam_width", 0), ("beam_width", 2.0), ("num_return_sequences", 3), ("num_return_sequences", 0),
    ("early_stopping", "always"), ("early_stopping", 1), ("length_penalty", math.nan),
    ("diversity_rate", -0.5), ("max_new_tokens", 0), ("end_ids", (-1,)),
])
def test_invalid_params_name_the_field(field, value):
    kwargs = {"beam_width": 2, field: value}
    with pytest.raises(RequestError, match=field):
        BeamSearch(BeamSearchParams(**kwargs), prompt_len=3)


def test_step_contract():
    search = BeamSearch(BeamSearchParams(beam_width=3, max_new_tokens=1), prompt_len=2)
    assert search.num_live_beams == 1
    with pytest.raises(ValueError):
        search.step(torch.zeros(3, 8))
    with pytest.raises(RuntimeError):
        search.finalize()
    assert search.step(torch.log_softmax(torch.arange(8.0)[None], dim=-1)).done  # max_new_tokens reached
    with pytest.raises(RuntimeError):
        search.step(torch.zeros(3, 8))
    (best,) = search.finalize()
    assert best.token_ids == [7]
