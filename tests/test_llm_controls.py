"""LLM API and ``kiln run`` generation controls on a tiny Llama with a tiny trained tokenizer.

Stop strings, bad words and biases are chosen from a first greedy run so each one bites;
log-probs are checked against Hugging Face's logits of the same tokens.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.utils.fakes import make_tiny_llama_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "the quick brown fox"
MAX = 16
GREEDY = SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(hf_dir, hf_model, tokenizer); lm_head scaled x2."""
    hf_dir = tmp_path_factory.mktemp("llm-controls") / "tiny"
    hf, tokenizer = make_tiny_llama_with_tokenizer(hf_dir)
    with torch.no_grad():
        hf.lm_head.weight.mul_(2)
    hf.save_pretrained(hf_dir)
    return hf_dir, hf, tokenizer


@pytest.fixture(scope="module")
def llm(model, tmp_path_factory):
    return LLM(model[0], cache_dir=tmp_path_factory.mktemp("cache"), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def baseline(llm):
    """The plain greedy completion of PROMPT."""
    out = llm.generate(PROMPT, GREEDY)[0].outputs[0]
    assert len(out.token_ids) == MAX and out.finish_reason == "length"
    return out


@pytest.fixture(scope="module")
def stop_string(baseline):
    """Three characters from the middle of the greedy text."""
    text = baseline.text
    at = len(text) // 3
    stop = text[at:at + 3]
    assert stop.strip() and 0 < text.find(stop) < len(text) - 3
    return stop


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@torch.inference_mode()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of ``ids``."""
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


# -- stop strings ---------------------------------------------------------------------------------


def test_stop_string_ends_and_is_excluded(llm, baseline, stop_string):
    """The text stops before the stop string; tokens end with the one that completed it."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX, temperature=0, stop=[stop_string]))[0].outputs[0]
    full = baseline.text
    assert out.text == full[:full.find(stop_string)]
    assert out.finish_reason == "stop" and out.stop_reason == stop_string
    k = next(k for k in range(1, MAX + 1) if stop_string in llm.tokenizer.decode(baseline.token_ids[:k]))
    assert out.token_ids == baseline.token_ids[:k]
    assert k < MAX


def test_stop_string_kept_with_include_stop_str_in_output(llm, baseline, stop_string):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX, temperature=0, stop=[stop_string],
                                              include_stop_str_in_output=True))[0].outputs[0]
    full = baseline.text
    assert out.text == full[:full.find(stop_string) + len(stop_string)]
    assert out.text.endswith(stop_string)
    assert out.finish_reason == "stop" and out.stop_reason == stop_string


def test_stream_never_shows_the_stop_string(llm, baseline, stop_string):
    """stream() with a stop string: no prefix of the streamed text contains it; the whole equals generate()'s."""
    params = SamplingParams(max_tokens=MAX, temperature=0, stop=[stop_string])
    text, tokens, deltas = "", [], list(llm.stream(PROMPT, params))
    for delta in deltas:
        text += delta.text
        tokens += delta.token_ids
        assert stop_string not in text
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert not any(d.finished for d in deltas[:-1])
    expected = llm.generate(PROMPT, params)[0].outputs[0]
    assert text == expected.text and tokens == expected.token_ids
    assert not llm.core.has_unfinished


# -- bad words -------------------------------------------------------------------------------------


def test_bad_words_never_appear(llm, baseline):
    """bad_words=[word]: neither tokenization of the word (at a word start or mid-text) is generated."""
    tokenizer = llm.tokenizer
    variants = lambda w: [tokenizer(v, add_special_tokens=False)["input_ids"] for v in (w, " " + w)]  # noqa: E731
    word = next(w for w in baseline.text.split() if any(contains(baseline.token_ids, ids) for ids in variants(w)))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True,
                                              bad_words=[word]))[0].outputs[0]
    assert out.token_ids != baseline.token_ids
    for ids in variants(word):
        assert not contains(out.token_ids, ids), (word, ids, out.token_ids)


