"""W4A16_IMATRIX: the importance-weighted scale/offset search against range rounding, and an
engine of it against the float model (tests/quantization/test_calibrated.py checks its streamed
convert)."""
from __future__ import annotations

import json

import pytest
import torch

from kiln import kernels
from kiln.checkpoint.format import read_config
from kiln.config import QuantConfig
from kiln.convert import convert_checkpoint
from kiln.errors import ConfigError
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
