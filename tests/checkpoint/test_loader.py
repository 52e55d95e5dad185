"""ModelWeightsLoader: key translation, key-map priority, sliced loading, strict filling, formats."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from kiln.checkpoint.loader import DEFAULT_KEY_MAP, ModelWeightsLoader, fill_parameters, translate_key
from kiln.checkpoint.sources import open_source
from kiln.errors import CheckpointError
from kiln.checkpoint.shard_spec import ShardSpec
from kiln.layers.linear import QKVColumnLinear
from kiln.models.llama import LlamaForCausalLM
from tests.utils.compare import resave_as_torch_bin
from tests.utils.tiny_models import make_llama

LLAVA_MAP = {"transformer": "language_model.model", "lm_head": "language_model.lm_head"}


class DictSource:
    """An in-memory TensorSource, so slicing tests need no files."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.path = Path("<memory>")
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, index=None) -> torch.Tensor:
        t = self.tensors[key]
        return t.clone() if index is None else t[index].clone()

    def hf_config(self):
        return None


def rank_slices(full: torch.Tensor, tp: int, dim: int) -> list[torch.Tensor]:
    """torch.chunk-style pieces (ceil-sized, last short), padded with empty pieces to ``tp``."""
    pieces = list(torch.split(full, math.ceil(full.shape[dim] / tp), dim=dim))
    while len(pieces) < tp:
        pieces.append(full.narrow(dim, full.shape[dim], 0))
    return pieces


# -- translate_key -------------------------------------------------------------------------


def test_translate_key_default_map() -> None:
    """kiln names map section by section onto LLaMA's HF names."""
    assert translate_key("transformer.layers.3.attention.dense.weight", DEFAULT_KEY_MAP) == [
        "model.layers.3.self_attn.o_proj.weight"]
    assert translate_key("transformer.layers.0.mlp.fc.weight", DEFAULT_KEY_MAP) == ["model.layers.0.mlp.gate_proj.weight"]
    assert translate_key("transformer.layers.0.mlp.gate.weight", DEFAULT_KEY_MAP) == ["model.layers.0.mlp.up_proj.weight"]
    assert translate_key("transformer.layers.0.mlp.proj.weight", DEFAULT_KEY_MAP) == ["model.layers.0.mlp.down_proj.weight"]
    assert translate_key("transformer.layers.1.post_layernorm.weight", DEFAULT_KEY_MAP) == [
        "model.layers.1.post_attention_layernorm.weight"]
    assert translate_key("transformer.vocab_embedding.weight", DEFAULT_KEY_MAP) == ["model.embed_tokens.weight"]
    assert translate_key("transformer.ln_f.weight", DEFAULT_KEY_MAP) == ["model.norm.weight"]
    assert translate_key("lm_head.weight", DEFAULT_KEY_MAP) == ["lm_head.weight"]


def test_translate_key_one_to_many_qkv() -> None:
    """The fused qkv name expands to the three HF projections, in q, k, v order."""
    assert translate_key("transformer.layers.2.attention.qkv.bias", DEFAULT_KEY_MAP) == [
        f"model.layers.2.self_attn.{p}_proj.bias" for p in "qkv"]


