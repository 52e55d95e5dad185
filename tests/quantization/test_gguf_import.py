"""GGUF files at their own precision (kiln.quantization.gguf): blocks decoded against the gguf
package's own dequantization, a mixed-type file's checkpoint holding the file's values with each
linear in its own format, and engines computing what the dequantized engine of the same file
computes, their quantized tensors as large as the file's blocks."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from safetensors import safe_open

from kiln.checkpoint.gguf_source import GGUFSource
from kiln.config import LayerQuant
from kiln.quantization import dequantize
from kiln.quantization.gguf_blocks import NATIVE, decode, native, to_format
from tests.conftest import convert_and_build
from tests.utils.compare import kiln_batch_prompt_logits, kiln_greedy, kiln_prompt_logits
from tests.utils.tiny_gguf import EXPERTS, LINEARS, tensor_bytes, write_llama, write_qwen3_moe

EXACT = list(NATIVE)
# a quantized linear's checkpoint tensors (a K-quant's super-block multipliers too)
TENSORS = ("weight", "weights_scaling_factor", "weights_offset", "weights_super_scale", "weights_super_offset")


def _wider(qtype: Q) -> list[tuple[int, bool, str | None, bool]]:
    """Every format holding ``qtype``'s blocks: its own, with an offset, and in 8 bits; a
    K-quant's codes with its super-block scales or with float ones."""
    f = native(qtype)
    if f.group != 32:  # Q6_K's 6-bit codes in groups of 16: only its own
        return [(f.bits, f.offset, None, f.super_scales)]
    if f.codebook is not None:  # MXFP4: its own E2M1 codes, or int8 codes with or without offsets
        return [(4, False, f.codebook, False), (8, False, None, False), (8, True, None, False)]
    supers = {False, f.super_scales}
    return sorted({(bits, offset, None, s) for bits in (f.bits, 8) for offset in {f.offset, True} for s in supers})


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
def test_blocks_decode_to_the_packages_values(qtype):
    raw = tensor_bytes((32, 512), qtype, np.random.default_rng(3), None)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype))
    group = native(qtype).group
    decoded = decode(torch.from_numpy(raw), qtype, group)
    cases = [(f, decoded) for f in _wider(qtype)]
    if group != 32:  # Q6_K beside other types in one linear: rounded into int8 groups of 32
        cases.append(((8, False, None, False), decode(torch.from_numpy(raw), qtype)))
    for (bits, offset, codebook, supers), decoded in cases:
        tensors = to_format([decoded], bits, offset, codebook, supers)
        assert ("weights_super_scale" in tensors) is supers
        got = dequantize(tensors, bits, 16 if bits == 6 else 32, codebook)
        if group == 32 or bits == 6:  # bit for bit, in the file's own format or any finer one
            assert torch.equal(got, expected), (bits, offset, supers)
        else:  # Q6_K's 16-weight sub-blocks: rounded to nearest into int8 groups of 32
            step = tensors["weights_scaling_factor"].repeat_interleave(32, dim=1)
            assert torch.all((got - expected).abs() <= step / 2 * (1 + 1e-6))
            assert step.max() <= expected.abs().max() / 127 * 1.001


# Layer 0: q/k Q4_K with v Q6_K (Q4_K_M's mix), gate/up pairs of different 4-bit types. Layer 1:
# three types in one qkv, a float gate (its pair stays float too), Q6_K rounded alone.
TYPES = [dict(attn_q=Q.Q4_K, attn_k=Q.Q4_K, attn_v=Q.Q6_K, attn_output=Q.Q5_0, ffn_gate=Q.Q4_1, ffn_up=Q.Q4_0,
              ffn_down=Q.Q5_K),
         dict(attn_q=Q.Q8_0, attn_k=Q.Q5_1, attn_v=Q.Q4_0, attn_output=Q.Q4_K, ffn_gate=Q.F16, ffn_up=Q.Q8_0,
              ffn_down=Q.Q6_K)]
