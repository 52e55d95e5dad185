"""Multi-rank checkpoints: each rank's shard, re-assembled, is exactly the single-rank checkpoint.

Re-assembly rules (reference 002): column-parallel weights concatenate on dim 0 (qkv per
q/k/v part, replicated KV heads de-duplicated), row-parallel ``dense``/``proj`` weights on
dim 1, the vocab-parallel lm_head on dim 0 with zero padding past the vocabulary, and every
other tensor is identical on all ranks.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import pytest
import torch

from kiln.checkpoint.format import read_rank_weights
from kiln.convert import convert_checkpoint
from tests.utils.tiny_models import make_gpt2, make_llama

Weights = dict[str, torch.Tensor]

MODELS: dict[str, Callable[[Path], object]] = {
    "llama-gqa": lambda p: make_llama(p, num_heads=4, num_kv_heads=2),
    "llama-vocab250-tied": lambda p: make_llama(p, num_heads=4, num_kv_heads=2, vocab=250, tie=True),
    "gpt2": lambda p: make_gpt2(p),
    "llama-3layers-tied": lambda p: make_llama(p, layers=3, tie=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Callable[..., Path]:
    """``get(model, tp_size=1, pp_size=1)``: the converted checkpoint dir, converted once."""
    hf_dirs: dict[str, Path] = {}
    cache: dict[tuple, Path] = {}

    def get(model: str, tp_size: int = 1, pp_size: int = 1) -> Path:
        if model not in hf_dirs:
            hf_dirs[model] = tmp_path_factory.mktemp(model) / "hf"
            MODELS[model](hf_dirs[model])
        key = (model, tp_size, pp_size)
        if key not in cache:
            out = hf_dirs[model].parent / f"tp{tp_size}-pp{pp_size}"
            cache[key] = convert_checkpoint(hf_dirs[model], out, tp_size=tp_size, pp_size=pp_size, progress=False)
        return cache[key]

    return get


def load_ranks(checkpoint: Path) -> tuple[dict, list[Weights]]:
    config = json.loads((checkpoint / "config.json").read_text())
    world = config["mapping"]["world_size"]
    files = sorted(p.name for p in checkpoint.glob("rank*.safetensors"))
    assert files == sorted(f"rank{r}.safetensors" for r in range(world))
    return config, [read_rank_weights(checkpoint, r) for r in range(world)]


def merge_qkv(parts: list[torch.Tensor], config: dict) -> torch.Tensor:
    """Undo the fused qkv split: q slices concatenate, replicated k/v slices are de-duplicated."""
    tp = len(parts)
    heads, kv, head = config["num_attention_heads"], config["num_key_value_heads"], config["head_size"]
    q_local, kv_local = heads // tp * head, max(kv // tp, 1) * head
    qs, ks, vs = zip(*(p.split([q_local, kv_local, kv_local]) for p in parts))
    sharing = tp // min(tp, kv)  # ranks holding the same KV heads are neighbours
    for r in range(tp):
        first = r - r % sharing
        assert torch.equal(ks[r], ks[first]) and torch.equal(vs[r], vs[first]), f"rank {r} kv != rank {first}"
    return torch.cat([torch.cat(qs), torch.cat(ks[::sharing]), torch.cat(vs[::sharing])])


def reassemble(ranks: list[Weights], config: dict) -> Weights:
    """The single-rank tensors recovered from the ranks of one pipeline stage."""
    names = set(ranks[0])
    assert all(set(r) == names for r in ranks), "ranks hold different tensor names"
    out: Weights = {}
    for name in names:
        parts = [r[name] for r in ranks]
        if ".attention.qkv." in name:
            out[name] = merge_qkv(parts, config)
        elif name.startswith("lm_head."):
            vocab, tp = config["vocab_size"], len(ranks)
            full = torch.cat(parts)
            assert full.shape[0] == math.ceil(vocab / tp) * tp
            assert not full[vocab:].any(), "lm_head padding rows must be zero"
            out[name] = full[:vocab]
        elif ".mlp.fc." in name or ".mlp.gate." in name:
            out[name] = torch.cat(parts, dim=0)
        elif name.endswith(("attention.dense.weight", "mlp.proj.weight")):
            out[name] = torch.cat(parts, dim=1)
        else:
            for r, p in enumerate(parts[1:], 1):
                assert torch.equal(p, parts[0]), f"replicated {name} differs on rank {r}"
            out[name] = parts[0]
    return out


def assert_same_as_single_rank(merged: Weights, single: Weights) -> None:
    """Tensor-by-tensor equality; a tied single-rank lm_head is its embedding table."""
    lm_head = single.get("lm_head.weight", single.get("transformer.vocab_embedding.weight"))
    for name, tensor in merged.items():
        ref = lm_head if name == "lm_head.weight" else single[name]
        assert tensor.shape == ref.shape and torch.equal(tensor, ref), name


@pytest.mark.parametrize("model, tp", [("llama-gqa", 2), ("llama-gqa", 4), ("llama-vocab250-tied", 4),
                                        ("gpt2", 2), ("gpt2", 4)])
def test_tp_shards_reassemble_to_single_rank(checkpoints, model: str, tp: int) -> None:
    """tp_size=2/4 shards (incl. replicated KV heads and padded vocab) re-assemble to the tp=1 checkpoint."""
    config, ranks = load_ranks(checkpoints(model, tp_size=tp))
    _, (single,) = load_ranks(checkpoints(model))
    assert {k: config["mapping"][k] for k in ("world_size", "tp_size", "pp_size")} == {
        "world_size": tp, "tp_size": tp, "pp_size": 1}
    merged = reassemble(ranks, config)
    assert set(merged) - {"lm_head.weight"} == set(single) - {"lm_head.weight"}
    assert "lm_head.weight" in merged
    assert_same_as_single_rank(merged, single)
    # Sharded tensors really are split: each rank holds 1/tp of the MLP columns.
    fc = ranks[0]["transformer.layers.0.mlp.fc.weight"]
    assert fc.shape[0] * tp == single["transformer.layers.0.mlp.fc.weight"].shape[0]


@pytest.mark.parametrize("model, tp", [("llama-gqa", 4), ("gpt2", 2)])
def test_embedding_is_whole_on_every_rank_by_default(checkpoints, model: str, tp: int) -> None:
    """use_parallel_embedding defaults to False, so every rank holds the whole embedding table."""
    config, ranks = load_ranks(checkpoints(model, tp_size=tp))
    _, (single,) = load_ranks(checkpoints(model))
    assert config["use_parallel_embedding"] is False
    for weights in ranks:
        assert torch.equal(weights["transformer.vocab_embedding.weight"], single["transformer.vocab_embedding.weight"])
        assert weights["transformer.vocab_embedding.weight"].shape[0] == config["vocab_size"]


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_hold_disjoint_layers(checkpoints, tp: int) -> None:
    """pp_size=2 over 3 layers: stage 0 has layers 0-1 and the embedding, stage 1 layer 2, ln_f and lm_head."""
    config, ranks = load_ranks(checkpoints("llama-3layers-tied", tp_size=tp, pp_size=2))
    _, (single,) = load_ranks(checkpoints("llama-3layers-tied"))
    assert {k: config["mapping"][k] for k in ("world_size", "tp_size", "pp_size")} == {
        "world_size": 2 * tp, "tp_size": tp, "pp_size": 2}
    stages = [reassemble(ranks[s * tp:(s + 1) * tp], config) for s in range(2)]  # rank = pp_rank * tp + tp_rank

    def layers(weights: Weights) -> set[int]:
        return {int(n.split(".")[2]) for n in weights if n.startswith("transformer.layers.")}

    assert layers(stages[0]) == {0, 1} and layers(stages[1]) == {2}
    assert "transformer.vocab_embedding.weight" in stages[0] and "transformer.vocab_embedding.weight" not in stages[1]
    for name in ("transformer.ln_f.weight", "lm_head.weight"):
        assert name in stages[1] and name not in stages[0]
    for stage in stages:
        assert_same_as_single_rank(stage, single)
    assert set(stages[0]) | set(stages[1]) == set(single) | {"lm_head.weight"}


@pytest.mark.parametrize("sharding_dim", [0, 1])
def test_parallel_embedding_shards_and_lookup(tmp_path, monkeypatch, sharding_dim: int) -> None:
    """use_parallel_embedding splits the table per reference 001, and the ranks' lookups combine.

    Vocabulary sharding (dim 0): each rank holds ceil(vocab / tp) rows (the last zero-padded)
    and returns zeros for ids outside its range, so the sum over ranks (the all-reduce) is
    the full lookup. Hidden sharding (dim 1): each rank returns its columns for every id, so
    concatenating them (the all-gather) is the full lookup. The collectives are replaced by
    identity here to see each rank's local result.
    """
    import kiln.distributed
    from kiln.layers.embedding import Embedding

    monkeypatch.setattr(kiln.distributed, "all_reduce", lambda x, tp_size: x)
    monkeypatch.setattr(kiln.distributed, "all_gather", lambda x, tp_size, dim=-1: x)
    tp, vocab = 4, 250
    hf = tmp_path / "hf"
    make_llama(hf, vocab=vocab)
    full = read_rank_weights(convert_checkpoint(hf, tmp_path / "tp1", progress=False), 0)
    out = convert_checkpoint(hf, tmp_path / "tp4", tp_size=tp, use_parallel_embedding=True,
                             embedding_sharding_dim=sharding_dim, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["use_parallel_embedding"] is True and config["embedding_sharding_dim"] == sharding_dim
    table = full["transformer.vocab_embedding.weight"]
    ids = torch.tensor([0, 5, 62, 63, 127, 200, 249])
    lookups = []
    for rank in range(tp):
        shard = read_rank_weights(out, rank)["transformer.vocab_embedding.weight"]
        layer = Embedding(vocab, table.shape[1], tp_size=tp, tp_rank=rank, sharding_dim=sharding_dim)
        assert shard.shape == layer.weight.shape
        layer.weight.data = shard
        lookups.append(layer(ids))
        if sharding_dim == 0 and rank == tp - 1:
            assert shard[vocab - rank * shard.shape[0]:].abs().sum() == 0  # zero padding
    combined = sum(lookups) if sharding_dim == 0 else torch.cat(lookups, dim=-1)
    torch.testing.assert_close(combined, table[ids], rtol=0, atol=0)
