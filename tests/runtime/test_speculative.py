"""Speculative decoding with n-gram proposals: the proposer, the settings, verification's
rejection rule (sampled tokens follow the target distribution), greedy output identical to plain
greedy, and the KV cache left as plain decoding leaves it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln import LLM, SamplingParams, StructuredOutputsParams
from kiln.bench.common import random_lora_modules
from kiln.config.speculative import SpeculativeConfig
from kiln.errors import ConfigError
from kiln.layers.lora import LoraAdapter
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.grammar_masks import GrammarMasks
from kiln.runtime.logits_processors import TokenHistory
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative import propose_ngram
from kiln.runtime.verification import verify
from tests.utils.fakes import make_tiny_llama_with_tokenizer

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = [5, 6, 7, 1, 2, 5, 6, 9, 8, 5, 6]
    assert propose_ngram(tokens, NGRAM, limit=10) == [9, 8, 5]  # "5 6" last seen before 9 8
    assert propose_ngram(tokens, NGRAM, limit=2) == [9, 8]
    assert propose_ngram([1, 2, 3, 7, 8, 2, 3], NGRAM, limit=5) == [7, 8, 2]  # the 2-gram beats the 1-gram "3"
    assert propose_ngram([1, 2, 3, 4], NGRAM, limit=5) == []  # nothing repeats
    assert propose_ngram(tokens, SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=3), limit=5) == []


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "method must be one of"), ({"num_speculative_tokens": 0}, "in \\[1, 16\\]"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"num_tokens": 4}, "unknown keys \\['num_tokens'\\]"), ({"num_speculative_tokens": "4"}, "must be an integer"),
    ("{not json", "not JSON"), ([1], "must be a dict")])
def test_bad_settings_are_config_errors_naming_the_key(value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_settings_parse_from_vllm_dicts_and_json() -> None:
    expected = SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_max=4, prompt_lookup_min=2)
    spec = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert SpeculativeConfig.parse(spec) == expected
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 6, "prompt_lookup_min": 2}') == expected
    assert SpeculativeConfig.parse(None) is None


def test_verified_samples_follow_the_target_distribution() -> None:
    """The rejection rule over two proposals: the first token's frequencies match the target's
    filtered distribution (temperature 0.8, top-k 6) and, after the first proposal is kept, the
    second's match the second row's; total variation under 0.02 over 20,000 draws, and under
    0.025 over the ~10,000 where the first proposal was kept (the sampling noise of a 6-way
    distribution at these counts is about 0.008 and 0.012)."""
    torch.manual_seed(0)
    vocab, draws = 8, 20_000
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=8)
    proposals = [int(logits[0].argmax()), int(logits[1].argsort()[-2])]  # kept often; often not

    def target(row: int) -> torch.Tensor:
        scaled = logits[row] / 0.8
        kept = scaled.topk(6).indices
        p = torch.zeros(vocab)
        p[kept] = scaled[kept].softmax(dim=0)
        return p

    first, second = torch.zeros(vocab), torch.zeros(vocab)
    history, grammars = TokenHistory(64, vocab), GrammarMasks()
    for i in range(draws):
        seq = Sequence(i, [1, 2, 3], dataclasses.replace(params, seed=i), None, 64)
        tokens = [r.token for r in verify(logits.clone(), seq, proposals, history, grammars)]
        assert seq.token_ids == [1, 2, 3]  # what verification tried is taken back
        first[tokens[0]] += 1
        if tokens[0] == proposals[0]:
            second[tokens[1]] += 1
    assert 0.5 * (first / draws - target(0)).abs().sum() < 0.02
    assert second.sum() > 5000 and 0.5 * (second / second.sum() - target(1)).abs().sum() < 0.025


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (float32) as LLM, plain and with n-gram speculation."""
    root = tmp_path_factory.mktemp("speculative")
    make_tiny_llama_with_tokenizer(root / "hf")
    plain = LLM(root / "hf", cache_dir=root / "cache", dtype="float32", progress=False)
    spec = LLM(plain.engine_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                     "prompt_lookup_min": 1}, progress=False)
    return plain, spec


PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [20, 21, 22, 23, 20, 21], [7, 7, 7, 7], [30, 31, 32, 33, 34, 35]]


def test_greedy_output_is_plain_greedy_token_for_token(tiny) -> None:
    plain, spec = tiny
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    expected = plain.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for got_top, expected_top in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert got_top == pytest.approx(expected_top, abs=1e-4)
    stats = spec.core.stats.spec
    assert stats.num_accepted_tokens > 10 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert stats.mean_accepted_length == 1 + stats.num_accepted_tokens / stats.num_drafts > 1
    assert spec.core.stats.num_steps < plain.core.stats.num_steps  # kept proposals saved steps
    # Penalties and stop tokens see the proposals as tokens, as plain decoding sees its tokens.
    controlled = SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, no_repeat_ngram_size=3,
                                stop_token_ids=[expected[0].outputs[0].token_ids[25]])
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, controlled)] == \
        [o.outputs[0].token_ids for o in plain.generate(PROMPTS, controlled)]