W8, W4 = "W8A16", "W4A16"
EXPECTED_LAYERS = {
    "transformer.layers.0.attention.qkv": LayerQuant(W8, 32, has_offset=True),
    "transformer.layers.0.attention.dense": LayerQuant(W8, 32),
    "transformer.layers.0.mlp.fc": LayerQuant(W4, 32, has_offset=True),
    "transformer.layers.0.mlp.gate": LayerQuant(W4, 32, has_offset=True),
    "transformer.layers.0.mlp.proj": LayerQuant(W8, 32, has_offset=True, super_scales=True),  # Q5_K
    "transformer.layers.1.attention.qkv": LayerQuant(W8, 32, has_offset=True),
    "transformer.layers.1.attention.dense": LayerQuant(W4, 32, has_offset=True, super_scales=True),  # Q4_K
    "transformer.layers.1.mlp.proj": LayerQuant("W6A16", 16, super_scales=True),  # Q6_K alone
    "lm_head": LayerQuant(W4, 32),
}
PARTS = {"attention.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "attention.dense": ["self_attn.o_proj"], "mlp.fc": ["mlp.gate_proj"], "mlp.gate": ["mlp.up_proj"],
         "mlp.proj": ["mlp.down_proj"]}


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch):
    # The tiny files carry no vocabulary; the engines are run on token ids.
    monkeypatch.setattr(GGUFSource, "save_tokenizer", lambda self, out: None)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mixed") / "tiny.gguf"
    write_llama(path, TYPES, output=Q.Q4_0)
    return path