# -- log-probs -------------------------------------------------------------------------------------


def test_logprobs_top_k_and_cumulative(llm, model):
    """logprobs=3: each token's dict holds it and HF's top 3 log-probs; cumulative_logprob is their sum."""
    (result,) = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3))
    out = result.outputs[0]
    ref = hf_logprobs(model[1], result.prompt_token_ids + out.token_ids)[len(result.prompt_token_ids) - 1:-1]
    assert len(out.logprobs) == len(out.token_ids) == 8
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token in entry and len(entry) in (3, 4)
        top = ref[step].topk(3).indices.tolist()
        assert set(top) <= set(entry) and set(entry) <= set(top) | {token}
        for t, value in entry.items():
            assert abs(value - float(ref[step, t])) <= TOL
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)), abs=1e-5)


def test_prompt_logprobs_match_hf(llm, model):
    """prompt_logprobs=2: [None, {...}, ...] with each prompt token and the top 2, from HF's prompt logits."""
    (result,) = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    ids = result.prompt_token_ids
    logprobs = result.prompt_logprobs
    assert len(logprobs) == len(ids) >= 3 and logprobs[0] is None
    ref = hf_logprobs(model[1], ids)
    for i in range(1, len(ids)):
        entry = logprobs[i]
        assert ids[i] in entry and set(ref[i - 1].topk(2).indices.tolist()) <= set(entry) and len(entry) <= 3
        for t, value in entry.items():
            assert abs(value - float(ref[i - 1, t])) <= TOL


# -- several outputs -------------------------------------------------------------------------------


def test_n_seeded_samples_differ_and_reproduce(llm):
    """n=3 with a seed: three different outputs, the same three on a second call; another seed differs."""
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPT, params)[0].outputs]
    assert len(first) == 3 and len({tuple(t) for t in first}) == 3
    assert [o.token_ids for o in llm.generate(PROMPT, params)[0].outputs] == first
    other = SamplingParams(n=3, temperature=1.0, seed=43, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPT, other)[0].outputs] != first


def test_best_of_returns_the_most_likely_samples(llm):
    """best_of=4, n=2: of the four seeded samples, the two with the highest cumulative log-prob, best first."""
    common = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    all_four = llm.generate(PROMPT, SamplingParams(n=4, logprobs=0, **common))[0].outputs
    ranked = sorted(all_four, key=lambda o: -o.cumulative_logprob)
    best = llm.generate(PROMPT, SamplingParams(n=2, best_of=4, **common))[0].outputs
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.cumulative_logprob for o in best] == pytest.approx([o.cumulative_logprob for o in ranked[:2]])
    assert ranked[0].cumulative_logprob > ranked[-1].cumulative_logprob


# -- biases and the end token ----------------------------------------------------------------------


def test_logit_bias_forces_a_token(llm, baseline):
    token = next(t for t in range(4, 60) if t not in baseline.token_ids)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, logit_bias={token: 100}))[0].outputs[0]
    assert out.token_ids == [token] * 6


def test_ignore_eos(llm):
    """With the end token forced: it ends the output at once, unless ignore_eos."""
    forced = dict(max_tokens=5, temperature=0, logit_bias={llm.processor.end_id: 100})
    out = llm.generate(PROMPT, SamplingParams(**forced))[0].outputs[0]
    assert out.token_ids == [llm.processor.end_id] and out.finish_reason == "stop" and out.text == ""
    out = llm.generate(PROMPT, SamplingParams(ignore_eos=True, **forced))[0].outputs[0]
    assert out.token_ids == [llm.processor.end_id] * 5 and out.finish_reason == "length"


