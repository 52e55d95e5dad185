"""Generation controls through GenerationSession (and EngineCore) on a tiny Llama, against HF.

The Llama has vocab 128 and its lm_head scaled x2 (peaky distributions). Greedy runs with
a processor must produce HF ``generate``'s tokens with the same processor; stop words, bad
words and biases are chosen from a first unconstrained greedy run so that each one bites.
"""
from __future__ import annotations

import pytest
import torch

from kiln.errors import RequestError
from kiln.runtime import Engine, EngineCore, GenerationInput, GenerationSession, SamplingConfig, SamplingParams
from kiln.runtime.words import encode_words
from tests.utils.compare import assert_logits_close
from tests.utils.tiny_models import make_llama

VOCAB = 128
PAD = 999  # outside the vocabulary: padding is unmistakable
PROMPTS = [[5, 17, 42, 8, 99], [3, 9, 27, 64, 11, 90, 7]]
MAX_NEW = 12
TOL = 1e-4
BUILD = dict(tokens_per_block=4, max_batch_size=8, max_seq_len=64, max_input_len=32, max_beam_width=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, build_from_hf):
    """(engine with gather_all_token_logits, engine without, HF model)."""
    from kiln.build import build_engine, resolve_build_config
    from kiln.checkpoint.format import read_config

    work = tmp_path_factory.mktemp("controls")
    hf = make_llama(work / "hf", vocab=VOCAB)
    with torch.no_grad():
        hf.lm_head.weight.mul_(2)
    hf.save_pretrained(work / "hf")
    gather = build_from_hf(work / "hf", work, dict(BUILD, gather_all_token_logits=True))
    checkpoint = work / "checkpoint"
    plain = build_engine(checkpoint, work / "plain", resolve_build_config(read_config(checkpoint), **BUILD),
                         progress=False)
    return Engine(gather), Engine(plain), hf


@pytest.fixture(scope="module")
def session(tiny):
    s = GenerationSession(tiny[0])
    s.setup(batch_size=len(PROMPTS))
    return s


def inputs(prompts=PROMPTS, end_id=-1, max_new=MAX_NEW, **kw) -> GenerationInput:
    return GenerationInput(end_id=end_id, pad_id=PAD, ids=torch.tensor([t for p in prompts for t in p]),
                           lengths=torch.tensor([len(p) for p in prompts]), max_new_tokens=max_new, **kw)


def generated(out, prompts=PROMPTS) -> list[list[int]]:
    """Each sequence's generated tokens (beam 0), checking the padding after them."""
    result = []
    for b, p in enumerate(prompts):
        n = int(out.sequence_lengths[b, 0])
        assert out.ids[b, 0, :len(p)].tolist() == p
        assert (out.ids[b, 0, n:] == PAD).all()
        result.append(out.ids[b, 0, len(p):n].tolist())
    return result


@torch.inference_mode()
def hf_generate(hf, prompt, max_new=MAX_NEW, eos=None, **kw):
    """HF greedy: (new tokens, output with scores and logits)."""
    ids = torch.tensor([prompt])
    g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                    eos_token_id=eos, pad_token_id=0, output_scores=True, output_logits=True,
                    return_dict_in_generate=True, **kw)
    return g.sequences[0, len(prompt):].tolist(), g


def word_lists(per_seq: list[list[list[int]]]) -> torch.Tensor:
    """``[batch, 2, len]``: each sequence's words encoded, padded with -1 to a common length."""
    encoded = [encode_words(words) for words in per_seq]
    width = max(e.shape[1] for e in encoded)
    out = torch.full((len(encoded), 2, width), -1, dtype=torch.int32)
    for b, e in enumerate(encoded):
        out[b, :, :e.shape[1]] = e
    return out


@pytest.fixture(scope="module")
def baseline(session):
    """Plain greedy continuations (no end id) of PROMPTS."""
    out = session.generate(inputs())
    tokens = generated(out)
    assert all(len(t) == MAX_NEW for t in tokens)
    return tokens


def first_new_token_at(tokens, start):
    """(index, token) of the first position >= start whose token did not occur before it."""
    i = next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])
    return i, tokens[i]


# -- greedy and its log-probs ---------------------------------------------------------------------


