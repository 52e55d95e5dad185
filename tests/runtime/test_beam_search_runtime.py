"""Beam search end to end (GenerationSession, LLM) against Hugging Face ``generate(num_beams=W)``.

Tiny Llama and GPT-2 (vocab 128, lm_head scaled x2 so distributions are peaky) are built
with ``tokens_per_block=4``: the two prompts (7 and 3 tokens) end in partly filled blocks
that the beams share after forking, so every step copies a shared block on write. The end
id is the token an unconstrained beam search produces most, so hypotheses finish early.
Tokens must be identical; per-token and cumulative log-probs must equal HF's
``compute_transition_scores(..., normalize_logits=False)`` within 1e-4. SmolLM2-135M (GGUF)
runs one chat prompt with two beams.
"""
from __future__ import annotations

import collections

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.errors import RequestError
from kiln.runtime import Engine, GenerationInput, GenerationSession, SamplingConfig
from tests.utils.compare import assert_near_tie_divergence
from tests.utils.fakes import make_tiny_tokenizer
from tests.utils.tiny_models import make_gpt2, make_llama

VOCAB = 128
PAD = 999  # outside the vocabulary: padding is unmistakable
PROMPTS = [[5, 17, 42, 8, 99, 23, 61], [3, 9, 27]]
MAX_NEW = 10
TOL = 1e-4
BUILD = dict(max_beam_width=4, tokens_per_block=4, max_batch_size=8, max_seq_len=64, max_input_len=32)

# (model, beam width, length_penalty, early_stopping): every combination, and "never" once.
CASES = [(name, width, lp, es) for name in ("llama", "gpt2") for width in (2, 4) for lp in (0.5, 1.0, 2.0)
         for es in (True, False)] + [("llama", 4, 2.0, "never")]


def peaky(model, path):
    """Scale the output projection x2 (sharper distributions, fewer near-ties) and re-save."""
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory, build_from_hf):
    """name -> (Engine, HF model). The Llama dir also carries a 128-token tokenizer (for LLM)."""
    work = tmp_path_factory.mktemp("beam")
    out = {}
    llama = peaky(make_llama(work / "llama", vocab=VOCAB), work / "llama")
    tokenizer = make_tiny_tokenizer(VOCAB)
    assert len(tokenizer) == VOCAB
    tokenizer.save_pretrained(work / "llama")
    out["llama"] = (Engine(build_from_hf(work / "llama", work / "llama-build", BUILD)), llama)
    gpt2 = peaky(make_gpt2(work / "gpt2", vocab=VOCAB), work / "gpt2")
    out["gpt2"] = (Engine(build_from_hf(work / "gpt2", work / "gpt2-build", BUILD)), gpt2)
    return out


class RecordingSession(GenerationSession):
    """A GenerationSession whose KV cache records every block copied on write."""

    copies: list

    def setup(self, *args, **kwargs):
        super().setup(*args, **kwargs)
        runner = self._core.runner
        original = runner.copy_blocks
        self.copies = []

        def copy_blocks(pairs):
            self.copies.extend(pairs)
            return original(pairs)

        runner.copy_blocks = copy_blocks


@pytest.fixture(scope="module")
def sessions(models):
    return {name: RecordingSession(engine) for name, (engine, _) in models.items()}


def run_beams(session, width, length_penalty=1.0, early_stopping=False, end_id=-1, max_new=MAX_NEW):
    session.setup(batch_size=len(PROMPTS), beam_width=width, max_seq_len=64)
    inputs = GenerationInput(end_id=end_id, pad_id=PAD, ids=torch.tensor([t for p in PROMPTS for t in p]),
                             lengths=torch.tensor([len(p) for p in PROMPTS]), max_new_tokens=max_new)
    out = session.generate(inputs, SamplingConfig(beam_width=width, length_penalty=length_penalty,
                                                  early_stopping=early_stopping))
    pool = session._core.pool
    assert pool.num_free == pool.num_blocks, "KV blocks leaked after beam search"
    return out


