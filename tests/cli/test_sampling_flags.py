"""kiln run's sampling flags are SamplingParams' fields: one flag per field (older names too), each
parsed into the field, with only kiln run's own defaults (greedy, 64 tokens) differing."""
from __future__ import annotations

from dataclasses import fields

import pytest

from kiln import SamplingParams
from kiln.cli.main import build_parser
from kiln.cli.run import sampling_params
from kiln.errors import RequestError

RUN = ["run", "--engine_dir", "e", "--input_text", "hi"]


def _params(*flags: str) -> SamplingParams:
    return sampling_params(build_parser().parse_args([*RUN, *flags]))


def test_every_field_with_a_group_is_a_flag():
    args = build_parser().parse_args(RUN)
    for f in fields(SamplingParams):
        assert hasattr(args, f.name) == (f.metadata["group"] is not None), f.name
    assert _params() == SamplingParams(max_tokens=64, temperature=0.0)


def test_flags_parse_into_the_fields():
    params = _params("--max_output_len", "9", "--min_tokens", "2", "--temperature", "0.7", "--top_k", "5",
                     "--top_p_reset_ids", "3", "4", "--seed", "-1", "--logit_bias", '{"7": -100}',
                     "--bad_words_ids", "[[1, 2], [3]]", "--stop", "END", "--include_stop_str_in_output",
                     "--num_return_sequences", "2", "--best_of", "3", "--early_stopping", "never",
                     "--prompt_logprobs", "1", "--ignore_eos")
    assert (params.max_tokens, params.min_tokens, params.temperature, params.top_k) == (9, 2, 0.7, 5)
    assert (params.top_p_reset_ids, params.seed, params.logit_bias) == ([3, 4], -1, {7: -100})
    assert (params.bad_words_ids, params.stop, params.include_stop_str_in_output) == ([[1, 2], [3]], ["END"], True)
    assert (params.n, params.best_of, params.early_stopping, params.prompt_logprobs) == (2, 3, "never", 1)
    assert params.ignore_eos and not params.use_beam_search
    beams = _params("--num_beams", "3", "--early_stopping", "true")
    assert (beams.use_beam_search, beams.best_of, beams.early_stopping) == (True, 3, True)


def test_bad_values_name_the_field():
    with pytest.raises(RequestError, match="logit_bias must be a JSON object"):
        _params("--logit_bias", "[1]")
    with pytest.raises(RequestError, match="logit_bias keys must be token ids"):
        _params("--logit_bias", '{"x": 1}')
    with pytest.raises(RequestError, match="repetition_penalty"):
        _params("--repetition_penalty", "0")
    with pytest.raises(SystemExit):  # argparse: not JSON
        _params("--bad_words_ids", "[[1,")