def test_greedy_tokens_and_logprobs_match_hf(session, tiny, baseline):
    """Greedy tokens equal HF's; log_probs/cum_log_probs equal compute_transition_scores(normalize_logits=True)."""
    out = session.generate(inputs())
    assert generated(out) == baseline
    hf = tiny[2]
    for b, prompt in enumerate(PROMPTS):
        tokens, g = hf_generate(hf, prompt)
        assert tokens == baseline[b]
        ref = hf.compute_transition_scores(g.sequences, g.scores, normalize_logits=True)[0]
        torch.testing.assert_close(out.log_probs[b, 0], ref, atol=TOL, rtol=0)
        assert abs(float(out.cum_log_probs[b, 0]) - float(ref.sum())) <= TOL
    assert out.finish_reasons == [["length"], ["length"]]


# -- processors against HF ------------------------------------------------------------------------


@pytest.mark.parametrize("config,hf_kwargs", [
    (SamplingConfig(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
    (SamplingConfig(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
    (SamplingConfig(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2)),
    (SamplingConfig(no_repeat_ngram_size=1), dict(no_repeat_ngram_size=1)),
    (SamplingConfig(repetition_penalty=1.3, no_repeat_ngram_size=3),
     dict(repetition_penalty=1.3, no_repeat_ngram_size=3)),
], ids=["rep1.5", "rep0.7", "ngram2", "ngram1", "rep+ngram3"])
def test_penalties_and_ngram_bans_match_hf(session, tiny, baseline, config, hf_kwargs):
    """repetition_penalty and no_repeat_ngram_size: HF's greedy tokens with the same processor."""
    ours = generated(session.generate(inputs(), config))
    assert ours != baseline, "the control changed nothing: the test would not notice it being ignored"
    for b, prompt in enumerate(PROMPTS):
        assert ours[b] == hf_generate(tiny[2], prompt, **hf_kwargs)[0], f"prompt {b}"


def test_min_length_matches_hf_min_new_tokens(session, tiny, baseline):
    """min_length holds the end id back until that many tokens exist, as HF's min_new_tokens."""
    i, end_id = first_new_token_at(baseline[0], 1)
    assert i < 5
    plain = generated(session.generate(inputs(end_id=end_id)))
    assert plain[0] == baseline[0][:i + 1]  # without min_length it stops at the end id
    for min_length in (i + 2, 6):
        out = session.generate(inputs(end_id=end_id), SamplingConfig(min_length=min_length))
        ours = generated(out)
        assert len(ours[0]) >= min_length and end_id not in ours[0][:min_length]
        for b, prompt in enumerate(PROMPTS):
            ref = hf_generate(tiny[2], prompt, eos=end_id, min_new_tokens=min_length)[0]
            assert ours[b] == ref, f"prompt {b}, min_length {min_length}"
            assert out.finish_reasons[b] == ["end_id" if ref[-1] == end_id else "length"]


def test_default_min_length_lets_the_end_id_come_first(session, baseline):
    """SamplingConfig's default min_length 1 bans nothing: an end id greedy picks first ends at once."""
    end_id = baseline[0][0]
    out = session.generate(inputs(end_id=end_id))
    assert generated(out)[0] == [end_id]
    assert out.finish_reasons[0] == ["end_id"]


def test_bad_words_shared_list_matches_hf(session, tiny, baseline):
    """A shared [2, len] list with a single-token and a two-token word: HF's bad_words_ids result."""
    single = baseline[0][0]
    j = next(j for j in range(1, MAX_NEW) if single not in baseline[1][j - 1:j + 1])
    pair = baseline[1][j - 1:j + 1]
    words = [[single], pair]
    ours = generated(session.generate(inputs(bad_words_list=encode_words(words))))
    assert ours != baseline
    for b, prompt in enumerate(PROMPTS):
        assert ours[b] == hf_generate(tiny[2], prompt, bad_words_ids=words)[0], f"prompt {b}"
        full = prompt + ours[b]
        assert single not in ours[b]
        assert all(full[k:k + 2] != pair for k in range(len(prompt) - 1, len(full) - 1))


def test_bad_words_per_sequence_lists_match_hf(session, tiny, baseline):
    """A [batch, 2, len] list: each sequence bans only its own words (HF run with that sequence's words)."""
    per_seq = [[baseline[0][2:4]], [[baseline[1][1]], [200 % VOCAB, 7, 9]]]
    ours = generated(session.generate(inputs(bad_words_list=word_lists(per_seq))))
    assert ours[0] != baseline[0] and ours[1] != baseline[1]
    for b, prompt in enumerate(PROMPTS):
        assert ours[b] == hf_generate(tiny[2], prompt, bad_words_ids=per_seq[b])[0], f"prompt {b}"


# -- stop words ------------------------------------------------------------------------------------


def stop_point(prompt, tokens, word):
    """Output tokens kept when ``word`` stops generation (it is kept), or None if it never completes."""
    for t in range(len(tokens)):
        seq = prompt + tokens[:t + 1]
        if seq[-len(word):] == word:
            return t + 1
    return None


def test_stop_words_per_sequence_end_exactly(session, baseline):
    """Single- and multi-token stop words end their sequence right after the word; the rest is pad_id."""
    i, single = first_new_token_at(baseline[0], 2)
    j = next(j for j in range(3, MAX_NEW) if stop_point(PROMPTS[1], baseline[1], baseline[1][j - 1:j + 1]) == j + 1)
    pair = baseline[1][j - 1:j + 1]
    unused = next(t for t in range(VOCAB) if t not in baseline[1] + PROMPTS[1])
    out = session.generate(inputs(stop_words_list=word_lists([[[single]], [pair, [unused]]])))
    ours = generated(out)
    assert ours == [baseline[0][:i + 1], baseline[1][:j + 1]]
    assert out.finish_reasons == [["stop_words"], ["stop_words"]]
    assert out.sequence_lengths.tolist() == [[len(PROMPTS[0]) + i + 1], [len(PROMPTS[1]) + j + 1]]
    for b, n in enumerate((i + 1, j + 1)):
        assert (out.log_probs[b, 0, n:] == 0).all() and (out.log_probs[b, 0, :n] < 0).all()


def test_shared_stop_words_list(session, baseline):
    """A shared [2, len] list (a multi-token word) stops every sequence that produces it."""
    pair = baseline[0][3:5]
    out = session.generate(inputs(stop_words_list=encode_words([pair])))
    ours = generated(out)
    for b, prompt in enumerate(PROMPTS):
        n = stop_point(prompt, baseline[b], pair)
        assert ours[b] == (baseline[b][:n] if n else baseline[b])
        assert out.finish_reasons[b] == ["stop_words" if n else "length"]
    assert len(ours[0]) <= 5


# -- embedding bias --------------------------------------------------------------------------------


def test_large_embedding_bias_forces_a_token(session, baseline):
    """+100 on one token: greedy picks it at every step."""
    token = next(t for t in range(3, VOCAB) if t not in baseline[0] + baseline[1])
    bias = torch.zeros(VOCAB)
    bias[token] = 100.0
    assert generated(session.generate(inputs(embedding_bias=bias))) == [[token] * MAX_NEW] * 2


def test_per_sequence_embedding_bias(session, baseline):
    """A [batch, vocab] bias: each sequence follows its own row."""
    tokens = [t for t in range(3, VOCAB) if t not in baseline[0] + baseline[1]][:2]
    bias = torch.zeros(2, VOCAB)
    bias[0, tokens[0]] = bias[1, tokens[1]] = 100.0
    assert generated(session.generate(inputs(embedding_bias=bias))) == [[tokens[0]] * MAX_NEW,
                                                                         [tokens[1]] * MAX_NEW]


def test_moderate_embedding_bias_matches_hf_sequence_bias(session, tiny, baseline):
    """Biases of a few units change some choices exactly as HF's sequence_bias does."""
    bias = torch.zeros(VOCAB)
    changes = {baseline[0][1]: -4.0, baseline[1][2]: -3.0, 40: 2.5, 77: 3.0}
    for t, v in changes.items():
        bias[t] += v
    ours = generated(session.generate(inputs(embedding_bias=bias)))
    assert ours != baseline
    for b, prompt in enumerate(PROMPTS):
        ref = hf_generate(tiny[2], prompt, sequence_bias={(t,): float(bias[t]) for t in changes})[0]
        assert ours[b] == ref, f"prompt {b}"


@pytest.mark.parametrize("bias", [torch.zeros(VOCAB + 1), torch.zeros(3, VOCAB), torch.zeros(2, 2, VOCAB)],
                         ids=["long", "batch3", "3d"])
def test_wrong_embedding_bias_shape_is_an_error(session, baseline, bias):
    """An embedding bias that is not [vocab] or [batch, vocab] raises RequestError; the session still works."""
    with pytest.raises(RequestError, match="embedding_bias"):
        session.generate(inputs(embedding_bias=bias))
    assert generated(session.generate(inputs())) == baseline


# -- context and generation logits -------------------------------------------------------------------


@torch.inference_mode()
def hf_prompt_logits(hf, prompt):
    return hf(torch.tensor([prompt])).logits[0].float()


def test_context_logits_match_hf(session, tiny):
    """An engine built with gather_all_token_logits returns [batch, max_input_len, vocab] prompt logits."""
    out = session.generate(inputs(max_new=2), return_context_logits=True)
    assert out.context_logits.shape == (2, max(map(len, PROMPTS)), VOCAB)
    for b, prompt in enumerate(PROMPTS):
        assert_logits_close(out.context_logits[b, :len(prompt)], hf_prompt_logits(tiny[2], prompt))
        assert (out.context_logits[b, len(prompt):] == 0).all()


def test_context_logits_of_a_chunked_prompt_match_hf(tiny):
    """With a 3-token step budget the prompt is computed in chunks; the gathered logits are unchanged."""
    engine, _, hf = tiny
    core = EngineCore(engine, max_num_tokens=3, num_blocks=32)
    prompt = PROMPTS[1] + PROMPTS[0]  # 12 tokens: four chunks
    request = core.add_request(prompt, SamplingParams(max_tokens=2, temperature=0), None,
                               return_context_logits=True)
    while not request.is_finished:
        core.step()
    assert len(request.context_logits) == 4
    assert_logits_close(torch.cat(request.context_logits), hf_prompt_logits(hf, prompt))
    assert core.pool.num_free == core.pool.num_blocks


def test_context_logits_need_gather_all_token_logits(tiny):
    """Asking for context logits on an engine built without the flag is a RequestError naming it."""
    s = GenerationSession(tiny[1])
    s.setup(batch_size=2)
    with pytest.raises(RequestError, match="--gather_all_token_logits"):
        s.generate(inputs(), return_context_logits=True)
    assert len(generated(s.generate(inputs()))[0]) == MAX_NEW


def test_generation_logits(session, tiny, baseline):
    """return_generation_logits gives [batch, 1, max_new, vocab] raw logits: HF's, argmax = greedy tokens."""
    end_id = baseline[1][4] if baseline[1][4] not in baseline[1][:4] else -1
    out = session.generate(inputs(end_id=end_id), return_generation_logits=True)
    assert out.generation_logits.shape == (2, 1, MAX_NEW, VOCAB)
    ours = generated(out)
    for b, prompt in enumerate(PROMPTS):
        n = len(ours[b])
        assert out.generation_logits[b, 0, :n].argmax(-1).tolist() == ours[b]
        assert (out.generation_logits[b, 0, n:] == 0).all()
        _, g = hf_generate(tiny[2], prompt, max_new=n, eos=None)
        assert_logits_close(out.generation_logits[b, 0, :n], torch.stack(g.logits)[:, 0].float())
    if end_id >= 0:
        assert len(ours[1]) == 5


# -- sampling: seeds and top-p decay ------------------------------------------------------------------


def sampled(session, prompts, **config):
    session.setup(batch_size=len(prompts))
    return generated(session.generate(inputs(prompts), SamplingConfig(**config)), prompts)


def test_seeded_sampling_is_independent_of_the_batch(tiny):
    """A seeded sequence draws the same tokens alone, beside other prompts/params, and on every run."""
    s = GenerationSession(tiny[0])
    knobs = dict(top_k=0, top_p=0.95, temperature=1.5)
    alone = sampled(s, [PROMPTS[0]], random_seed=7, **knobs)[0]
    again = sampled(s, [PROMPTS[0]], random_seed=7, **knobs)[0]
    assert alone == again
    other = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    batch = sampled(s, [other, PROMPTS[0], PROMPTS[1]], random_seed=[3, 7, 11], top_k=[5, 0, 40],
                    top_p=[0.5, 0.95, 0.0], temperature=[0.7, 1.5, 2.0], min_p=[0.1, 0.0, 0.0])
    assert batch[1] == alone
    assert sampled(s, [PROMPTS[1], PROMPTS[0]], random_seed=[5, 7], **knobs)[1] == alone
    different = [sampled(s, [PROMPTS[0]], random_seed=seed, **knobs)[0] for seed in (8, 9)]
    assert alone != different[0] and alone != different[1]


def test_top_p_decay_shrinks_the_nucleus_step_by_step(tiny):
    """With top_p_decay every drawn token lies in the nucleus of top_p * decay**step; once that is
    below the top token's probability sampling is greedy. Without decay late draws vary."""
    s = GenerationSession(tiny[0])
    seeds = list(range(8))
    prompts = [PROMPTS[0]] * 8
    s.setup(batch_size=8)
    temperature, top_p, decay = 1.5, 0.9, 0.5

    def draws(config):
        """Per sequence and step: (mass of the tokens more likely than the drawn one, drawn == argmax)."""
        out = s.generate(inputs(prompts), config, return_generation_logits=True)
        result = []
        for b, tokens in enumerate(generated(out, prompts)):
            assert len(tokens) == MAX_NEW
            probs = (out.generation_logits[b, 0] / temperature).softmax(-1)
            rows = []
            for step, token in enumerate(tokens):
                above = probs[step][probs[step] > probs[step, token]].sum().item()
                rows.append((above, token == int(probs[step].argmax())))
            result.append(rows)
        return result

    plain = draws(SamplingConfig(top_p=top_p, temperature=temperature, random_seed=seeds))
    decayed = draws(SamplingConfig(top_p=top_p, temperature=temperature, top_p_decay=decay, random_seed=seeds))
    for rows in decayed:
        for step, (above, _) in enumerate(rows):
            assert above < max(top_p * decay ** step, 1e-6) + 1e-6, f"step {step} drew outside the nucleus"
    late = range(8, MAX_NEW)  # 0.9 * 0.5**8 = 0.0035: below every top probability here
    assert all(rows[step][1] for rows in decayed for step in late)
    assert sum(not rows[step][1] for rows in plain for step in late) >= 8
    assert all(above < top_p + 1e-6 for rows in plain for above, _ in rows)


def test_top_p_decay_follows_the_state_rule(tiny):
    """After each token: top_p = initial if the token is a reset id, else max(top_p * decay, top_p_min)."""
    engine = tiny[0]

    def run(reset_ids):
        core = EngineCore(engine, num_blocks=16)
        params = SamplingParams(max_tokens=MAX_NEW, top_p=0.9, top_p_decay=0.6, top_p_min=0.2,
                                top_p_reset_ids=reset_ids, temperature=1.5, seed=1234)
        request = core.add_request(PROMPTS[0], params, None)
        seq = request.seqs[0]
        history = [seq.current_top_p]
        while not request.is_finished:
            core.step()
            history.append(seq.current_top_p)
        return seq.output_token_ids, history

    tokens, _ = run([])
    reset = next(tokens[i] for i in range(2, MAX_NEW) if tokens[i] not in tokens[:i])
    tokens, history = run([reset])
    expected = [0.9]
    for t in tokens:
        expected.append(0.9 if t == reset else max(expected[-1] * 0.6, 0.2))
    assert history == pytest.approx(expected)
    assert reset in tokens and 0.2 in history  # both the reset and the floor happened


# -- invalid SamplingConfig -------------------------------------------------------------------------


@pytest.mark.parametrize("config,match", [
    (SamplingConfig(temperature=-1), "temperature"),
    (SamplingConfig(temperature=-1, top_k=5), "temperature"),
    (SamplingConfig(top_p=2), "top_p"),
    (SamplingConfig(top_p=[0.5, 0.9, 0.7]), "top_p has 3 values for a batch of 2"),
    (SamplingConfig(repetition_penalty=[1.1, 1.2, 1.3]), "repetition_penalty has 3 values"),
    (SamplingConfig(repetition_penalty=0), "repetition_penalty"),
    (SamplingConfig(beam_width=2), "beam_width"),
    (SamplingConfig(beam_width=0), "beam_width"),
], ids=["temp-greedy", "temp-sampling", "top_p", "top_p-list", "rep-list", "rep0", "beam-vs-setup", "beam0"])
def test_invalid_sampling_config_is_rejected_and_the_session_recovers(session, baseline, config, match):
    """Each bad value raises RequestError naming it; the next valid call generates as before."""
    with pytest.raises(RequestError, match=match):
        session.generate(inputs(), config)
    assert not session._core.has_unfinished
    assert generated(session.generate(inputs())) == baseline


def test_beam_width_above_the_engine_limit_is_rejected(tiny, baseline):
    """setup() with a beam width over the engine's max_beam_width (2) names the limit; the session still works."""
    s = GenerationSession(tiny[0])
    with pytest.raises(RequestError, match="max_beam_width=2"):
        s.setup(batch_size=1, beam_width=3)
    s.setup(batch_size=2)
    assert generated(s.generate(inputs())) == baseline