@torch.inference_mode()
def hf_beams(hf, prompt, width, length_penalty=1.0, early_stopping=False, end_id=None, max_new=MAX_NEW,
             num_return=None):
    """[(generated tokens, per-token log-probs)] of HF's returned beams, best first."""
    ids = torch.tensor([prompt])
    g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
                    num_return_sequences=num_return or width, length_penalty=length_penalty,
                    early_stopping=early_stopping, max_new_tokens=max_new, eos_token_id=end_id, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True)
    scores = hf.compute_transition_scores(g.sequences, g.scores, g.beam_indices, normalize_logits=False)
    out = []
    for k in range(g.sequences.shape[0]):
        n = int((g.beam_indices[k] >= 0).sum())  # generated length (end token included)
        out.append((g.sequences[k, len(prompt):len(prompt) + n].tolist(), scores[k, :n]))
    return out


def assert_matches_hf(out, hf, width, length_penalty, early_stopping, end_id):
    """Every beam of every prompt: same tokens, padding, lengths, reasons and log-probs as HF."""
    assert out.ids.shape == (len(PROMPTS), width, max(map(len, PROMPTS)) + MAX_NEW)
    for b, prompt in enumerate(PROMPTS):
        ref = hf_beams(hf, prompt, width, length_penalty, early_stopping, None if end_id < 0 else end_id)
        assert len(ref) == width
        for k, (tokens, logprobs) in enumerate(ref):
            n = len(tokens)
            where = f"prompt {b} beam {k}"
            assert out.ids[b, k, :len(prompt)].tolist() == prompt, where
            assert out.ids[b, k, len(prompt):len(prompt) + n].tolist() == tokens, where
            assert (out.ids[b, k, len(prompt) + n:] == PAD).all(), where
            assert int(out.sequence_lengths[b, k]) == len(prompt) + n, where
            ended = end_id >= 0 and tokens[-1] == end_id
            assert out.finish_reasons[b][k] == ("end_id" if ended else "length"), where
            torch.testing.assert_close(out.log_probs[b, k, :n], logprobs, atol=TOL, rtol=0, msg=where)
            assert (out.log_probs[b, k, n:] == 0).all(), where
            assert abs(float(out.cum_log_probs[b, k]) - float(logprobs.sum())) <= TOL, where


@pytest.fixture(scope="module")
def end_ids(models, sessions):
    """Per model: the token an unconstrained width-4 beam search generates most often."""
    ids = {}
    for name in models:
        out = run_beams(sessions[name], 4)
        counts = collections.Counter(
            t for b, p in enumerate(PROMPTS) for k in range(4)
            for t in out.ids[b, k, len(p):int(out.sequence_lengths[b, k])].tolist())
        ids[name] = counts.most_common(1)[0][0]
    return ids


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_unconstrained_beam_search_matches_hf(models, sessions, name):
    """No end id: all beams run MAX_NEW tokens; identical to HF with eos_token_id=None."""
    session = sessions[name]
    out = run_beams(session, 4)
    assert session.copies, "no KV block was copied on write: the beams never shared a partial block"
    assert (out.sequence_lengths == torch.tensor([[len(p) + MAX_NEW] * 4 for p in PROMPTS])).all()
    assert_matches_hf(out, models[name][1], 4, 1.0, False, -1)


@pytest.mark.parametrize("name,width,length_penalty,early_stopping", CASES)
def test_beam_search_matches_hf(models, sessions, end_ids, name, width, length_penalty, early_stopping):
    """With an end id the beams actually produce: tokens and log-probs identical to HF."""
    session = sessions[name]
    out = run_beams(session, width, length_penalty, early_stopping, end_ids[name])
    assert session.copies, "no KV block was copied on write"
    assert_matches_hf(out, models[name][1], width, length_penalty, early_stopping, end_ids[name])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_end_id_finishes_hypotheses_early(sessions, end_ids, name):
    """The chosen end id ends some hypotheses before MAX_NEW (so the finishing paths are exercised);
    length_penalty 0.5 favours short hypotheses."""
    out = run_beams(sessions[name], 4, 0.5, False, end_ids[name])
    lengths = out.sequence_lengths - torch.tensor([[len(p)] for p in PROMPTS])
    assert (lengths < MAX_NEW).any(), lengths
    assert any(r == "end_id" for reasons in out.finish_reasons for r in reasons)


