"""The streaming convert (one tensor at a time, kiln.convert.stream_rank) and build (one layer at a
time, kiln.build.builder.build_rank) write what the in-memory conversion and build write, bit for
bit, from sharded safetensors and from a GGUF file, in float and with round-to-nearest
quantization; their files are ordinary safetensors files."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import kernels
from kiln.checkpoint.format import read_rank_weights
from kiln.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter
from kiln import convert as convert_module
from kiln.build import build_engine
from kiln.build.builder import QUANT_FLOAT32
from kiln.config import QuantConfig
from kiln.convert import _quantize, convert_checkpoint
from kiln.mapping import Mapping
from kiln.models import get_model_class
from kiln.layers.linear import Linear
from kiln.models.loading import engine_layout_weights
from kiln.runtime.engine import Engine
from tests.utils.real_model import smollm2_gguf_path
from tests.utils.tiny_models import make_llama


def _in_memory(source, dtype, quant, mapping=None) -> dict[str, torch.Tensor]:
    """The conversion as kiln did it before streaming: the whole model, quantized in place."""
    model = get_model_class("LlamaForCausalLM").from_hugging_face(source, dtype, mapping or Mapping())
    if quant is not None:
        model.config = _quantize(model, quant, str(source))
    return model.checkpoint_weights()


def _assert_same(streamed: dict, expected: dict) -> None:
    assert sorted(streamed) == sorted(expected)
    for name, tensor in expected.items():
        assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), name


@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    make_llama(path, hidden=128, layers=2, intermediate=256, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


CASES = {"float32": ("float32", None), "bfloat16": ("bfloat16", None),
         "W8A16": ("bfloat16", QuantConfig(quant_algo="W8A16")),
         "W4A16-zero-point": ("bfloat16", QuantConfig(quant_algo="W4A16", group_size=64, has_zero_point=True))}


@pytest.mark.parametrize("case", CASES)
def test_sharded_safetensors_stream_equals_in_memory(sharded_hf, tmp_path, case, monkeypatch):
    dtype, quant = CASES[case]
    streamed = []
    stream = convert_module.stream_rank
    monkeypatch.setattr(convert_module, "stream_rank", lambda *a, **k: streamed.append(stream(*a, **k)) or streamed[-1])
    out = convert_checkpoint(sharded_hf, tmp_path / "ckpt", dtype=dtype, quantization=quant, progress=False)
    assert streamed and streamed[0] is not None  # the rank was streamed, not converted in memory
    _assert_same(read_rank_weights(out, 0), _in_memory(sharded_hf, dtype, quant))


def test_tensor_parallel_ranks_stream_their_slices(sharded_hf, tmp_path):
    out = convert_checkpoint(sharded_hf, tmp_path / "ckpt", dtype="float32", tp_size=2, progress=False)
    for rank in range(2):
        mapping = Mapping(world_size=2, tp_size=2, rank=rank)
        _assert_same(read_rank_weights(out, rank), _in_memory(sharded_hf, "float32", None, mapping))


def test_gguf_streams_like_the_in_memory_conversion(tmp_path):
    gguf = smollm2_gguf_path()
    quant = QuantConfig(quant_algo="W4A16", group_size=64)
    out = convert_checkpoint(gguf, tmp_path / "ckpt", dtype="bfloat16", quantization=quant, progress=False)
    expected = _in_memory(gguf, "bfloat16", dataclasses.replace(quant))
    _assert_same(read_rank_weights(out, 0), expected)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def test_files_are_ordinary_safetensors(tmp_path):
    tensors = {"a.bf16": torch.randn(5, 3).to(torch.bfloat16),
               "b.int8": torch.randint(-127, 127, (4, 8), dtype=torch.int8),
               "c.u8": torch.randint(0, 255, (7,), dtype=torch.uint8), "d.empty": torch.empty(0, 4),
               "e.fp8": torch.randn(2, 2).to(torch.float8_e4m3fn), "f.scalar": torch.tensor(3.5)}
    layout = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()}
    writer = SafetensorsWriter(tmp_path / "ours.safetensors", layout, metadata={"format": "pt"})
    for name in reversed(list(tensors)):  # any order
        writer.write(name, tensors[name])
    writer.close()
    with safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as f:
        for name, tensor in tensors.items():
            assert torch.equal(_bytes(f.get_tensor(name)), _bytes(tensor)), name
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    reader = SafetensorsReader(tmp_path / "theirs.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(_bytes(reader.read(name)), _bytes(tensor)), name
    assert torch.equal(reader.read("b.int8", (slice(1, 3), slice(None))), tensors["b.int8"][1:3])
    assert torch.equal(reader.read("b.int8", (slice(None), slice(2, 4))), tensors["b.int8"][:, 2:4])


@pytest.mark.parametrize("case", ["bfloat16", "W4A16-zero-point"])
def test_the_build_streams_layer_by_layer_like_the_in_memory_layout(sharded_hf, tmp_path, case):
    """build_engine writes, a layer at a time, what rewriting the whole model at once gives."""
    dtype, quant = CASES[case]
    ckpt = convert_checkpoint(sharded_hf, tmp_path / "ckpt", dtype="float32" if quant is None else dtype,
                              quantization=quant, progress=False)
    engine = build_engine(ckpt, tmp_path / "engine", dtype="bfloat16")
    model = get_model_class("LlamaForCausalLM").from_checkpoint(ckpt)
    expected = {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() and tensor.element_size() > 1
                and not name.endswith(QUANT_FLOAT32) else tensor
                for name, tensor in engine_layout_weights(model, model.checkpoint_weights()).items()}
    tiled = [f"{name}.weight" for name, m in Engine(engine).model.named_modules()  # float bf16 linears in tiles
             if isinstance(m, Linear) and m.tile_order and m.quant_bits is None]
    assert "lm_head.weight" in tiled and (len(tiled) > 1) == (quant is None)  # W4A16 keeps lm_head in bf16
    expected.update({name: kernels.pack_bf16(expected[name]) for name in tiled})
    _assert_same(read_rank_weights(engine, 0), expected)
