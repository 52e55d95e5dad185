"""kiln serve with speculation (n-gram, a draft model): streams exactly what the plain server
streams (greedy), and /metrics counts the proposals and those kept."""
from __future__ import annotations

import urllib.request

import pytest

from tests.utils.server import MODEL, serve_tiny

PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [20, 21, 22, 23, 20, 21], [7, 7, 7, 7]]


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def speculative(engine_dir, request):
    """A server speculating with n-gram lookup, or with the model itself as its draft."""
    config = {"method": request.param, "num_speculative_tokens": 4}
    if request.param == "draft_model":
        config["model"] = str(engine_dir)
    s = serve_tiny(engine_dir, speculative_config=config)
    yield s
    s.stop()


def _streamed(server, prompt: list[int]) -> tuple[str, str]:
    text, reason = "", None
    for chunk in server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_speculative_server_streams_what_the_plain_one_does(server, speculative) -> None:
    for prompt in PROMPTS:
        assert _streamed(speculative, prompt) == _streamed(server, prompt)
    metrics = urllib.request.urlopen(speculative.url("/metrics"), timeout=30).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("kiln_spec_decode_")}
    assert values["kiln_spec_decode_num_accepted_tokens"] > 0
    assert values["kiln_spec_decode_num_draft_tokens"] >= values["kiln_spec_decode_num_accepted_tokens"]
    assert values["kiln_spec_decode_mean_accepted_length"] > 1
