"""The model-zoo checks shared by every family's test module.

A test module declares ``CASES`` (name -> (maker, maker kwargs, build options)), binds the
fixtures with ``built = built_fixture(CASES)`` and ``hf_reference = hf_reference_fixture()``,
and takes the two parity tests from ``parity_tests(CASES)`` (or calls the checks below its own
way): each case's tiny random HF model is made, converted and built once per module.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.utils.compare import assert_logits_close, hf_greedy, kiln_batch_prompt_logits, kiln_greedy

LOGIT_PROMPT_LENS = (24, 9, 15)
GREEDY_PROMPT_LENS = (3, 7, 12, 20)
NEW_TOKENS = 32

Cases = dict[str, tuple[Callable, dict, dict]]


@dataclass
class Built:
    """One case: the HF model, its directory and kiln's work directory (checkpoint + engine)."""

    hf: object
    hf_dir: Path
    work_dir: Path
    engine_dir: Path


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def built_fixture(cases: Cases):
    """A module-scoped fixture ``built(name) -> Built`` that makes, converts and builds each
    case of ``cases`` on first use."""
    @pytest.fixture(scope="module")
    def built(tmp_path_factory, build_from_hf) -> Callable[[str], Built]:
        cache: dict[str, Built] = {}

        def get(name: str) -> Built:
            if name not in cache:
                make, kwargs, build_options = cases[name]
                root = tmp_path_factory.mktemp(name)
                hf = make(root / "hf", **kwargs)
                engine = build_from_hf(root / "hf", root / "kiln", build_options)
                cache[name] = Built(hf, root / "hf", root / "kiln", engine)
            return cache[name]

        return get

    return built


def hf_reference_fixture(prompt_lens: tuple[int, ...] = GREEDY_PROMPT_LENS, new_tokens: int = NEW_TOKENS):
    """A module-scoped fixture ``hf_reference(name) -> (prompts, HF greedy tokens)``, computed once."""
    @pytest.fixture(scope="module")
    def hf_reference(built) -> Callable[[str], tuple[list[list[int]], list[list[int]]]]:
        cache: dict[str, tuple] = {}

        def get(name: str):
            if name not in cache:
                hf = built(name).hf
                prompts = [random_prompt(n, hf_vocab(hf), seed=10 + n) for n in prompt_lens]
                cache[name] = prompts, hf_greedy(hf, prompts, new_tokens)
            return cache[name]

        return get

    return hf_reference


def hf_vocab(hf) -> int:
    config = hf.config
    return getattr(config, "vocab_size", None) or config.get_text_config().vocab_size


def check_prompt_logits(case: Built, prompt_lens: tuple[int, ...] = LOGIT_PROMPT_LENS,
                        hf_logits: Callable | None = None) -> None:
    """kiln's float32 logits for prompts of different lengths, packed into one step, equal HF's
    forward pass on each (max abs diff <= 1e-4 * max |ref|)."""
    prompts = [random_prompt(n, hf_vocab(case.hf), seed=i + 1) for i, n in enumerate(prompt_lens)]
    ours = kiln_batch_prompt_logits(case.engine_dir, prompts)
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = (hf_logits or (lambda ids: case.hf(ids).logits))(torch.tensor([prompt]))[0].float()
        assert_logits_close(logits, ref)


def check_batched_greedy(case: Built, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """The prompts sharing every step through the paged runtime give HF's greedy tokens each."""
    steps: list = []
    ours = kiln_greedy(case.engine_dir, prompts, len(expected[0]), steps=steps)
    assert len(steps[0]) == len(prompts), "all prompts should start in the same step"
    assert ours == expected


def parity_tests(cases: Cases) -> tuple[Callable, Callable]:
    """The two tests every zoo module runs on each of its ``cases`` (it binds the ``built`` and
    ``hf_reference`` fixtures): ``test_prompt_logits_match_hf, test_batched_greedy_matches_hf =
    parity_tests(CASES)``."""
    @pytest.mark.parametrize("name", list(cases))
    def test_prompt_logits_match_hf(built, name: str) -> None:
        """float32 logits of 24/9/15-token prompts packed in one step equal HF's (1e-4 relative)."""
        check_prompt_logits(built(name))

    @pytest.mark.parametrize("name", list(cases))
    def test_batched_greedy_matches_hf(built, hf_reference, name: str) -> None:
        """4 prompts sharing every step of the paged runtime give HF's 32 greedy tokens each."""
        check_batched_greedy(built(name), *hf_reference(name))

    return test_prompt_logits_match_hf, test_batched_greedy_matches_hf
