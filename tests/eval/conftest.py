"""A tiny Llama with a real (tiny) tokenizer, converted and built in float32 with a short input
limit, shared by the ``kiln eval`` tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

MAX_INPUT_LEN = 32  # short, so long texts need several windows
LAYERS = 3


@dataclass
class TinyEvalModel:
    hf_dir: Path
    engine_dir: Path
    hf: object  # the transformers model, float32, eval mode
    max_input_len: int = MAX_INPUT_LEN
    layers: int = LAYERS


@pytest.fixture(scope="session")
def tiny_eval_model(tmp_path_factory, build_from_hf) -> TinyEvalModel:
    from tests.utils.tiny_models import make_llama
    from tests.utils.tiny_tokenizer import VOCAB_SIZE, save_tiny_tokenizer

    root = tmp_path_factory.mktemp("eval-tiny")
    hf = make_llama(root / "hf", vocab=VOCAB_SIZE, layers=LAYERS)
    save_tiny_tokenizer(root / "hf")
    engine = build_from_hf(root / "hf", root / "work", dict(max_input_len=MAX_INPUT_LEN, max_seq_len=64,
                                                            tokens_per_block=4, max_batch_size=8), dtype="float32")
    return TinyEvalModel(root / "hf", engine, hf)
