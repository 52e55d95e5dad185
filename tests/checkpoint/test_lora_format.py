"""LoRA adapters in reference 004's tensor format, and PEFT adapters converted into it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kiln.checkpoint.lora import LORA_MODULE_IDS, LoraModule, pack_lora_tensors, parse_lora_tensors
from kiln.checkpoint.peft import CONFIG_FILE, WEIGHTS_FILE, convert_peft_adapter, load_lora_dir, peft_to_lora_modules
from kiln.errors import CheckpointError
from kiln.models.lora_targets import lora_module_shapes
from tests.utils.fakes import llama_config

ROOT = Path(__file__).resolve().parents[2]
# The reference's example model: 4 layers, hidden size 4 (heads of 2, so q, k and v are 4 wide).
EXAMPLE_SHAPES = lora_module_shapes(llama_config(hidden=4, heads=2, kv_heads=2, head=2, inter=8, layers=4))
EXAMPLE_CONFIG = [[1, 0, 2], [2, 0, 4], [1, 1, 2], [2, 1, 4], [1, 2, 2], [1, 3, 8]]  # q and k, then q only


def _example_tensors() -> tuple[np.ndarray, np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The reference example: each row's in-weights [r, 4] then out-weights [4, r], padded."""
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(r, 4, generator=g), torch.randn(4, r, generator=g)) for _, _, r in EXAMPLE_CONFIG]
    weights = np.zeros((6, 8 * 4 + 4 * 8), dtype=np.float16)
    for row, (a, b) in enumerate(pairs):
        flat = torch.cat([a.reshape(-1), b.reshape(-1)]).numpy()
        weights[row, : flat.size] = flat
    return weights, np.array(EXAMPLE_CONFIG, dtype=np.int32), pairs


def test_the_reference_example_loads_as_written():
    weights, config, pairs = _example_tensors()
    modules = parse_lora_tensors(weights, config, EXAMPLE_SHAPES, num_layers=4, max_rank=8)
    assert [(m.name, m.layer, m.rank) for m in modules] == [
        ("attn_q", 0, 2), ("attn_k", 0, 4), ("attn_q", 1, 2), ("attn_k", 1, 4), ("attn_q", 2, 2), ("attn_q", 3, 8)]
    for m, (a, b) in zip(modules, pairs):
        assert m.a.shape == (m.rank, 4) and m.b.shape == (4, m.rank) and m.magnitude is None
        assert torch.equal(m.a, a.half().float().half()) and torch.equal(m.b, b.half())
    packed_weights, packed_config = pack_lora_tensors(modules, torch.float16)
    assert np.array_equal(packed_weights.numpy(), weights) and np.array_equal(packed_config.numpy(), config)


def test_dora_rows_carry_their_magnitudes():
    shapes = EXAMPLE_SHAPES
    a, b, magnitude = torch.ones(2, 4), torch.full((4, 2), 2.0), torch.arange(4.0)
    weights = torch.cat([a.reshape(-1), b.reshape(-1), magnitude])[None]
    (module,) = parse_lora_tensors(weights, torch.tensor([[3, 1, 2, 1]]), shapes, num_layers=4)
    assert module.name == "attn_v" and torch.equal(module.magnitude, magnitude)
    packed, config = pack_lora_tensors([module])
    assert config.tolist() == [[3, 1, 2, 1]] and torch.equal(packed, weights)


@pytest.mark.parametrize("weights_shape, config, fragment", [
    ((6, 64), [[1, 0, 2]], "a row per config row"),
    ((1, 64), [[1, 0]], "[rows, 3] or [rows, 4]"),
    ((1, 64), [[42, 0, 2]], "unknown module_id 42"),
    ((1, 64), [[8, 0, 2]], "cross_attn_qkv (id 8) is not one this engine applies LoRA to"),
    ((1, 64), [[1, 4, 2]], "layer_idx 4 is outside the model's 4 layers"),
    ((1, 64), [[1, 0, 0]], "adapter_size 0 must be at least 1"),
    ((1, 128), [[1, 0, 16]], "max_lora_rank is 8"),
    ((1, 16), [[1, 0, 4]], "needs 32 weight values"),
    ((1, 64), [[1, 0, 2, 2]], "is_dora must be 0 or 1"),
    ((2, 64), [[1, 0, 2], [1, 0, 4]], "already given by row 0"),
])
def test_bad_tensors_name_the_row_and_field(weights_shape, config, fragment):
    with pytest.raises(CheckpointError) as info:
        parse_lora_tensors(np.zeros(weights_shape, np.float32), np.array(config), EXAMPLE_SHAPES,
                           num_layers=4, max_rank=8)
    assert fragment in str(info.value)


