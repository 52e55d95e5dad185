"""Quantizing the LM head too (``--exclude_modules`` given with no names), for every mode.

A head tied to the embedding table gets its own quantized copy (the lookup keeps the float
table, the checkpoint records ``share_embedding_table`` false); calibrated modes observe the
head's input (the final hidden states) without computing logits. Each engine's logits stay
within the mode's bound of the float engine's while differing from the head-excluded engine's.
"""
from __future__ import annotations

import json

import pytest
import torch

from kiln.config import QuantConfig
from tests.conftest import convert_and_build
from tests.utils.compare import kiln_prompt_logits
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import save_tiny_tokenizer

CALIB_TEXTS = ["The quick brown fox jumps over the lazy dog while the engine builds a checkpoint.",
               "A language model predicts the next token; perplexity measures how well it does it.",
               "Summarize the following article about converting checkpoints and running them fast.",
               "Quantization stores weights in eight bits and scales the activations of every token."]
PROMPT = [1, 17, 42, 99, 123, 7, 250, 31, 64, 5, 200, 88]

# (algo, extra QuantConfig fields, bound on max|logits - float| / max|float logits|)
MODES = [("W8A16", {}, 0.03), ("W4A16", {"group_size": 32, "has_zero_point": True}, 0.25),
         ("W4A16_AWQ", {"group_size": 32, "has_zero_point": True}, 0.25),
         ("W4A16_GPTQ", {"group_size": 32, "has_zero_point": True}, 0.25),
         ("W4A8_AWQ", {"group_size": 32, "has_zero_point": True}, 0.3), ("FP8", {}, 0.15),
         ("W8A8_SQ_PER_CHANNEL", {}, 0.06)]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    make_llama(root / "hf", vocab=320, hidden=64, intermediate=128, layers=2, tie=True)  # 320: tiles for the head
    save_tiny_tokenizer(root / "hf")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in CALIB_TEXTS))
    float_engine = convert_and_build(root / "hf", root / "float", {"tokens_per_block": 4}, dtype="float32")
    return root, calib, kiln_prompt_logits(float_engine, PROMPT)


def _engine(root, calib, algo: str, fields: dict, exclude: list[str]):
    quant = QuantConfig(quant_algo=algo, exclude_modules=exclude, **fields)
    work = root / f"{algo}-{'head' if not exclude else 'nohead'}"
    engine = convert_and_build(root / "hf", work, {"tokens_per_block": 4}, dtype="float32", quantization=quant,
                               calib_dataset=str(calib), calib_size=len(CALIB_TEXTS))
    return work / "checkpoint", engine


@pytest.mark.parametrize("algo,fields,bound", MODES, ids=[m[0] for m in MODES])
def test_quantized_head_gets_its_own_codes_and_stays_close(tied, algo, fields, bound):
    from safetensors import safe_open

    root, calib, float_logits = tied
    checkpoint, engine = _engine(root, calib, algo, fields, exclude=[])
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["share_embedding_table"] is False and config["quantization"]["exclude_modules"] == []
    with safe_open(str(checkpoint / "rank0.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weights_scaling_factor" in keys
        assert not f.get_tensor("lm_head.weight").is_floating_point() or algo == "FP8"
        assert f.get_tensor("transformer.vocab_embedding.weight").dtype == torch.float32  # the lookup stays float
        if algo in ("W4A16_AWQ", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL"):
            assert "lm_head.prequant_scaling_factor" in keys  # calibrated on the head's own input
        if algo in ("W4A8_AWQ", "FP8"):
            assert f.get_tensor("lm_head.activation_scaling_factor").item() > 0
    logits = kiln_prompt_logits(engine, PROMPT)
    scale = float_logits.abs().max()
    assert (logits - float_logits).abs().max() / scale < bound
    _, excluded_engine = _engine(root, calib, algo, fields, exclude=["lm_head"])
    assert not torch.equal(logits, kiln_prompt_logits(excluded_engine, PROMPT))
