"""kiln.LLM end to end on a tiny Llama with a tiny tokenizer: engine cache, generate, chat, stream."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kiln.build
import kiln.convert
from kiln import LLM, SamplingParams
from kiln.config.engine_args import EngineArgs
from kiln.errors import ConfigError, RequestError
from kiln.examples import smollm2_gguf_path
from kiln.runtime.structured_outputs import StructuredOutputsParams
from tests.utils.compare import hf_greedy
from tests.utils.fakes import make_tiny_llama_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "the quick brown fox"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
EOS = 2


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(hf_dir, hf_model, tokenizer)."""
    hf_dir = tmp_path_factory.mktemp("llm") / "tinyllama"
    model, tokenizer = make_tiny_llama_with_tokenizer(hf_dir)
    return hf_dir, model, tokenizer


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def llm(hf, cache):
    return LLM(hf[0], cache_dir=cache, progress=False)


def dirs(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir())


def forbidden(*args, **kwargs):
    raise AssertionError("a conversion or build ran that was not needed")


def forbid_conversion(monkeypatch, build_too: bool = True):
    monkeypatch.setattr(kiln.convert, "convert_checkpoint", forbidden)
    if build_too:
        monkeypatch.setattr(kiln.build, "build_engine", forbidden)


def test_first_call_builds_one_engine_into_the_cache(llm, cache):
    """An HF dir is converted and built into the cache: one engine dir, no checkpoint or temp dirs left."""
    assert dirs(cache) == [llm.engine_dir.name]
    assert llm.engine_dir.parent == cache and llm.engine_dir.name.startswith("tinyllama-")
    assert (llm.engine_dir / "config.json").is_file() and (llm.engine_dir / "tokenizer.json").is_file()


def test_second_call_reuses_the_cached_engine(llm, hf, cache, monkeypatch):
    """A second LLM on the same HF dir loads the cached engine without converting or building."""
    forbid_conversion(monkeypatch)
    started = time.perf_counter()
    again = LLM(hf[0], cache_dir=cache, progress=False)
    assert again.engine_dir == llm.engine_dir
    assert dirs(cache) == [llm.engine_dir.name]
    assert time.perf_counter() - started < 10


