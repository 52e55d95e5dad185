"""The request processor LLM and the server share: engine params from a user's SamplingParams,
text with stop strings, finish reasons (the end-to-end behaviour is in test_llm_controls.py and
tests/serve; this pins down the mapping itself on a tiny tokenizer)."""
from __future__ import annotations

import pytest

from kiln import SamplingParams
from kiln.errors import RequestError
from kiln.runtime import Request
from kiln.runtime.request_processor import RequestProcessor
from kiln.runtime.sequence import FinishReason
from tests.utils.fakes import make_tiny_tokenizer


@pytest.fixture(scope="module")
def processor():
    return RequestProcessor(make_tiny_tokenizer(), [2, 7])  # </s> and an extra end id


def test_end_ids_bad_words_and_stop_strings(processor):
    params = SamplingParams(stop=["the"], bad_words=["hello"], stop_token_ids=[9])
    engine = processor.engine_params(params)
    assert processor.end_id == 2 and engine.stop_token_ids == [9, 7]
    assert engine.stop == [] and engine.bad_words == []  # text: matched on the text, tokenized here
    tokenize = processor.tokenizer
    variants = [tokenize(w, add_special_tokens=False)["input_ids"] for w in ("hello", " hello")]
    assert all(v in engine.bad_words_ids for v in variants if v)
    assert processor.engine_params(SamplingParams(ignore_eos=True)).stop_token_ids == []  # every end id ignored


def test_samples_and_groups(processor):
    params = SamplingParams(n=2, best_of=4, seed=-1, temperature=1.0)
    group = processor.engine_params(params)
    assert (group.n, group.best_of, group.logprobs) == (2, 4, 0)  # best_of ranks samples by log-prob
    second = processor.engine_params(params, sample=1)
    assert (second.n, second.best_of, second.seed) == (1, None, params.seed_for(1))
    with pytest.raises(RequestError, match="not supported with beam search"):
        processor.engine_params(SamplingParams(use_beam_search=True, best_of=2, stop=["x"]))


def test_text_and_finish_reasons(processor):
    tracker = processor.text_tracker(SamplingParams(stop=["quick"]))
    ids = processor.tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    assert tracker.update(ids, final=False) and tracker.text.rstrip() == "the" and tracker.stop_reason == "quick"
    assert processor.encode([1, 2]) == [1, 2]
    with pytest.raises(RequestError, match="a prompt must be"):
        processor.encode([1.5])
    names = {reason: processor.finish_name(reason) for reason in FinishReason}
    assert names[FinishReason.END_ID] == names[FinishReason.STOP_WORDS] == "stop"
    assert processor.finish_name("length") == "length" and processor.finish_name(None) is None


def test_the_executor_refuses_text_it_cannot_tokenize():
    with pytest.raises(RequestError, match="stop strings and bad_words need a tokenizer"):
        Request([1, 2], sampling_config=SamplingParams(stop=["x"])).engine_params()
