"""Model-level API: from_hugging_face -> save_checkpoint -> from_checkpoint keeps every tensor."""
from __future__ import annotations

import torch

from kiln import LLM, SamplingParams
from kiln.checkpoint.format import read_rank_weights
from kiln.convert import convert_checkpoint
from kiln.models.llama import LlamaForCausalLM
from tests.utils.fakes import make_tiny_llama_with_tokenizer
from tests.utils.tiny_models import make_llama


def test_save_and_load_checkpoint_round_trip(tmp_path):
    """A model saved with save_checkpoint loads back identical, and equals what convert writes."""
    make_llama(tmp_path / "hf", tie=True)
    model = LlamaForCausalLM.from_hugging_face(tmp_path / "hf", dtype="float32")
    model.save_checkpoint(tmp_path / "saved")
    loaded = LlamaForCausalLM.from_checkpoint(tmp_path / "saved")
    assert loaded.config.to_dict() == model.config.to_dict()
    ours = dict(loaded.named_parameters())
    assert ours.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        assert torch.equal(ours[name], p), name
    # A tied table is stored once and shared again after loading.
    assert "lm_head.weight" not in ours
    assert loaded.lm_head.weight is loaded.transformer.vocab_embedding.weight
    converted = read_rank_weights(convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False), 0)
    assert converted.keys() == ours.keys()
    assert all(torch.equal(converted[k], ours[k]) for k in converted)


def test_bfloat16_conversion_casts_every_tensor(tmp_path):
    make_llama(tmp_path / "hf")
    weights = read_rank_weights(convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", dtype="bfloat16",
                                                   progress=False), 0)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_readme_one_liner(tmp_path, monkeypatch):
    """The README's first Python line: LLM(hf_dir).generate(['Hi'], SamplingParams(max_tokens=16))."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    make_tiny_llama_with_tokenizer(tmp_path / "hf")
    out = LLM(tmp_path / "hf", progress=False).generate(["Hi"], SamplingParams(max_tokens=16, seed=0))
    completion = out[0].outputs[0]
    assert isinstance(completion.text, str) and 1 <= len(completion.token_ids) <= 16
    assert completion.finish_reason in ("stop", "length")
    assert any((tmp_path / "cache").iterdir())  # built into $KILN_CACHE_DIR
