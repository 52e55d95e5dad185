"""A quantized checkpoint or GPTQ source missing one of its scale tensors is refused with an
error naming that tensor, and nothing is left half-written."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from kiln.build import build_engine
from kiln.config import QuantConfig
from kiln.convert import convert_checkpoint
from kiln.errors import CheckpointError
from tests.quantization.test_gptq import make_gptq
from tests.utils.tiny_models import make_llama

MISSING = {"W4A16": "transformer.layers.1.mlp.proj.weights_scaling_factor",
           "W4A16-zero": "transformer.layers.0.attention.qkv.zero",
           "W8A16": "transformer.layers.0.attention.dense.weights_scaling_factor"}


@pytest.mark.parametrize("case", sorted(MISSING))
def test_checkpoint_without_a_scale_tensor_does_not_build(tmp_path, case):
    make_llama(tmp_path / "hf", hidden=64, layers=2, intermediate=128)
    algo = case.split("-")[0]
    checkpoint = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False,
                                    quantization=QuantConfig(quant_algo=algo, group_size=32,
                                                             has_zero_point=case.endswith("zero")))
    tensors = load_file(str(checkpoint / "rank0.safetensors"))
    del tensors[MISSING[case]]
    save_file(tensors, str(checkpoint / "rank0.safetensors"))
    with pytest.raises(CheckpointError, match=MISSING[case].replace(".", r"\.")):
        build_engine(checkpoint, tmp_path / "engine", progress=False)
    assert not (tmp_path / "engine").exists()


def test_gptq_source_without_scales_does_not_convert(tmp_path):
    make_gptq(tmp_path)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.o_proj.scales"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.o_proj\.scales"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt").exists()
