"""W4A16_IMATRIX: the importance-weighted scale/offset search against range rounding, the
layer-by-layer streamed convert against the same calibration on a model in memory (bit for bit),
and an engine of it against the float model."""
from __future__ import annotations

import json

import pytest
import torch

from kiln import convert as convert_module
from kiln import kernels
from kiln.checkpoint.format import read_config, read_rank_weights
from kiln.checkpoint.sources import open_source
from kiln.config import QuantConfig
from kiln.convert import _calibration_tokens, _quantize, convert_checkpoint
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.models import get_model_class
from kiln.quantization.imatrix import IMATRIX_ALGO, STRETCH, _search, fit_groups, quantize_weight_imatrix
from tests.conftest import convert_and_build
from tests.utils.compare import kiln_prompt_logits
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import save_tiny_tokenizer

CALIB_TEXTS = ["The engine builds, the runtime pages its cache, and the scheduler batches the requests.",
               "A language model predicts the next token; perplexity measures how well it does on text."] * 4
QUANT = QuantConfig(quant_algo=IMATRIX_ALGO, group_size=32)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _weighted_error(groups, weight, scale, offset):
    codes = torch.round((groups - offset[..., None]) / scale[..., None]).clamp(0, 15)
    return (weight * (codes * scale[..., None] + offset[..., None] - groups) ** 2).sum()


def test_search_beats_the_groups_range_under_its_weighting():
    groups = _randn(64, 4, 32, seed=1) * (1 + _randn(64, 4, 1, seed=2).abs())
    weight = _randn(1, 4, 32, seed=3).abs() ** 4 + 0.01  # a few channels matter far more
    scale, offset = fit_groups(groups.view(64, 128), weight.view(128), 32)
    assert torch.equal(scale, scale.half().float()) and torch.equal(offset, offset.half().float())
    low, high = groups.amin(-1), groups.amax(-1)
    range_scale, range_offset = ((high - low) / 15).half().float(), low.half().float()
    searched, plain = _weighted_error(groups, weight, scale, offset), _weighted_error(groups, weight, range_scale,
                                                                                      range_offset)
    assert searched < 0.8 * plain  # measured: about 0.6x


def test_the_native_search_is_the_pytorch_one():
    w, importance = _randn(256, 128, seed=5), _randn(128, seed=6).abs() + 0.1
    native = kernels.fit_offset_groups(w, importance, 32, STRETCH)
    assert native is not None  # the suite builds the kernel library, as every native-kernel test needs
    torch_scale, torch_offset = _search(w.view(256, 4, 32), importance.view(1, 4, 32))
    assert (native[0] == torch_scale).float().mean() > 0.98  # float32 vs float64 sums part near-ties
    groups, weight = w.view(256, 4, 32), importance.view(1, 4, 32)
    per_group = [((weight * (torch.round((groups - o[..., None]) / s[..., None]).clamp(0, 15) * s[..., None]
                             + o[..., None] - groups) ** 2).sum(-1)) for s, o in (native, (torch_scale, torch_offset))]
    assert torch.all(per_group[0] <= per_group[1] * 1.05) and per_group[0].sum() <= per_group[1].sum() * 1.01


def test_a_grid_of_16_float16_levels_is_held_exactly():
    codes = torch.randint(0, 16, (8, 2, 32), generator=torch.Generator().manual_seed(0)).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale, offset = (_randn(8, 2, 1).abs() * 0.01 + 1e-3).half().float(), (-_randn(8, 2, 1).abs() * 0.05).half().float()
    w = (codes * scale + offset).view(8, 64)
    tensors = quantize_weight_imatrix(w, 32, torch.rand(64) + 0.5)
    assert torch.equal(tensors["weights_scaling_factor"], scale[..., 0])
    assert torch.equal(tensors["weights_offset"], offset[..., 0])


def test_channels_with_large_activations_keep_their_weights_closest():
    w = _randn(64, 128, seed=4)
    loud = torch.ones(128)
    loud[:8] = 1000.0
    def error(tensors):
        codes = torch.stack([tensors["weight"] & 15, tensors["weight"] >> 4], -1).view(64, 128).float()
        scale = tensors["weights_scaling_factor"].repeat_interleave(32, 1)
        return (codes * scale + tensors["weights_offset"].repeat_interleave(32, 1) - w) ** 2
    weighted, flat = error(quantize_weight_imatrix(w, 32, loud)), error(quantize_weight_imatrix(w, 32, torch.ones(128)))
    assert weighted[:, :8].sum() < 0.75 * flat[:, :8].sum()  # measured: 0.63x


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("imatrix")
    make_llama(root / "hf", hidden=128, layers=2, intermediate=256, vocab=300, max_shard_size="100KB")
    save_tiny_tokenizer(root / "hf")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in CALIB_TEXTS))
    return root


