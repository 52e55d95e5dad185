"""Every calibrated algorithm streams: ``kiln convert`` holds one layer at a time and writes what
the same calibration on a model in memory makes, bit for bit; the stream keeps no layer behind;
GPTQ's sequential mode calibrates each layer on its predecessors' quantized outputs."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kiln import convert as convert_module
from kiln.checkpoint.format import read_config, read_rank_weights
from kiln.checkpoint.sources import open_source
from kiln.config import QuantConfig
from kiln.convert import _calibrate_kv_cache, _calibration_tokens, _quantize, convert_checkpoint
from kiln.mapping import Mapping
from kiln.models import get_model_class
from kiln.models.loading import prepare_hugging_face
from kiln.quantization.calibrated import CalibrationOptions
from kiln.quantization.imatrix import importance, quantize_weight_imatrix, stats_factory
from kiln.quantization.sequential import per_linear, stream_calibrated
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import save_tiny_tokenizer

CALIB_TEXTS = ["The engine builds, the runtime pages its cache, and the scheduler batches the requests.",
               "A language model predicts the next token; perplexity measures how well it does on text.",
               "Calibration text runs through the float model so each layer sees the inputs it will meet."] * 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrated")
    make_llama(root / "hf", hidden=128, layers=2, intermediate=256, vocab=300, max_shard_size="100KB")
    save_tiny_tokenizer(root / "hf")
    (root / "calib.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CALIB_TEXTS))
    return root


@pytest.mark.parametrize("algo, options", [
    ("W4A16_AWQ", CalibrationOptions()), ("W4A8_AWQ", CalibrationOptions()), ("W4A16_GPTQ", CalibrationOptions()),
    ("W4A16_GPTQ", CalibrationOptions(gptq_sequential=False, gptq_act_order=False)),
    ("W4A16_AWQ", CalibrationOptions(awq_gptq=True)), ("W8A8_SQ_PER_CHANNEL", CalibrationOptions()),
    ("W8A8_SQ_PER_CHANNEL", CalibrationOptions(smoothquant_alpha="search")), ("FP8", CalibrationOptions()),
    ("W4A16_IMATRIX", CalibrationOptions())])
def test_streamed_convert_equals_the_in_memory_calibration(tiny, tmp_path, monkeypatch, algo, options):
    streamed = []
    stream = convert_module.stream_rank
    monkeypatch.setattr(convert_module, "stream_rank", lambda *a, **k: streamed.append(stream(*a, **k)) or streamed[-1])
    quant = QuantConfig(quant_algo=algo, group_size=32)
    out = convert_checkpoint(tiny / "hf", tmp_path / "ckpt", dtype="float32", quantization=quant,
                             calib_dataset=str(tiny / "calib.jsonl"), calib_size=len(CALIB_TEXTS), progress=False,
                             **dataclasses.asdict(options))
    assert streamed and streamed[0] is not None  # layer by layer as the weights streamed
    (expected, recorded), got = _in_memory(tiny, quant, options), read_rank_weights(out, 0)
    assert read_config(out).quantization == recorded
    assert sorted(got) == sorted(expected)
    assert any(t.dtype != torch.float32 for t in got.values())  # something was quantized
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name



def _in_memory(tiny, quant: QuantConfig, options: CalibrationOptions = CalibrationOptions()):
    """The checkpoint tensors and quantization config of the same conversion with the whole
    float model in memory."""
    source = open_source(tiny / "hf")
    model = get_model_class("LlamaForCausalLM").from_hugging_face(source, "float32", Mapping())
    tokens = _calibration_tokens(source, tiny / "hf", str(tiny / "calib.jsonl"), len(CALIB_TEXTS), 512, "calibration")
    if quant.quant_algo is not None:
        model.config = _quantize(model, quant, "in memory", tokens, options)
    if quant.kv_cache_quant_algo is not None:
        _calibrate_kv_cache(model, quant.kv_cache_quant_algo, tokens, "calib.jsonl", progress=False)
    return model.checkpoint_weights(), model.config.quantization


@pytest.mark.parametrize("quant", [
    QuantConfig(kv_cache_quant_algo="INT8"), QuantConfig(quant_algo="W4A16", group_size=32, kv_cache_quant_algo="INT8"),
    QuantConfig(quant_algo="W4A16_IMATRIX", group_size=32, kv_cache_quant_algo="FP8"),
    QuantConfig(quant_algo="W4A16_GPTQ", group_size=32, kv_cache_quant_algo="INT8")])
def test_kv_cache_scales_stream_as_the_whole_quantized_model_gives_them(tiny, tmp_path, monkeypatch, quant):
    """Each layer's K/V ranges come from it run quantized, on the quantized layers' outputs before
    it: what the whole quantized model in memory computes."""
    streamed = []
    stream = convert_module.stream_rank
    monkeypatch.setattr(convert_module, "stream_rank", lambda *a, **k: streamed.append(stream(*a, **k)) or streamed[-1])
    out = convert_checkpoint(tiny / "hf", tmp_path / "ckpt", dtype="float32", quantization=quant,
                             calib_dataset=str(tiny / "calib.jsonl"), calib_size=len(CALIB_TEXTS), progress=False)
    assert streamed and streamed[0] is not None
    (expected, recorded), got = _in_memory(tiny, quant), read_rank_weights(out, 0)
    assert read_config(out).quantization == recorded and recorded.kv_cache_quant_algo == quant.kv_cache_quant_algo
    assert sorted(got) == sorted(expected)
    scales = [name for name in got if name.endswith("kv_cache_scaling_factor")]
    assert len(scales) == 2 and all(torch.all(got[name] > 0) for name in scales)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_the_stream_keeps_no_layer_behind(tiny):
    """After the stream, every weight is back on the meta device and no packed copy of one is
    left (a bf16 matmul packs its weight on first use)."""
    model, loader = prepare_hugging_face(get_model_class("LlamaForCausalLM"), open_source(tiny / "hf"), "bfloat16")
    tokens = _calibration_tokens(open_source(tiny / "hf"), tiny / "hf", str(tiny / "calib.jsonl"), 4, 512,
                                 "W4A16_IMATRIX")
    chosen = ["transformer.layers.0.mlp.proj", "transformer.layers.1.attention.qkv"]
    written = dict(stream_calibrated(model, loader.iter_weights(model), tokens, chosen, stats_factory, per_linear(
        lambda name, linear, stats: quantize_weight_imatrix(linear.weight, 32, importance(stats)))))
    assert written["transformer.layers.0.mlp.proj.weight"].dtype == torch.uint8
    assert "transformer.layers.1.attention.qkv.weights_offset" in written
    assert written["transformer.layers.1.mlp.proj.weight"].dtype == torch.bfloat16  # not chosen: as read
    assert all(p.is_meta for p in model.parameters())
    assert not any(hasattr(m, "_packed_tiles") or hasattr(m, "_packed") for m in model.modules())