def test_mixed_file_keeps_each_linear_at_its_precision(mixed, tmp_path):
    from kiln.convert import convert_checkpoint

    checkpoint = convert_checkpoint(mixed, tmp_path / "ckpt", progress=False)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["dtype"] == "float32" and config["quantization"]["quant_algo"] == "MIXED_PRECISION"
    layers = {name: LayerQuant(**f) for name, f in config["quantization"]["quantized_layers"].items()}
    assert layers == EXPECTED_LAYERS
    src = GGUFSource(mixed)
    with safe_open(str(checkpoint / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.1.mlp.gate.weight").dtype == torch.float32  # its pair is F16
        for name, fmt in layers.items():
            tensors = {t: f.get_tensor(f"{name}.{t}") for t in TENSORS if f"{name}.{t}" in f.keys()}
            got = dequantize(tensors, fmt.bits, fmt.group_size)
            parts = ["lm_head"] if name == "lm_head" else [
                f"model.layers.{name.split('.')[2]}.{p}" for p in PARTS[name.split(".", 3)[3]]]
            expected = torch.cat([src.read(f"{p}.weight") for p in parts])
            rounded = [src.tensor_type(f"{p}.weight") == Q.Q6_K and fmt.bits != 6 for p in parts]
            rows = torch.cat([torch.full((src.shape(f"{p}.weight")[0],), r) for p, r in zip(parts, rounded)])
            # The file's values exactly (q/k rows un-permuted), but for Q6_K rows beside other types
            # (within half a step).
            assert torch.equal(got[~rows], expected[~rows]), name
            if rows.any():
                step = tensors["weights_scaling_factor"].repeat_interleave(32, dim=1)[rows]
                assert torch.all((got[rows] - expected[rows]).abs() <= step / 2 * (1 + 1e-6)), name


def test_native_engine_computes_the_dequantized_engine(mixed, tmp_path):
    native_engine = convert_and_build(mixed, tmp_path / "native", {"tokens_per_block": 4}, dtype=None)
    float_engine = convert_and_build(mixed, tmp_path / "float", {"tokens_per_block": 4}, dtype="bfloat16")
    assert json.loads((native_engine / "config.json").read_text())["dtype"] == "bfloat16"
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, ref = kiln_prompt_logits(native_engine, ids), kiln_prompt_logits(float_engine, ids)
    # a 20-token prompt's linears take x in int8 blocks of 32 (AMX int8 tiles, the GEMV's arithmetic)
    assert (ours - ref).abs().max() <= 0.04 * ref.abs().max()
    # Greedy: each token the native engine picks is the float engine's pick, or a near-tie within
    # the logits' tolerance (how a prompt's rows meet the weights differs by CPU: AMX int8 tiles,
    # or dequantized panels where the decode steps' GEMV takes x in int8 blocks).
    prompts = [ids[:7], ids[7:]]
    for prompt, tokens in zip(prompts, kiln_greedy(native_engine, prompts, 12)):
        logits = kiln_prompt_logits(float_engine, prompt + tokens)[len(prompt) - 1:-1].float()
        chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert torch.all(chosen >= logits.max(-1).values - 0.04 * ref.abs().max())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_engine_holds_the_files_blocks_in_as_many_bytes(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    write_llama(path, [dict.fromkeys(LINEARS, qtype)], output=qtype)
    engine = convert_and_build(path, tmp_path / "kiln", {"tokens_per_block": 4}, dtype=None)
    linears = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name != "token_embd.weight"
                  and t.tensor_type == qtype)
    with safe_open(str(engine / "rank0.safetensors"), "pt") as f:
        quantized = [f.get_tensor(k) for k in f.keys() if k.endswith((".weights_scaling_factor", ".weights_offset"))
                     or (k.endswith(".weight") and f.get_tensor(k).element_size() == 1)]
    # codes, float16 scales and (Q4_1) offsets: byte for byte what the file's blocks take (Q6_K's
    # too: 6-bit codes, a byte per 16-weight scale and a float16 per 256); Q4_K's 144-byte
    # super-blocks take 148 (its 6-bit scale and minimum codes a byte each)
    expected = linears * 148 // 144 if qtype == Q.Q4_K else linears
    assert sum(t.numel() * t.element_size() for t in quantized) == expected


@pytest.mark.parametrize("embedding", [Q.Q8_0, Q.Q4_1, Q.F16], ids=lambda q: q.name)
def test_head_tied_to_a_quantized_table_reads_its_codes(tmp_path, embedding):
    """A head tied to a quantized embedding table (SmolLM2's GGUFs: Q8_0) gets the table's codes,
    untied; the lookup keeps the float table. A float table keeps the head tied to it."""
    from kiln.convert import convert_checkpoint

    path = tmp_path / "tied.gguf"
    write_llama(path, [dict.fromkeys(LINEARS, Q.Q4_0)], output=None, embedding=embedding)
    config = json.loads((convert_checkpoint(path, tmp_path / "ckpt", progress=False) / "config.json").read_text())
    quantized = embedding != Q.F16
    assert config["share_embedding_table"] is not quantized
    assert ("lm_head" in config["quantization"]["quantized_layers"]) is quantized
    if quantized:
        with safe_open(str(tmp_path / "ckpt" / "rank0.safetensors"), "pt") as f:
            head = {t: f.get_tensor(f"lm_head.{t}") for t in ("weight", "weights_scaling_factor", "weights_offset")
                    if f"lm_head.{t}" in f.keys()}
            table = f.get_tensor("transformer.vocab_embedding.weight")
        expected = GGUFSource(path).read("model.embed_tokens.weight")
        assert torch.equal(dequantize(head, native(embedding).bits, 32), expected)
        assert table.dtype == torch.float32 and torch.equal(table, expected)
        native_engine = convert_and_build(path, tmp_path / "native", {"tokens_per_block": 4}, dtype=None)
        float_engine = convert_and_build(path, tmp_path / "float", {"tokens_per_block": 4}, dtype="bfloat16")
        ids = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(1)).tolist()
        ours, ref = kiln_prompt_logits(native_engine, ids), kiln_prompt_logits(float_engine, ids)
        assert (ours - ref).abs().max() <= 0.02 * ref.abs().max()


# Stacked experts: layer 0 Q4_K_M's experts (gate/up Q4_K, down Q6_K), layer 1 gate and up
# of different exact types (they share the finer format) and gpt-oss's MXFP4 down projection.
EXPERT_TYPES = [dict(ffn_gate_exps=Q.Q4_K, ffn_up_exps=Q.Q4_K, ffn_down_exps=Q.Q6_K),
                dict(ffn_gate_exps=Q.Q4_0, ffn_up_exps=Q.Q8_0, ffn_down_exps=Q.MXFP4)]
EXPECTED_EXPERTS = {"transformer.layers.0.mlp.fc": LayerQuant(W4, 32, has_offset=True, super_scales=True),
                    "transformer.layers.0.mlp.gate": LayerQuant(W4, 32, has_offset=True, super_scales=True),
                    "transformer.layers.0.mlp.proj": LayerQuant("W6A16", 16, super_scales=True),
                    "transformer.layers.1.mlp.fc": LayerQuant(W8, 32),
                    "transformer.layers.1.mlp.gate": LayerQuant(W8, 32),
                    "transformer.layers.1.mlp.proj": LayerQuant(W4, 32, codebook="e2m1")}
EXPERT_PARTS = {"fc": "gate_proj", "gate": "up_proj", "proj": "down_proj"}


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "moe.gguf"
    write_qwen3_moe(path, EXPERT_TYPES)
    return path


def test_experts_keep_their_blocks_expert_by_expert(moe, tmp_path):
    """Each expert's codes, scales and offsets hold the file's values."""
    from kiln.convert import convert_checkpoint

    checkpoint = convert_checkpoint(moe, tmp_path / "ckpt", progress=False)
    config = json.loads((checkpoint / "config.json").read_text())
    layers = {name: LayerQuant(**f) for name, f in config["quantization"]["quantized_layers"].items()}
    assert {n: q for n, q in layers.items() if ".mlp." in n} == EXPECTED_EXPERTS
    src = GGUFSource(moe)
    with safe_open(str(checkpoint / "rank0.safetensors"), "pt") as f:
        for name, fmt in EXPECTED_EXPERTS.items():
            layer, part = name.split(".")[2], EXPERT_PARTS[name.rpartition(".")[2]]
            expected = src.read(f"model.layers.{layer}.mlp.experts.{part}.weight")
            stacked = {t: f.get_tensor(f"{name}.{t}") for t in TENSORS if f"{name}.{t}" in f.keys()}
            assert all(t.shape[0] == EXPERTS for t in stacked.values())
            for e in range(EXPERTS):
                one = {t: v[e] for t, v in stacked.items()}
                got = dequantize(one, fmt.bits, fmt.group_size, fmt.codebook)
                assert torch.equal(got, expected[e]), (name, e)


def test_native_experts_compute_the_dequantized_engine(moe, tmp_path):
    native_engine = convert_and_build(moe, tmp_path / "native", {"tokens_per_block": 4}, dtype=None)
    float_engine = convert_and_build(moe, tmp_path / "float", {"tokens_per_block": 4}, dtype="bfloat16")
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    # 20 rows (dequantized tiles), then 6 rows in three sequences (decode's GEMV from the codes)
    for prompts in ([ids], [ids[:3], ids[3:5], ids[5:6]]):
        for ours, ref in zip(kiln_batch_prompt_logits(native_engine, prompts),
                             kiln_batch_prompt_logits(float_engine, prompts)):
            assert (ours - ref).abs().max() <= 0.02 * ref.abs().max()
    # the engine holds the experts' codes, not floats: smaller than the float engine by far
    size = lambda engine: (engine / "rank0.safetensors").stat().st_size  # noqa: E731
    assert size(native_engine) < 0.5 * size(float_engine)