def test_generate_matches_hf_greedy(llm, hf):
    """generate returns HF's greedy ids, their decoded text and finish_reason 'length' with ignore_eos."""
    _, model, tokenizer = hf
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    [out] = llm.generate(PROMPT, GREEDY)
    completion = out.outputs[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == prompt_ids
    assert completion.token_ids == hf_greedy(model, [prompt_ids], 8)[0]
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.finish_reason == "length"


def test_generate_stops_at_eos(llm, hf):
    """Without ignore_eos, generation ends at the first end-of-sequence token with finish_reason 'stop'."""
    _, model, tokenizer = hf
    prompt_ids = tokenizer("hello world, how are you today?")["input_ids"]
    reference = hf_greedy(model, [prompt_ids], 8)[0]
    assert EOS in reference[1:-1], "the tiny model should produce eos mid-way for this prompt"
    completion = llm.generate(prompt_ids, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert completion.token_ids == reference[: reference.index(EOS) + 1]
    assert completion.finish_reason == "stop"


def test_checkpoint_and_engine_dirs_work_directly(llm, hf, tmp_path, monkeypatch):
    """A kiln checkpoint (built, not converted) and an engine dir (used as is) give the same greedy text."""
    checkpoint = kiln.convert.convert_checkpoint(hf[0], tmp_path / "checkpoint", progress=False)
    expected = llm.generate(PROMPT, GREEDY)[0].outputs[0]
    forbid_conversion(monkeypatch, build_too=False)  # a checkpoint is only built
    from_checkpoint = LLM(checkpoint, cache_dir=tmp_path / "cache", progress=False)
    assert dirs(tmp_path / "cache") == [from_checkpoint.engine_dir.name]
    forbid_conversion(monkeypatch)
    from_engine = LLM(llm.engine_dir, cache_dir=tmp_path / "unused", progress=False)
    assert from_engine.engine_dir == llm.engine_dir and not (tmp_path / "unused").exists()
    for other in (from_checkpoint, from_engine):
        got = other.generate(PROMPT, GREEDY)[0].outputs[0]
        assert (got.text, got.token_ids) == (expected.text, expected.token_ids)


def test_chat_uses_the_chat_template(llm, hf):
    """chat renders the conversation with the tokenizer's template and generates from it."""
    _, model, tokenizer = hf
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    template_ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert template_ids[-2:] != tokenizer("hello world")["input_ids"][-2:]  # the template did add something
    [out] = llm.chat(messages, GREEDY)
    assert out.prompt_token_ids == template_ids
    assert out.outputs[0].token_ids == hf_greedy(model, [template_ids], 8)[0]


def test_stream_deltas_add_up_to_generate(llm):
    """The streamed deltas concatenate to generate's text and ids; only the last one is final."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = llm.generate(PROMPT, params)[0].outputs[0]
    deltas = list(llm.stream(PROMPT, params))
    assert "".join(d.text for d in deltas) == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length"


def test_rejected_prompt_rejects_the_whole_batch(llm):
    """A prompt over max_input_len raises RequestError naming the limit and leaves nothing queued."""
    with pytest.raises(RequestError, match="max_input_len"):
        llm.generate([PROMPT, [5] * 1000], GREEDY)
    assert not llm.core.has_unfinished


RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from kiln import LLM
    print("ready", flush=True)
    while not Path({go!r}).exists():
        time.sleep(0.01)
    print(LLM({hf!r}, cache_dir={cache!r}, progress=False).engine_dir, flush=True)
""")


def test_two_processes_racing_build_one_engine(hf, tmp_path):
    """Two processes building the same engine at once both succeed and leave one engine, no temp dirs."""
    cache, go = tmp_path / "cache", tmp_path / "go"
    code = RACER.format(root=str(ROOT), go=str(go), hf=str(hf[0]), cache=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    go.touch()  # both are loaded: start them together
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    engine_dirs = {out.strip() for out, _ in results}
    assert len(engine_dirs) == 1
    assert dirs(cache) == [Path(engine_dirs.pop()).name]
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]


def test_quantization_converts_into_an_engine_of_its_own(llm, hf, tmp_path):
    """LLM(..., quantization=...) quantizes while converting; each setting gets its own cached
    engine, and calibrated settings take the convert options."""
    import json

    from kiln.config import QuantConfig

    cache = tmp_path / "cache"
    w8 = LLM(hf[0], cache_dir=cache, progress=False, quantization="W8A16")
    config = json.loads((w8.engine_dir / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W8A16" and config["dtype"] == "bfloat16"
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog and the quick brown fox runs")
    fp8 = LLM(hf[0], cache_dir=cache, progress=False,
              quantization={"quant_algo": "FP8", "kv_cache_quant_algo": "INT8", "calib_dataset": str(calib),
                            "calib_size": 1})
    config = json.loads((fp8.engine_dir / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "FP8" and config["quantization"]["kv_cache_quant_algo"] == "INT8"
    assert len(dirs(cache)) == 2 and w8.engine_dir != fp8.engine_dir
    again = LLM(hf[0], cache_dir=cache, progress=False, quantization=QuantConfig(quant_algo="W8A16"))
    assert again.engine_dir == w8.engine_dir  # the same setting, however it is spelled
    # Quantized engines still answer like the float one on this easy prompt's first tokens.
    reference = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    assert w8.generate(PROMPT, GREEDY)[0].outputs[0].token_ids[:4] == reference[:4]
    with pytest.raises(ConfigError, match="unknown fields"):
        LLM(hf[0], cache_dir=cache, progress=False, quantization={"quant_algo": "W8A16", "bits": 3})
    with pytest.raises(ConfigError, match="is not one of"):
        LLM(hf[0], cache_dir=cache, progress=False, quantization="W3A16")
    with pytest.raises(ConfigError, match="kiln engine"):
        LLM(llm.engine_dir, progress=False, quantization="W8A16")


def test_a_request_failing_inside_the_engine_raises_and_leaves_nothing_queued(llm, monkeypatch):
    """generate raises the failing request's error; the other prompts of the call are dropped,
    every KV block comes back, and the next call is served."""
    from kiln.runtime import model_runner

    sample = model_runner.sample
    monkeypatch.setattr(model_runner, "sample", lambda logits, seqs: (_ for _ in ()).throw(RuntimeError("boom"))
                        if any(s.token_ids[0] == 7 for s in seqs) else sample(logits, seqs))
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[7, 8, 9], [5, 6]], GREEDY)
    pool = llm.core.pool
    assert pool.num_free == pool.num_blocks and not llm.core.has_unfinished
    assert len(llm.generate([[5, 6]], GREEDY)[0].outputs[0].token_ids) == 8


# -- skip_tokenizer_init and tokenizers from GGUF files ---------------------------------------


@pytest.fixture(scope="module")
def bare(llm):
    """The tiny engine without a tokenizer (token ids in and out)."""
    return LLM(llm.engine_dir, skip_tokenizer_init=True, progress=False)


def test_skip_tokenizer_init_generates_the_same_token_ids(llm, bare, hf):
    """Without a tokenizer the same token-id prompt gives the same greedy ids, log-probs and
    finish reasons (ending at the engine's end id), with empty text; streaming too."""
    prompt_ids = hf[2]("hello world, how are you today?")["input_ids"]
    assert bare.tokenizer is None and bare.processor.end_id == llm.processor.end_id == EOS
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    [want], [got] = llm.generate(prompt_ids, params), bare.generate(prompt_ids, params)
    assert want.outputs[0].text and EOS in want.outputs[0].token_ids  # the comparison covers stopping at eos
    assert got.prompt_token_ids == want.prompt_token_ids
    for a, b in zip(got.outputs, want.outputs):
        assert (a.text, a.token_ids, a.finish_reason, a.logprobs) == ("", b.token_ids, b.finish_reason, b.logprobs)
    deltas = list(bare.stream(prompt_ids, GREEDY))
    assert [t for d in deltas for t in d.token_ids] == llm.generate(prompt_ids, GREEDY)[0].outputs[0].token_ids
    assert {d.text for d in deltas} == {""}


@pytest.mark.parametrize("field, params", [
    ("stop", SamplingParams(stop=["fox"])),
    ("bad_words", SamplingParams(bad_words=["fox"])),
    ("structured_outputs", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))),
])
def test_skip_tokenizer_init_refuses_what_needs_a_tokenizer(bare, field, params):
    with pytest.raises(RequestError, match=f"^{field} must not be set without a tokenizer"):
        bare.generate([[5, 6], [5, 7]], params)
    assert not bare.core.has_unfinished


def test_skip_tokenizer_init_refuses_text_and_chat(bare, hf):
    with pytest.raises(RequestError, match="^prompt must be token ids"):
        bare.generate([[5, 6], PROMPT], GREEDY)
    with pytest.raises(RequestError, match="^prompt must be token ids"):
        next(bare.stream(PROMPT, GREEDY))
    with pytest.raises(RequestError, match="^messages: chat renders them with the tokenizer's chat template"):
        bare.chat([{"role": "user", "content": "hello"}], GREEDY)
    assert not bare.core.has_unfinished
    with pytest.raises(ConfigError, match="skip_tokenizer_init=True loads no tokenizer"):
        EngineArgs(model="m", tokenizer=hf[0], skip_tokenizer_init=True)


def test_a_bad_tokenizer_path_is_a_config_error_naming_the_flag(llm, tmp_path):
    from tests.utils.tiny_gguf import write_llama

    not_gguf, no_tokenizer = tmp_path / "tokenizer.txt", tmp_path / "weights-only.gguf"
    not_gguf.write_text("hello")
    write_llama(no_tokenizer, [])  # a GGUF file without tokenizer metadata
    for path, reason in ((tmp_path / "missing", "--tokenizer_dir {}: no such file or directory"),
                         (not_gguf, "--tokenizer_dir {}: neither a directory nor a GGUF file"),
                         (no_tokenizer, "{}: no usable tokenizer .* pass --tokenizer_dir")):
        with pytest.raises(ConfigError, match=reason.format(re.escape(str(path)))):
            LLM(llm.engine_dir, tokenizer=path, progress=False)


def test_a_gguf_file_is_a_tokenizer(smollm2_llm, smollm2_engine_without_tokenizer):
    """tokenizer= a GGUF file reads the tokenizer (chat template and end id too) from its
    metadata: an engine without a tokenizer then answers as the engine built with it does."""
    with pytest.raises(ConfigError, match="carries no tokenizer"):
        LLM(smollm2_engine_without_tokenizer, progress=False)
    llm = LLM(smollm2_engine_without_tokenizer, tokenizer=smollm2_gguf_path(), kv_cache_max_tokens=1024,
              progress=False)
    assert llm.processor.end_id == smollm2_llm.processor.end_id is not None
    params = SamplingParams(max_tokens=8, temperature=0)
    [want], [got] = (m.generate("The capital of France is", params) for m in (smollm2_llm, llm))
    assert (got.prompt_token_ids, got.outputs[0].token_ids, got.outputs[0].text) == \
        (want.prompt_token_ids, want.outputs[0].token_ids, want.outputs[0].text) and want.outputs[0].text
    messages = [{"role": "user", "content": "Hi"}]
    assert llm.chat(messages, params)[0].prompt_token_ids == smollm2_llm.chat(messages, params)[0].prompt_token_ids
