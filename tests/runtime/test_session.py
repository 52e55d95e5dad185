"""GenerationSession (setup, then generate) on a tiny Llama engine, checked against Hugging Face."""
from __future__ import annotations

import pytest
import torch

from kiln.errors import RequestError
from kiln.runtime import Engine, GenerationInput, GenerationSession
from tests.utils.compare import hf_greedy
from tests.utils.tiny_models import make_llama

PAD = 999  # outside the vocabulary, so padding is unmistakable
NO_END = -1  # an end_id greedy can never produce
PROMPTS = [[5, 17, 42, 8, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 13, 77]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, build_from_hf):
    """(engine, hf_model): a 2-layer Llama built with max_input_len 16, max_seq_len 64, blocks of 4."""
    work = tmp_path_factory.mktemp("session")
    hf_model = make_llama(work / "hf")
    engine_dir = build_from_hf(work / "hf", work, dict(max_input_len=16, max_seq_len=64, tokens_per_block=4,
                                                      max_batch_size=4))
    return Engine(engine_dir), hf_model


@pytest.fixture(scope="module")
def reference(tiny):
    """HF greedy continuations of PROMPTS."""
    return hf_greedy(tiny[1], PROMPTS, MAX_NEW)


def packed(prompts, end_id=NO_END, max_new=MAX_NEW) -> GenerationInput:
    return GenerationInput(end_id=end_id, pad_id=PAD, ids=torch.tensor([t for p in prompts for t in p]),
                           lengths=torch.tensor([len(p) for p in prompts]), packed=True, max_new_tokens=max_new)


def padded(prompts, end_id=NO_END, max_new=MAX_NEW) -> GenerationInput:
    ids = torch.full((len(prompts), max(map(len, prompts))), PAD)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    return GenerationInput(end_id=end_id, pad_id=PAD, ids=ids, lengths=torch.tensor([len(p) for p in prompts]),
                           packed=False, max_new_tokens=max_new)


def session(engine, batch_size=3) -> GenerationSession:
    s = GenerationSession(engine)
    s.setup(batch_size)
    return s


def expected_ids(prompts, outputs, total) -> torch.Tensor:
    ids = torch.full((len(prompts), 1, total), PAD)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        ids[b, 0, : len(p) + len(o)] = torch.tensor(p + o)
    return ids


def test_greedy_output_layout_matches_hf(tiny, reference):
    """ids are [batch, 1, max_input + max_new]: the prompt, HF's greedy tokens, then pad_id; lengths count both."""
    out = session(tiny[0]).generate(packed(PROMPTS))
    total = max(map(len, PROMPTS)) + MAX_NEW
    assert out.ids.shape == (3, 1, total)
    assert torch.equal(out.ids, expected_ids(PROMPTS, reference, total))
    assert out.lengths.tolist() == [[len(p) + MAX_NEW] for p in PROMPTS]
    assert out.finish_reasons == [["length"]] * 3


def test_packed_and_padded_inputs_agree(tiny):
    """The same prompts given packed or padded generate identical outputs."""
    a = session(tiny[0]).generate(packed(PROMPTS))
    b = session(tiny[0]).generate(padded(PROMPTS))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.lengths, b.lengths)


def test_end_id_stops_a_sequence_and_pads_the_rest(tiny, reference):
    """With end_id set to a token greedy produces, each sequence stops at its first end_id; then pad_id."""
    step = next(i for i in range(2, MAX_NEW) if reference[0][i] not in reference[0][:i])
    end_id = reference[0][step]
    out = session(tiny[0]).generate(packed(PROMPTS, end_id=end_id))
    truncated = [o[: o.index(end_id) + 1] if end_id in o else o for o in reference]
    assert len(truncated[0]) == step + 1
    assert torch.equal(out.ids, expected_ids(PROMPTS, truncated, max(map(len, PROMPTS)) + MAX_NEW))
    assert out.lengths.tolist() == [[len(p) + len(o)] for p, o in zip(PROMPTS, truncated)]
    assert out.finish_reasons[0] == ["end_id"]


def test_on_token_generated_streams_every_step(tiny):
    """The callback runs after each step with the ids so far; only the last call says finished."""
    calls = []
    out = session(tiny[0]).generate(
        packed(PROMPTS), on_token_generated=lambda ids, step, done: calls.append((step, done, ids.clone())))
    assert [step for step, _, _ in calls] == list(range(1, MAX_NEW + 1))
    assert [done for _, done, _ in calls] == [False] * (MAX_NEW - 1) + [True]
    first = calls[0][2]
    assert all(first[b, 0, len(p)] != PAD and first[b, 0, len(p) + 1] == PAD for b, p in enumerate(PROMPTS))
    assert torch.equal(calls[-1][2], out.ids)


def test_generate_before_setup_is_an_error(tiny):
    """generate() without setup() raises RequestError."""
    with pytest.raises(RequestError, match="setup"):
        GenerationSession(tiny[0]).generate(packed(PROMPTS))


def test_batch_larger_than_setup_is_an_error(tiny):
    """More sequences than setup's batch_size raise RequestError."""
    with pytest.raises(RequestError, match="batch_size 2"):
        session(tiny[0], batch_size=2).generate(packed(PROMPTS))


def test_prompt_longer_than_max_input_len_is_an_error_and_leaves_the_session_usable(tiny, reference):
    """A prompt over the engine's max_input_len raises RequestError naming the limit; nothing stays queued."""
    s = session(tiny[0])
    with pytest.raises(RequestError, match="max_input_len 16"):
        s.generate(packed([PROMPTS[0], list(range(17))], max_new=4))
    out = s.generate(packed(PROMPTS))
    assert torch.equal(out.ids, expected_ids(PROMPTS, reference, max(map(len, PROMPTS)) + MAX_NEW))


def test_beam_search_is_not_available(tiny):
    """setup(beam_width=2) raises RequestError rather than silently doing greedy search."""
    with pytest.raises(RequestError, match="beam_width"):
        GenerationSession(tiny[0]).setup(2, beam_width=2)
