"""A bfloat16 engine (packed oneDNN weights, native decode attention) against HF in float32.

bf16 rounding changes logits by ~1e-2, so exact token equality with float32 is not the
contract; what is: every greedy token kiln picks is HF's argmax or within bf16 noise of it,
and prompt logits agree to bf16 precision.
"""
from __future__ import annotations

import pytest
import torch

from kiln.runtime.engine import Engine
from tests.conftest import convert_and_build
from tests.utils.compare import kiln_greedy, kiln_prompt_logits
from tests.utils.tiny_models import make_llama


@pytest.fixture(scope="module")
def bf16_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    hf = make_llama(root / "hf", num_heads=4, num_kv_heads=2, hidden=64, layers=2)
    engine = convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4}, dtype="bfloat16")
    return hf, engine


def test_engine_is_bf16_and_prompt_logits_match(bf16_case):
    hf, engine = bf16_case
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = kiln_prompt_logits(engine, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 0.03 * scale


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_greedy_decode_follows_hf_argmax_within_bf16_noise(bf16_case, batch):
    hf, engine = bf16_case
    assert Engine(engine).config.dtype == "bfloat16"
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 256, (5 + 3 * i,), generator=gen).tolist() for i in range(batch)]
    for prompt, out in zip(prompts, kiln_greedy(engine, prompts, 10)):
        full = prompt + out
        with torch.no_grad():
            logits = hf(torch.tensor([full])).logits[0].float()
        scale = logits.abs().max().item()
        for pos in range(len(prompt) - 1, len(full) - 1):
            step = logits[pos]
            chosen = full[pos + 1]
            assert step.max() - step[chosen] <= 0.03 * scale, (pos, chosen, step.argmax().item())


def test_bf16_linear_uses_a_packed_weight_equal_to_f_linear():
    from torch import nn

    from kiln.layers.linear import ColumnLinear

    layer = ColumnLinear(40, 48, bias=True, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for rows in (7, 65):  # one row goes to the native GEMV (tests/runtime/test_native_elementwise.py)
        layer.weight = nn.Parameter(torch.randn(48, 40, generator=g).to(torch.bfloat16), requires_grad=False)
        layer.bias = nn.Parameter(torch.randn(48, generator=g).to(torch.bfloat16), requires_grad=False)
        x = torch.randn(rows, 40, generator=g).to(torch.bfloat16)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.equal(layer(x), expected)  # a new weight is packed anew, not served stale
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            assert layer._packed_key == (layer.weight.data_ptr(), (48, 40))


def test_build_casts_an_fp32_checkpoint_to_bf16(tmp_path, bf16_case):
    from safetensors import safe_open

    from kiln.build import build_engine
    from kiln.checkpoint.format import read_config

    hf, _ = bf16_case
    hf.save_pretrained(tmp_path / "hf")
    fp32_engine = convert_and_build(tmp_path / "hf", tmp_path / "w")
    assert read_config(fp32_engine).dtype == "float32"
    engine = build_engine(tmp_path / "w" / "checkpoint", tmp_path / "bf16-engine", progress=False, dtype="bfloat16")
    assert read_config(engine).dtype == "bfloat16"
    with safe_open(str(engine / "rank0.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    ids = [5, 9, 23, 7, 61, 2]
    torch.testing.assert_close(kiln_prompt_logits(engine, ids), kiln_prompt_logits(fp32_engine, ids),
                               atol=0.05, rtol=0.05)


def test_auto_dtype_follows_the_cpu_and_keeps_a_chosen_dtype(monkeypatch):
    from kiln.build import builder
    from kiln.config import PretrainedConfig
    from kiln.errors import BuildError

    def config(dtype: str, **extra):
        return PretrainedConfig.from_dict({"architecture": "LlamaForCausalLM", "dtype": dtype, "vocab_size": 8,
                                           "hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 1, "hidden_act": "silu",
                                           **extra})

    monkeypatch.setattr(builder, "cpu_has_native_bf16", lambda: True)
    assert builder.resolve_engine_dtype("auto", config("float32")) == "bfloat16"
    assert builder.resolve_engine_dtype(None, config("float16")) == "float16"  # fp16 checkpoints stay fp16
    assert builder.resolve_engine_dtype("auto", config("float32", keep_dtype=True)) == "float32"  # chosen
    assert builder.resolve_engine_dtype("float32", config("bfloat16")) == "float32"
    assert builder.resolve_engine_dtype("auto", config("float32", quantization={"quant_algo": "W8A16"})) \
        == "bfloat16"
    monkeypatch.setattr(builder, "cpu_has_native_bf16", lambda: False)
    assert builder.resolve_engine_dtype("auto", config("float32")) == "float32"
    with pytest.raises(BuildError, match="dtype 'int8'"):
        builder.resolve_engine_dtype("int8", config("float32"))


def test_a_bf16_engine_holds_its_linears_in_tiles_once(bf16_case, monkeypatch):
    """kiln build writes bf16 linear weights in the packed kernel's tiles, so loading is a plain
    read and each weight is held once; a CPU without that kernel unpacks them at load, to the
    same weights and logits."""
    from kiln import kernels
    from kiln.layers.linear import Linear

    _, engine_dir = bf16_case
    tiled = Engine(engine_dir).model
    linears = {name: m for name, m in tiled.named_modules() if isinstance(m, Linear)}
    assert linears["lm_head"].tile_order and linears["transformer.layers.0.attention.qkv"].tile_order
    assert not linears["transformer.layers.0.mlp.proj"].tile_order  # 136 inputs do not tile
    assert all(m.packed_weight() is m.weight for m in linears.values() if m.tile_order)
    ids = [5, 9, 23, 7, 61, 2, 40, 41, 42]
    expected = kiln_prompt_logits(engine_dir, ids)

    monkeypatch.setattr(kernels, "packed_linear_available", lambda: False)
    plain = Engine(engine_dir).model
    for name, m in plain.named_modules():
        if isinstance(m, Linear) and linears[name].tile_order:
            assert not m.tile_order and torch.equal(kernels.pack_bf16(m.weight), linears[name].weight)
    torch.testing.assert_close(kiln_prompt_logits(engine_dir, ids), expected, atol=0.02, rtol=0.02)


def test_an_engine_is_mapped_from_its_file_and_runs_as_if_read(bf16_case, monkeypatch):
    """An engine's tensors are views of its file mapped copy-on-write (one storage, the
    mapping), each whole-cache-line tensor on a cache line; the logits equal those of the same
    engine read into memory."""
    from kiln.checkpoint.safetensors_io import SafetensorsReader

    _, bf16_engine_dir = bf16_case
    params = list(Engine(bf16_engine_dir).model.parameters())
    file_bytes = (bf16_engine_dir / "rank0.safetensors").stat().st_size
    assert {p.untyped_storage().nbytes() for p in params} == {file_bytes}
    assert all(p.data_ptr() % 64 == 0 for p in params if p.numel() * p.element_size() % 64 == 0)
    ids = [3, 17, 9, 40, 2, 11]
    mapped = kiln_prompt_logits(bf16_engine_dir, ids)
    monkeypatch.setattr(SafetensorsReader, "mapped", lambda self: {n: self.read(n) for n in self.keys()})
    assert {Engine(bf16_engine_dir).model.lm_head.weight.untyped_storage().nbytes()} != {file_bytes}
    assert torch.equal(kiln_prompt_logits(bf16_engine_dir, ids), mapped)