def test_streamed_convert_equals_the_in_memory_calibration(tiny, tmp_path, monkeypatch):
    streamed = []
    stream = convert_module.stream_rank
    monkeypatch.setattr(convert_module, "stream_rank", lambda *a, **k: streamed.append(stream(*a, **k)) or streamed[-1])
    out = convert_checkpoint(tiny / "hf", tmp_path / "ckpt", dtype="float32", quantization=QUANT,
                             calib_dataset=str(tiny / "calib.jsonl"), calib_size=8, progress=False)
    assert streamed and streamed[0] is not None  # layer by layer as the weights streamed
    config = read_config(out).quantization
    assert config.quant_algo == "MIXED_PRECISION" and len(config.quantized_layers) == 2 * 5  # qkv, dense, fc, gate, proj
    assert all(f.has_offset and f.group_size == 32 for f in config.quantized_layers.values())
    source = open_source(tiny / "hf")
    model = get_model_class("LlamaForCausalLM").from_hugging_face(source, "float32", Mapping())
    tokens = _calibration_tokens(source, tiny / "hf", str(tiny / "calib.jsonl"), 8, 512, IMATRIX_ALGO)
    model.config = _quantize(model, QUANT, "in memory", tokens)
    expected, got = model.checkpoint_weights(), read_rank_weights(out, 0)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_engine_is_closer_to_float_than_round_to_nearest(tiny):
    calib = {"calib_dataset": str(tiny / "calib.jsonl"), "calib_size": 8}
    imatrix = convert_and_build(tiny / "hf", tiny / "im", {"tokens_per_block": 4}, quantization=QUANT, **calib)
    rtn = convert_and_build(tiny / "hf", tiny / "rtn", {"tokens_per_block": 4},
                            quantization=QuantConfig(quant_algo="W4A16", group_size=32, has_zero_point=True))
    float_engine = convert_and_build(tiny / "hf", tiny / "fp", {"tokens_per_block": 4})
    prompt = list(range(3, 40))
    reference = kiln_prompt_logits(float_engine, prompt)
    assert (kiln_prompt_logits(imatrix, prompt) - reference).abs().mean() < \
        (kiln_prompt_logits(rtn, prompt) - reference).abs().mean()


def test_unsupported_requests_are_clear_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match="has_zero_point"):
        convert_checkpoint(tiny / "hf", tmp_path / "a", quantization=QuantConfig(
            quant_algo=IMATRIX_ALGO, group_size=32, has_zero_point=True), progress=False)
    with pytest.raises(ConfigError, match="tp_size 1"):
        convert_checkpoint(tiny / "hf", tmp_path / "b", quantization=QUANT, tp_size=2, progress=False)


def test_its_default_group_is_32_from_the_cli_and_llm(tiny, tmp_path):
    from kiln.cli.main import main
    from kiln.engine_cache import split_quantization

    assert split_quantization("W4A16_IMATRIX")[0]["group_size"] == 32
    assert split_quantization("W4A16")[0]["group_size"] == 64
    assert split_quantization({"quant_algo": "W4A16_IMATRIX", "group_size": 64})[0]["group_size"] == 64
    assert main(["convert", "--model_dir", str(tiny / "hf"), "--output_dir", str(tmp_path / "c"), "--quant_algo",
                 IMATRIX_ALGO, "--calib_dataset", str(tiny / "calib.jsonl"), "--calib_size", "2"]) == 0
    layers = read_config(tmp_path / "c").quantization.quantized_layers
    assert {f.group_size for f in layers.values()} == {32}


def test_layer_by_layer_calibration_keeps_no_layer(tiny):
    """After the stream, every weight is back on the meta device and no packed copy of one is
    left (a bf16 matmul packs its weight on first use)."""
    from kiln.models.loading import prepare_hugging_face
    from kiln.quantization.imatrix import importance, stats_factory
    from kiln.quantization.sequential import stream_calibrated

    model, loader = prepare_hugging_face(get_model_class("LlamaForCausalLM"), open_source(tiny / "hf"), "bfloat16")
    tokens = _calibration_tokens(open_source(tiny / "hf"), tiny / "hf", str(tiny / "calib.jsonl"), 4, 512,
                                 IMATRIX_ALGO)
    chosen = ["transformer.layers.0.mlp.proj", "transformer.layers.1.attention.qkv"]
    written = dict(stream_calibrated(model, loader.iter_weights(model), tokens, chosen, stats_factory,
                                     lambda name, linear, stats: quantize_weight_imatrix(linear.weight, 32,
                                                                                         importance(stats))))
    assert written["transformer.layers.0.mlp.proj.weight"].dtype == torch.uint8
    assert "transformer.layers.1.attention.qkv.weights_offset" in written
    assert written["transformer.layers.1.mlp.proj.weight"].dtype == torch.bfloat16  # not chosen: as read
    assert all(p.is_meta for p in model.parameters())
    assert not any(hasattr(m, "_packed_tiles") or hasattr(m, "_packed") for m in model.modules())


def test_with_a_quantized_kv_cache_it_calibrates_in_memory(tiny, tmp_path):
    quant = QuantConfig(quant_algo=IMATRIX_ALGO, group_size=32, kv_cache_quant_algo="INT8")
    out = convert_checkpoint(tiny / "hf", tmp_path / "c", quantization=quant, calib_dataset=str(tiny / "calib.jsonl"),
                             calib_size=2, progress=False)
    recorded = read_config(out).quantization
    assert recorded.quant_algo == "MIXED_PRECISION" and recorded.kv_cache_quant_algo == "INT8"
    assert any(name.endswith("kv_cache_scaling_factor") for name in read_rank_weights(out, 0))