def test_translate_key_llava_style_map() -> None:
    """A customized map re-prefixes the language model; the rest of the default map still applies."""
    key_map = {**DEFAULT_KEY_MAP, **LLAVA_MAP}
    assert translate_key("transformer.layers.0.attention.qkv.weight", key_map) == [
        f"language_model.model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert translate_key("lm_head.weight", key_map) == ["language_model.lm_head.weight"]


def test_translate_key_empty_mapping_drops_section() -> None:
    """A section mapped to "" disappears (unprefixed checkpoints)."""
    assert translate_key("transformer.layers.0.input_layernorm.weight", {**DEFAULT_KEY_MAP, "transformer": ""}) == [
        "layers.0.input_layernorm.weight"]


def test_layer_external_key_map_has_highest_priority() -> None:
    """default < customized map < a layer's external_key_map; the innermost layer's map wins."""
    model = nn.Module()
    model.lm_head = nn.Linear(2, 2, bias=False)
    model.transformer = nn.Module()
    model.transformer.ln_f = nn.LayerNorm(2)
    model.transformer.inner = nn.Module()
    model.transformer.inner.ln_f = nn.LayerNorm(2)
    loader = ModelWeightsLoader(DictSource({}), {"lm_head": "custom_head"})
    assert loader.translate("lm_head.weight") == ["custom_head.weight"]
    assert loader.translate("transformer.ln_f.weight") == ["model.norm.weight"]

    model.lm_head.external_key_map = {"lm_head": "layer_head"}
    model.transformer.external_key_map = {"ln_f": "outer_norm"}
    model.transformer.inner.external_key_map = {"ln_f": "inner_norm"}
    loader.update_key_mapping(model)
    assert loader.translate("lm_head.weight") == ["layer_head.weight"]
    assert loader.translate("transformer.ln_f.weight") == ["model.outer_norm.weight"]
    assert loader.translate("transformer.inner.ln_f.weight") == ["model.inner.inner_norm.weight"]


# -- load_tensor slicing -------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_load_tensor_even_slices(tp: int, dim: int) -> None:
    """Rank r's slice along ``dim`` is the r-th torch.chunk piece of the full tensor."""
    full = torch.randn(8, 12)
    loader = ModelWeightsLoader(DictSource({"w": full}))
    for rank, expected in enumerate(torch.chunk(full, tp, dim=dim)):
        assert torch.equal(loader.load_tensor("w", tp_size=tp, tp_dim=dim, tp_rank=rank), expected)
    assert torch.equal(loader.load_tensor("w"), full)
    assert loader.load_tensor("absent", tp_size=tp, tp_dim=dim) is None


@pytest.mark.parametrize("num_kv_heads, tp", [(2, 2), (2, 4), (1, 4), (4, 2)])
@pytest.mark.parametrize("transposed", [False, True])
def test_load_tensor_fused_qkv_parts(num_kv_heads: int, tp: int, transposed: bool) -> None:
    """A fused [q; k; v] tensor: each part is split on its own, KV heads replicated when kv < tp."""
    heads, head, hidden = 4, 3, 8
    q = torch.randn(heads * head, hidden)
    k, v = torch.randn(num_kv_heads * head, hidden), torch.randn(num_kv_heads * head, hidden)
    fused = torch.cat([q, k, v])
    loader = ModelWeightsLoader(DictSource({"qkv": fused.t().contiguous() if transposed else fused,
                                            "q": q, "k": k, "v": v}))
    for rank in range(tp):
        layer = QKVColumnLinear(hidden, heads, num_kv_heads, head, bias=False, tp_size=tp, tp_rank=rank,
                                source_transposed=transposed)
        kv_rank = rank * min(tp, num_kv_heads) // tp
        kv_pieces = min(tp, num_kv_heads)
        expected = torch.cat([q.chunk(tp)[rank], k.chunk(kv_pieces)[kv_rank], v.chunk(kv_pieces)[kv_rank]])
        (spec,) = layer.load_spec("weight", 1)
        got = loader.load_tensor("qkv", spec=spec)
        assert torch.equal(got.t() if transposed else got, expected)
        assert got.shape[1 if transposed else 0] == layer.weight.shape[0]
        if not transposed:  # the separate-tensor form gives the same rows
            parts = [loader.load_tensor(n, spec=s) for n, s in zip("qkv", layer.load_spec("weight", 3))]
            assert torch.equal(torch.cat(parts), expected)


def test_load_tensor_rejects_parts_not_matching_tensor() -> None:
    """Parts that do not add up to the tensor's dimension raise, naming the tensor."""
    loader = ModelWeightsLoader(DictSource({"model.qkv": torch.zeros(10, 4)}))
    with pytest.raises(CheckpointError, match="model.qkv"):
        loader.load_tensor("model.qkv", spec=ShardSpec(0, ((8, 2, 0), (4, 1, 0), (4, 1, 0))))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), tp=st.integers(1, 6), data=st.data())
def test_rank_slices_concatenate_to_full(shape: list[int], tp: int, data) -> None:
    """Property: for any shape, tp size and dim, all ranks' slices concatenated are the full tensor."""
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    loader = ModelWeightsLoader(DictSource({"t": full}))
    pieces = [loader.load_tensor("t", tp_size=tp, tp_dim=dim, tp_rank=r) for r in range(tp)]
    assert torch.equal(torch.cat(pieces, dim=dim), full)
    assert [p.shape for p in pieces] == [p.shape for p in rank_slices(full, tp, dim % len(shape))]


# -- whole-model loading -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "hf"
    make_llama(path, layers=1)
    return path


