"""Scoring on the bundled SmolLM2 model through ``kiln serve`` (official openai client): the
log-probs ``echo`` returns for prompt tokens are Hugging Face transformers' log-softmax of the
same weights' logits, as lm-evaluation-harness's ``local-completions`` model reads them (token-id
prompts, ``echo``, ``logprobs: 1``, ``max_tokens`` 1 or 0)."""
from __future__ import annotations

import pytest
import torch

TOL = 1e-3  # absolute, in nats: both sides float32 on the same weights (seen: ~1e-5)
TEXTS = ["The capital of France is Paris.", "Water boils at 100 degrees Celsius at sea level.",
         "2 + 2 = 4, and 3 + 3 = 6."]


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)  # row i predicts token i + 1


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_match_hf_log_softmax(served, smollm2_llm, smollm2_hf, max_tokens):
    prompts = [smollm2_llm.tokenizer(t)["input_ids"] for t in TEXTS]
    r = served.client().completions.create(model="smollm2", prompt=prompts, max_tokens=max_tokens, echo=True,
                                           logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, ids, text in zip(r.choices, prompts, TEXTS):
        ref = _hf_logprobs(smollm2_hf, ids)
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens and choice.text.startswith(text)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) <= TOL, (text, i)
            assert abs(max(lp.top_logprobs[i].values()) - float(ref[i - 1].max())) <= TOL, (text, i)
        if max_tokens:  # the generated token (greedy): HF's most likely after the whole prompt
            assert abs(lp.token_logprobs[-1] - float(ref[-1].max())) <= TOL
        else:
            assert choice.text == text and r.usage.completion_tokens == 0