def test_ignore_eos_also_ignores_the_models_extra_end_ids(llm, monkeypatch):
    """A model with several end ids (generation_config lists them): ignore_eos runs past every one."""
    extra = 5
    monkeypatch.setattr(llm.processor, "extra_stop_ids", [extra])
    forced = dict(max_tokens=5, temperature=0, logit_bias={extra: 100})
    out = llm.generate(PROMPT, SamplingParams(**forced))[0].outputs[0]
    assert out.token_ids == [extra] and out.finish_reason == "stop"
    out = llm.generate(PROMPT, SamplingParams(ignore_eos=True, **forced))[0].outputs[0]
    assert out.token_ids == [extra] * 5 and out.finish_reason == "length"


# -- kiln run --------------------------------------------------------------------------------------

CLI_CASES = {
    "stop": ["--max_output_len", "12"],  # + --stop STOP (added in the fixture)
    "beams": ["--max_output_len", "8", "--num_beams", "2", "--num_return_sequences", "2"],
    "logprobs": ["--max_output_len", "6", "--logprobs", "2"],
    "repetition": ["--max_output_len", "12", "--repetition_penalty", "1.2"],
    "logit_bias": ["--max_output_len", "6", "--logit_bias", json.dumps({"5": 10})],
    "bad_top_p": ["--max_output_len", "6", "--top_p", "2"],
}


@pytest.fixture(scope="module")
def cli(llm, stop_string):
    """name -> (argv after `run`, CompletedProcess); the processes run concurrently."""
    argvs = {}
    for name, extra in CLI_CASES.items():
        argv = ["--engine_dir", str(llm.engine_dir), "--input_text", PROMPT, *extra]
        if name == "stop":
            argv += ["--stop", stop_string]
        argvs[name] = argv
    procs = {name: subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "run", *argv], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, argv in argvs.items()}
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[name] = (argvs[name], subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def expected(llm, argv):
    """What LLM.generate gives for the SamplingParams `kiln run argv` builds."""
    from kiln.cli.main import build_parser
    from kiln.cli.run import sampling_params

    params = sampling_params(build_parser().parse_args(["run", *argv]))
    return params, llm.generate(PROMPT, params)[0].outputs


def ok(result):
    assert result.returncode == 0, result.stderr
    assert "prompt tokens" in result.stderr
    return result.stdout


def test_cli_stop(cli, llm, stop_string):
    argv, result = cli["stop"]
    (out,) = expected(llm, argv)[1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_string
    assert ok(result) == out.text + "\n"
    assert stop_string not in result.stdout
    assert "finish: stop" in result.stderr


def test_cli_beam_search(cli, llm):
    argv, result = cli["beams"]
    params, outs = expected(llm, argv)
    assert params.use_beam_search and params.beam_width == 2 and params.n == 2
    stdout = ok(result)
    for out in outs:
        header = f"--- output {out.index} (finish: {out.finish_reason}, cumulative logprob"
        assert header in stdout
        assert stdout.split(header)[1].split("\n", 1)[1].startswith(out.text + "\n")
    assert "--- output 2" not in stdout


def test_cli_logprobs(cli, llm):
    argv, result = cli["logprobs"]
    (out,) = expected(llm, argv)[1]
    stdout = ok(result)
    lines = [line.strip() for line in stdout.splitlines() if line.startswith("    ")]
    assert len(lines) == len(out.token_ids) == 6
    for line, token, entry in zip(lines, out.token_ids, out.logprobs):
        assert line.startswith(f"{token}: {entry[token]:.4f}  top ")
        assert len(entry) in (2, 3)


def test_cli_repetition_penalty(cli, llm, baseline):
    argv, result = cli["repetition"]
    params, (out,) = expected(llm, argv)
    assert params.repetition_penalty == 1.2
    assert ok(result) == out.text + "\n"
    assert out.token_ids != baseline.token_ids[:12]


def test_cli_logit_bias(cli, llm):
    argv, result = cli["logit_bias"]
    params, (out,) = expected(llm, argv)
    assert params.logit_bias == {5: 10}
    assert out.token_ids == [5] * 6
    assert ok(result) == out.text + "\n"


def test_cli_bad_value_is_one_line_exit_2(cli):
    _, result = cli["bad_top_p"]
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln run: error:") and "top_p" in lines[0]