def test_llava_style_renamed_checkpoint_loads_same_weights(llama_dir: Path, tmp_path: Path) -> None:
    """Keys renamed to language_model.model.* / language_model.lm_head.* load with a customized map."""
    renamed = tmp_path / "llava"
    renamed.mkdir()
    tensors = load_file(llama_dir / "model.safetensors")
    save_file({"language_model." + k: v for k, v in tensors.items()}, renamed / "model.safetensors")
    shutil.copy(llama_dir / "config.json", renamed / "config.json")

    ref = LlamaForCausalLM.from_hugging_face(llama_dir).checkpoint_weights()
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight"):
        LlamaForCausalLM.from_hugging_face(renamed)  # the default map alone cannot find them
    ours = LlamaForCausalLM.from_hugging_face(renamed, customized_key_dict=LLAVA_MAP).checkpoint_weights()
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name


def test_preprocess_is_applied_before_postprocess(llama_dir: Path) -> None:
    """``preprocess`` sees the raw external tensors (3 for qkv) and its result is what gets loaded."""
    loader = ModelWeightsLoader(llama_dir)
    raw = load_file(llama_dir / "model.safetensors")
    seen: list[int] = []

    def double(weights: list[torch.Tensor]) -> list[torch.Tensor]:
        seen.append(len(weights))
        return [2 * w for w in weights]

    norm = loader.load("transformer.ln_f.weight", preprocess=double)
    assert torch.equal(norm["transformer.ln_f.weight"], 2 * raw["model.norm.weight"])
    layer = QKVColumnLinear(64, 4, 2, 16, bias=False)
    qkv = loader.load("transformer.layers.0.attention.qkv.weight", preprocess=double, module=layer)
    expected = torch.cat([2 * raw[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv["transformer.layers.0.attention.qkv.weight"], expected)
    assert seen == [1, 3]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.emb.weight
        self.norm = nn.LayerNorm(3)


def good_weights() -> dict[str, torch.Tensor]:
    return {"emb.weight": torch.randn(4, 3), "norm.weight": torch.randn(3), "norm.bias": torch.randn(3)}


def test_fill_parameters_assigns_and_keeps_ties() -> None:
    """A complete, well-shaped dict fills every parameter, and tied parameters stay one tensor."""
    model, weights = Tied(), good_weights()
    fill_parameters(model, weights, source="test")
    assert torch.equal(model.norm.bias, weights["norm.bias"])
    assert model.head.weight is model.emb.weight and torch.equal(model.head.weight, weights["emb.weight"])


@pytest.mark.parametrize("change, key", [
    (lambda w: w.pop("norm.bias"), "norm.bias"),
    (lambda w: w.update({"extra.weight": torch.zeros(1)}), "extra.weight"),
    (lambda w: w.update({"norm.weight": torch.zeros(4)}), "norm.weight"),
    (lambda w: w.update({"emb.weight": torch.zeros(4, 3, dtype=torch.float16)}), "emb.weight"),
], ids=["missing", "unexpected", "wrong-shape", "wrong-dtype"])
def test_fill_parameters_is_strict(change, key: str) -> None:
    """Missing, unexpected, misshapen or wrongly typed tensors raise CheckpointError naming the key."""
    weights = good_weights()
    change(weights)
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        fill_parameters(Tied(), weights, source="test")


# -- source formats ------------------------------------------------------------------------


def test_every_source_format_reads_identical_tensors(tmp_path: Path) -> None:
    """safetensors (single, sharded), .bin and .pth sources give the same names, shapes and values."""
    dirs = {name: tmp_path / name for name in ("single", "sharded", "bin", "pth")}
    make_llama(dirs["single"], layers=1)
    make_llama(dirs["sharded"], layers=1, max_shard_size="20KB")
    make_llama(dirs["bin"], layers=1)
    resave_as_torch_bin(dirs["bin"])
    make_llama(dirs["pth"], layers=1)
    resave_as_torch_bin(dirs["pth"], "model.pth")
    assert len(list(dirs["sharded"].glob("*.safetensors"))) > 1

    sources = {name: open_source(d) for name, d in dirs.items()}
    assert type(sources["bin"]).__name__ == type(sources["pth"]).__name__ == "TorchFileSource"
    ref = sources["single"]
    keys = set(ref.keys())
    index = (slice(1, 3),)
    for name, source in sources.items():
        assert set(source.keys()) == keys, name
        assert source.hf_config()["hidden_size"] == 64
        for key in keys:
            assert source.shape(key) == ref.shape(key), (name, key)
            assert torch.equal(source.read(key), ref.read(key)), (name, key)
            assert torch.equal(source.read(key, index), ref.read(key)[index]), (name, key)
    # The same files can also be named directly.
    assert set(open_source(dirs["sharded"] / "model.safetensors.index.json").keys()) == keys
    assert set(open_source(dirs["pth"] / "model.pth").keys()) == keys