def test_a_draft_model_proposes_and_greedy_stays_plain_greedy(tiny, tmp_path) -> None:
    """The target itself as its draft keeps every proposal; a different model of the same
    vocabulary (other random weights, one layer) keeps few; both give plain greedy's tokens."""
    plain, _ = tiny
    other = tmp_path / "other"
    make_tiny_llama_with_tokenizer(other / "hf", seed=7, layers=1)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    for draft in (plain.engine_dir, other / "hf"):
        spec = LLM(plain.engine_dir, speculative_config={"method": "draft_model", "model": str(draft),
                                                         "num_speculative_tokens": 3},
                   cache_dir=tmp_path / "cache", progress=False)
        assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == expected
        stats = spec.core.stats.spec
        assert stats.num_drafts > 0
        if draft == plain.engine_dir:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
            assert spec.core.speculator.drafter.core.has_unfinished is False  # mirrors end with their sequences
    with pytest.raises(ConfigError, match="speculative_config.model"):
        SpeculativeConfig.parse({"method": "draft_model"})


def _run(core: EngineCore, prompt: list[int], tokens: int) -> Sequence:
    request = core.add_request(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), None)
    (seq,) = request.seqs
    while seq.num_output_tokens < tokens:
        core.step()
    return seq


def test_the_kv_cache_holds_what_plain_decoding_writes(tiny) -> None:
    """After 24 tokens, the K/V of every computed position equal plain decoding's, and the
    sequence holds no block past its tokens (those of rejected proposals went back)."""
    plain, spec = tiny
    cores = [EngineCore(plain.engine, num_blocks=64),
             EngineCore(plain.engine, num_blocks=64, speculative_config=SpeculativeConfig(num_speculative_tokens=4))]
    seqs = [_run(core, PROMPTS[0], 24) for core in cores]
    assert cores[1].stats.spec.num_accepted_tokens > 0 and cores[0].stats.spec is None
    n = min(s.num_computed_tokens for s in seqs)
    assert seqs[0].token_ids[:n] == seqs[1].token_ids[:n]
    block = plain.engine.build_config.tokens_per_block
    assert len(seqs[1].block_ids) == -(-seqs[1].num_tokens // block)
    for (k0, v0), (k1, v1) in zip(cores[0].runner.kv_caches, cores[1].runner.kv_caches):
        for pos in range(n):
            b0, b1 = seqs[0].block_ids[pos // block], seqs[1].block_ids[pos // block]
            torch.testing.assert_close(k1[b1, :, pos % block], k0[b0, :, pos % block], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v1[b1, :, pos % block], v0[b0, :, pos % block], atol=1e-5, rtol=1e-5)


TEXT = ("Kiln converts external checkpoints into one unified checkpoint, builds that into an engine, and runs it "
        "with a fast runtime. It aims to beat the engines people use today on the machines they run it on.")
CHATS = [[{"role": "user", "content": f"Copy this text exactly, word for word:\n\n{TEXT}"}],
         [{"role": "user", "content": f"Summarize in one sentence:\n\n{TEXT}"}],
         [{"role": "user", "content": "Name three rivers in Europe."}],
         [{"role": "user", "content": "Write a haiku about speculative decoding."}]]


@pytest.mark.parametrize("dtype", ["bfloat16", None])
def test_bfloat16_greedy_is_plain_greedy_too(dtype, tmp_path_factory) -> None:
    """bfloat16 activations, whose rounding flips near-ties wherever a row's arithmetic differs:
    a step verifying proposals computes each row as a plain decode step does, bit for bit, so
    greedy output is plain greedy's, as in float32. A bfloat16 engine whatever the batch (the
    four chats decode together); the file's own Q4_1 linears while a step holds at most 8 rows
    (the GEMV's; more take dequantized tiles, other arithmetic), so one chat at a time."""
    from tests.utils.real_model import smollm2_gguf_path

    plain = LLM(smollm2_gguf_path(), cache_dir=tmp_path_factory.mktemp("smollm2"), dtype=dtype, max_seq_len=512,
                progress=False)
    spec = LLM(plain.engine_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 6},
               progress=False)
    params = SamplingParams(max_tokens=64, temperature=0)
    batches = [CHATS] if dtype else [[chat] for chat in CHATS]
    for chats in batches:
        assert [o.outputs[0].token_ids for o in spec.chat(chats, params)] == \
            [o.outputs[0].token_ids for o in plain.chat(chats, params)]
    assert spec.core.stats.spec.num_accepted_tokens > 0


def test_bundled_model_greedy_is_plain_greedy(smollm2_llm) -> None:
    """The bundled SmolLM2 (float32): copying, summarizing and open prompts, with proposals of
    up to 6 tokens, give plain greedy's tokens; copying keeps most proposals."""
    spec = LLM(smollm2_llm.engine_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 6,
                                                           "prompt_lookup_min": 2}, progress=False)
    params = SamplingParams(max_tokens=48, temperature=0)
    expected = [o.outputs[0].token_ids for o in smollm2_llm.chat(CHATS, params)]
    got = [o.outputs[0].token_ids for o in spec.chat(CHATS, params)]
    assert got == expected
    before = spec.core.stats.spec.num_accepted_tokens
    copied = spec.chat(CHATS[:1], params)[0].outputs[0].token_ids
    assert spec.core.stats.spec.num_accepted_tokens - before >= 0.5 * len(copied)
    # With a grammar (the proposals are masked row by row) and under a LoRA adapter, alike.
    held = SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(
        regex=r"Kiln converts [a-z ,]+\."))
    assert [o.outputs[0].text for o in spec.chat(CHATS[:1], held)] == \
        [o.outputs[0].text for o in smollm2_llm.chat(CHATS[:1], held)]
    adapter = LoraAdapter(random_lora_modules(smollm2_llm.engine.config, 8, ("attn_q", "attn_v"), scale=0.05))
    assert spec.chat(CHATS[:2], params, lora=adapter)[1].outputs[0].token_ids == \
        smollm2_llm.chat(CHATS[:2], params, lora=adapter)[1].outputs[0].token_ids
