"""Qwen3.5's multi-token-prediction layer as speculative decoding's draft (``method: mtp``): its
guesses against a reference built from Hugging Face's own modules (its decoder layer, norms and
LM head; Hugging Face does not run the MTP itself), checked step after step (rows past rejected
proposals written again), and greedy output identical to plain greedy."""
from __future__ import annotations

import pytest
import torch

from kiln.errors import ConfigError
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.mtp import MtpProposer
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import RunnerOutput, ScheduledChunk, TokenResult
from kiln.runtime.sequence import Sequence
from tests.utils import tiny_hybrid_models as tiny

PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [20, 21, 22, 23, 20, 21, 40], [7, 7, 7]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory, build_from_hf):
    """``with_mtp(maker)``: a tiny Qwen3.5 (dense or MoE) with an MTP layer, made once: (HF model,
    the MTP's HF modules, kiln engine)."""
    made = {}

    def get(maker):
        if maker not in made:
            root = tmp_path_factory.mktemp(maker.__name__)
            hf = maker(root / "hf")
            modules = tiny.add_mtp_layer(root / "hf", hf)
            made[maker] = hf, modules, Engine(build_from_hf(root / "hf", root / "kiln", {}))
        return made[maker]

    return get


@pytest.fixture
def qwen3_5_mtp(with_mtp):
    return with_mtp(tiny.make_qwen3_5)


@torch.no_grad()
def reference_guesses(hf, modules, tokens: list[int], k: int) -> list[int]:
    """The MTP's ``k`` greedy guesses after ``tokens`` (the last not yet run by the target), from
    HF's modules: the target's final hidden states over ``tokens[:-1]``, each row paired with the
    token after it, through fc, the decoder layer (causal) and the norm; each later guess runs its
    predecessor's output again one position on."""
    hidden = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
    following, guesses = list(tokens[1:]), []
    for _ in range(k):
        embeds = hf.model.embed_tokens(torch.tensor(following))
        x = modules["fc"](torch.cat([modules["pre_fc_norm_embedding"](embeds),
                                     modules["pre_fc_norm_hidden"](hidden)], dim=-1))[None]
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = modules["norm"](modules["layer"](x, position_embeddings=hf.model.rotary_emb(x, positions),
                                               attention_mask=mask, position_ids=positions))[0]
        guesses.append(int(hf.lm_head(out[-1]).argmax()))
        following.append(guesses[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return guesses


def test_guesses_match_the_reference_step_after_step(qwen3_5_mtp) -> None:
    """After every step that guessed (the prompt's, then decode steps whose proposals were
    rejected: their rows are written again), the guesses equal the reference's for the tokens the
    sequence held then."""
    hf, modules, engine = qwen3_5_mtp
    core = EngineCore(engine, num_blocks=64, speculative_config={**MTP, "num_speculative_tokens": 3})
    request = core.add_request(PROMPTS[1], GREEDY, end_id=None)
    (seq,) = request.seqs
    checked = 0
    while core.has_unfinished:
        core.step()
        count, guesses = core.runner.mtp.drafts.get(seq.seq_id, (None, None))
        if count is not None:
            assert guesses == reference_guesses(hf, modules, seq.token_ids[:count], len(guesses))
            checked += 1
    assert checked >= 3 and core.stats.spec.num_drafts >= 2


def test_moe_mtp_layer_loads_its_experts(with_mtp) -> None:
    """Qwen3.5-MoE's MTP layer (its own 8 experts, per-expert tensors, and a shared expert): the
    first step's guesses equal the reference's."""
    hf, modules, engine = with_mtp(tiny.make_qwen3_5_moe)
    core = EngineCore(engine, num_blocks=64, speculative_config=MTP)
    (seq,) = core.add_request(PROMPTS[0], GREEDY, end_id=None).seqs
    core.step()
    count, guesses = core.runner.mtp.drafts[seq.seq_id]
    assert guesses == reference_guesses(hf, modules, seq.token_ids[:count], 2)


def test_mtp_greedy_is_plain_greedy(qwen3_5_mtp) -> None:
    """MTP proposals for three sequences at once: plain greedy's tokens, nothing left held."""
    _, _, engine = qwen3_5_mtp
    plain, spec = EngineCore(engine, num_blocks=64), EngineCore(engine, num_blocks=64, speculative_config=MTP)
    outputs = []
    for core in (plain, spec):
        requests = [core.add_request(p, GREEDY, end_id=None) for p in PROMPTS]
        while core.has_unfinished:
            core.step()
        outputs.append([r.seqs[0].output_token_ids for r in requests])
    assert outputs[0] == outputs[1]
    assert spec.stats.spec.num_drafts > 0
    assert spec.pool.num_free == spec.pool.num_blocks
    assert spec.scheduler.states.num_free == spec.scheduler.states.num_slots


def test_rows_after_a_verification_stop_at_the_first_rejection() -> None:
    """A chunk of two tokens to catch up with and three proposals, of which the target kept one:
    three rows stand, each followed by the next token the sequence now has."""
    seq = Sequence(0, [1, 2, 3, 4], GREEDY, None, 64)
    seq.num_computed_tokens, seq.spec_tokens = 2, [7, 8, 9]
    result = RunnerOutput(verified={0: [TokenResult(7), TokenResult(5)]})
    assert MtpProposer._rows(ScheduledChunk(seq, 5), [3, 4, 7, 8, 9], result) == (3, [4, 7, 5])
    assert MtpProposer._rows(ScheduledChunk(seq, 1), [3], RunnerOutput()) == (1, [4])  # a prompt chunk goes on
    assert MtpProposer._rows(ScheduledChunk(seq, 5), [3, 4, 7, 8, 9], RunnerOutput(failed={0: None})) == (0, [])


def test_mtp_needs_an_mtp_layer(tmp_path, build_from_hf) -> None:
    tiny.make_qwen3_5(tmp_path / "hf", num_hidden_layers=4)
    engine = Engine(build_from_hf(tmp_path / "hf", tmp_path / "kiln", {}))
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        EngineCore(engine, num_blocks=16, speculative_config=MTP)