def test_beam_width_above_engine_limit_is_rejected(sessions):
    """Widths above the engine's max_beam_width raise RequestError naming it; the session keeps working."""
    session = sessions["llama"]
    with pytest.raises(RequestError, match="max_beam_width"):
        session.setup(batch_size=1, beam_width=8)
    session.setup(batch_size=1, beam_width=2)
    with pytest.raises(RequestError, match="beam_width"):  # config disagreeing with setup()
        session.generate(GenerationInput(end_id=-1, pad_id=PAD, ids=torch.tensor(PROMPTS[0]),
                                         lengths=torch.tensor([len(PROMPTS[0])]), max_new_tokens=4),
                         SamplingConfig(beam_width=4))
    out = run_beams(session, 2)
    assert out.ids.shape[1] == 2


# -- LLM API ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(models):
    """An LLM on the tiny Llama engine itself (max_beam_width 4, tokenizer inside)."""
    return LLM(models["llama"][0].engine_dir, progress=False)


def test_llm_beam_search_returns_hf_best_n(llm, models, end_ids):
    """use_beam_search with best_of=4, n=2: the two best HF beams (tokens, text, cumulative log-prob)."""
    hf = models["llama"][1]
    stop = end_ids["llama"]
    ends = [llm.processor.end_id, stop]  # the tokenizer's </s> and an extra stop token: both end hypotheses
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=MAX_NEW, stop_token_ids=[stop],
                            length_penalty=1.0, early_stopping=False, logprobs=0)
    results = llm.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results):
        ref = hf_beams(hf, prompt, 4, 1.0, False, ends, num_return=2)
        assert len(result.outputs) == 2
        for out, (tokens, logprobs) in zip(result.outputs, ref):
            assert out.token_ids == tokens
            assert out.text == llm.tokenizer.decode(tokens, skip_special_tokens=True)
            assert out.finish_reason == ("stop" if tokens[-1] in ends else "length")
            assert abs(out.cumulative_logprob - float(logprobs.sum())) <= TOL
            assert [next(iter(e)) for e in out.logprobs] == tokens
            torch.testing.assert_close(torch.tensor([e[t] for e, t in zip(out.logprobs, tokens)]), logprobs,
                                       atol=TOL, rtol=0)
    assert llm.core.pool.num_free == llm.core.pool.num_blocks


def test_llm_beam_width_above_engine_limit_is_rejected(llm):
    """best_of above the engine's max_beam_width (4) is a RequestError naming the limit; nothing leaks."""
    with pytest.raises(RequestError, match="max_beam_width 4"):
        llm.generate([PROMPTS[0]], SamplingParams(use_beam_search=True, best_of=8, n=1, max_tokens=4))
    assert not llm.core.has_unfinished
    assert llm.core.pool.num_free == llm.core.pool.num_blocks
    out = llm.generate([PROMPTS[0]], SamplingParams(use_beam_search=True, best_of=2, n=2, max_tokens=4))
    assert len(out[0].outputs) == 2


# -- SmolLM2-135M ---------------------------------------------------------------------------------

SMOL_PROMPT = "Write a haiku about autumn leaves."
SMOL_NEW = 16


@pytest.fixture
def one_thread():
    """Run the 135M model's matmuls on one thread: on a busy 2-core machine two OpenMP threads
    wait on each other (measured 10x slower); on an idle one this costs at most 2x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm2(smollm2_llm, smollm2_hf):
    return smollm2_llm, smollm2_hf


def test_smollm2_beam_search_matches_hf(smollm2, one_thread):
    """Two beams, 16 new tokens on a chat prompt: HF's beams, or a genuine near-tie where they part."""
    from kiln.tokenizer import chat_prompt_ids

    llm, hf = smollm2
    ids = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": SMOL_PROMPT}])
    ends = [llm.processor.end_id, *llm.processor.extra_stop_ids]
    (result,) = llm.generate([ids], SamplingParams(use_beam_search=True, best_of=2, n=2, max_tokens=SMOL_NEW))
    ref = hf_beams(hf, ids, 2, end_id=ends, max_new=SMOL_NEW)
    assert llm.core.pool.num_free == llm.core.pool.num_blocks
    assert len(result.outputs) == 2
    for out, (tokens, logprobs) in zip(result.outputs, ref):
        ours = out.token_ids
        if ours == tokens:
            assert abs(out.cumulative_logprob - float(logprobs.sum())) <= 1e-3
            continue
        assert_near_tie_divergence(llm, hf, ids, ours, tokens)
        break  # after a near-tie the searches explore different beams