# -- PEFT adapters --------------------------------------------------------------------------------

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(path: Path, **lora_options):
    """A tiny random Llama with a PEFT LoRA adapter of random (non-zero) A and B, saved to ``path``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    options = dict(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, LoraConfig(**{**options, **lora_options}))
    model.save_pretrained(path)
    return model


def _peft_deltas(model) -> dict[tuple[int, str], torch.Tensor]:
    """What PEFT adds to each adapted weight, by (layer, reference module name)."""
    from kiln.checkpoint.peft import PEFT_TARGETS

    deltas = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and name.split(".")[-1] in PEFT_TARGETS:
            layer = int(name.split("layers.")[1].split(".")[0])
            deltas[layer, PEFT_TARGETS[name.split(".")[-1]]] = module.get_delta_weight("default").detach()
    return deltas


@pytest.mark.parametrize("options", [{}, {"use_rslora": True, "r": 8},
                                     {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"down_proj": 3}}],
                         ids=["plain", "rslora", "patterns"])
def test_peft_adapter_converts_to_the_deltas_peft_applies(tmp_path, options):
    model = _peft_adapter(tmp_path / "adapter", **options)
    modules = peft_to_lora_modules(tmp_path / "adapter")
    deltas = _peft_deltas(model)
    assert sorted((m.layer, m.name) for m in modules) == sorted(deltas)
    assert [(m.layer, m.module_id) for m in modules] == sorted((m.layer, m.module_id) for m in modules)
    for m in modules:
        torch.testing.assert_close(m.b @ m.a, deltas[m.layer, m.name], atol=1e-6, rtol=1e-5)
    if "rank_pattern" in options:
        assert {m.rank for m in modules if m.name == "attn_q"} == {2}


def test_gated_mlp_targets_follow_the_reference_convention():
    """mlp_h_to_4h (id 5) is the activated gate_proj (the `fc` of kiln and the reference),
    mlp_gate (id 7) the up_proj: adapters converted elsewhere must land on the same linears."""
    from kiln.checkpoint.peft import PEFT_TARGETS

    assert LORA_MODULE_IDS[PEFT_TARGETS["gate_proj"]] == 5 and LORA_MODULE_IDS[PEFT_TARGETS["up_proj"]] == 7
    assert LORA_MODULE_IDS[PEFT_TARGETS["down_proj"]] == 6 and LORA_MODULE_IDS[PEFT_TARGETS["gate_up_proj"]] == 18


def test_converted_files_load_back_into_the_same_rows(tmp_path):
    model = _peft_adapter(tmp_path / "adapter")
    out = convert_peft_adapter(tmp_path / "adapter", tmp_path / "out", "float32")
    weights, config = load_lora_dir(out)
    assert weights.dtype == np.float32 and config.dtype == np.int32 and config.shape == (2 * len(TARGETS), 3)
    shapes = lora_module_shapes(llama_config(hidden=32, heads=4, kv_heads=2, head=8, inter=48, layers=2))
    deltas = _peft_deltas(model)
    for m in parse_lora_tensors(weights, config, shapes, num_layers=2, max_rank=4):
        torch.testing.assert_close(m.b @ m.a, deltas[m.layer, m.name], atol=1e-6, rtol=1e-5)


def test_kiln_lora_convert_cli(tmp_path):
    _peft_adapter(tmp_path / "adapter")
    run = subprocess.run([sys.executable, "-m", "kiln.cli.main", "lora", "convert", "-i", tmp_path / "adapter",
                          "-o", tmp_path / "out", "--storage-type", "float16"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "14 module rows over 2 layers" in run.stdout
    assert np.load(tmp_path / "out" / WEIGHTS_FILE).dtype == np.float16
    assert np.load(tmp_path / "out" / CONFIG_FILE).tolist()[0] == [LORA_MODULE_IDS["attn_q"], 0, 4]
    missing = subprocess.run([sys.executable, "-m", "kiln.cli.main", "lora", "convert", "-i", tmp_path / "nothing",
                              "-o", tmp_path / "out2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no adapter_config.json" in missing.stderr
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("change, fragment", [
    (lambda c: c.update(use_dora=True), "DoRA adapter"),
    (lambda c: c.update(bias="lora_only"), "no bias terms"),
    (lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda c: c.update(peft_type="IA3"), "peft_type 'IA3'"),
])
def test_adapters_the_format_cannot_carry_are_refused(tmp_path, change, fragment):
    _peft_adapter(tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    change(config)
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=fragment):
        peft_to_lora_modules(tmp_path / "adapter")


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`")  # PEFT saving the embedding it adapts
def test_an_unsupported_target_is_named(tmp_path):
    _peft_adapter(tmp_path / "adapter", target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(CheckpointError, match="embed_tokens"):
        peft_to_lora_modules(tmp_path / "adapter")


# -- tensor parallelism ---------------------------------------------------------------------------

GQA_MODEL = SimpleNamespace(hidden_size=16, head_size=4, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=24, num_hidden_layers=1)


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", ["attn_q", "attn_k", "attn_v", "attn_qkv", "attn_dense", "mlp_h_to_4h",
                                  "mlp_gate", "mlp_gate_up", "mlp_4h_to_h"])
def test_tensor_parallel_shards_reassemble(name, tp_size):
    """Reference 004's rule: column targets split B by output rows (A whole), row targets split A
    by input columns (B whole). Each rank's delta is then its slice of the full delta's rows
    (column) or a partial sum of it (row), as the rank's linear computes."""
    from kiln.checkpoint.lora import ROW_MODULES, shard_lora_module

    g = torch.Generator().manual_seed(0)
    size_in, size_out = lora_module_shapes(llama_config(16, 4, 2, 4, 24, 1))[0, LORA_MODULE_IDS[name]]
    full = LoraModule(LORA_MODULE_IDS[name], 0, torch.randn(3, size_in, generator=g),
                      torch.randn(size_out, 3, generator=g), torch.randn(size_out, generator=g))
    shards = [shard_lora_module(full, GQA_MODEL, tp_size, r) for r in range(tp_size)]
    delta = full.b @ full.a
    if full.module_id in ROW_MODULES:
        assert all(torch.equal(s.b, full.b) for s in shards)
        assert torch.equal(torch.cat([s.a for s in shards], dim=1), full.a)
        parts = [s.b @ s.a for s in shards]  # each rank's partial products, over its input slice
        x = torch.randn(size_in, generator=g)
        pieces = x.chunk(tp_size)
        torch.testing.assert_close(sum(p @ xi for p, xi in zip(parts, pieces)), delta @ x)
        return
    assert all(torch.equal(s.a, full.a) for s in shards)
    q, kv = 16, 8  # GQA_MODEL: 4 heads and 2 KV heads of 4
    kv_ways = min(tp_size, 2)
    if name == "attn_qkv":  # each part split on its own; k and v replicated past 2 ranks
        expected = [torch.cat([delta[:q].chunk(tp_size)[r], delta[q:q + kv].chunk(kv_ways)[r * kv_ways // tp_size],
                               delta[q + kv:].chunk(kv_ways)[r * kv_ways // tp_size]]) for r in range(tp_size)]
    elif name in ("attn_k", "attn_v"):
        expected = [delta.chunk(kv_ways)[r * kv_ways // tp_size] for r in range(tp_size)]
    elif name == "mlp_gate_up":
        gate, up = delta.chunk(2)
        expected = [torch.cat([gate.chunk(tp_size)[r], up.chunk(tp_size)[r]]) for r in range(tp_size)]
    else:
        expected = list(delta.chunk(tp_size))
        assert torch.equal(torch.cat([s.b for s in shards]), full.b)  # plain columns: the shards reassemble B
        assert torch.equal(torch.cat([s.magnitude for s in shards]), full.magnitude)
    for shard, rows in zip(shards, expected):
        torch.testing.assert_close(shard.b @ shard.a, rows)


def test_a_split_that_does_not_divide_is_refused():
    from kiln.checkpoint.lora import shard_lora_module

    module = LoraModule(LORA_MODULE_IDS["attn_dense"], 0, torch.zeros(2, 16), torch.zeros(16, 2))
    with pytest.raises(CheckpointError, match="16 input features do not split over 3 ranks"):
        shard_lora_module(module, GQA_MODEL, 3, 0)
