"""GGUFSource: a GGUF file read back as a Hugging Face checkpoint.

Two kinds of evidence: the real SmolLM2-135M GGUF (Q4_1/Q8_0/F32) checked tensor by tensor
against transformers' own GGUF loader, and tiny synthetic files written with gguf.GGUFWriter
for every type the gguf package can quantize.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

import kiln.checkpoint.gguf_source as gguf_source
from kiln.checkpoint.gguf_source import GGUFSource
from kiln.checkpoint.sources import open_source
from kiln.errors import CheckpointError
from tests.utils.real_model import smollm2_gguf_path

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, CONTEXT = 2, 64, 4, 2, 128, 128, 256
HEAD_DIM = HIDDEN // HEADS
# Worst error each type may add, as a fraction of the tensor's largest magnitude (one step of
# the block scale for the integer types: max/127, max/16, max/8).
QUANT_TYPES = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 4e-3, Q.Q8_0: 0.01, Q.Q5_0: 0.07, Q.Q5_1: 0.07,
               Q.Q4_0: 0.14, Q.Q4_1: 0.14}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row reorder llama.cpp's converter applies to llama q/k projections."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_names(tied: bool = True, bias: bool = False) -> dict[str, str]:
    """HF name -> GGUF name for the tiny llama, spelled out independently of the module."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}
    for i in range(LAYERS):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
        if bias:
            for p in "qkv":
                names[f"model.layers.{i}.self_attn.{p}_proj.bias"] = f"blk.{i}.attn_{p}.bias"
    return names


def llama_shapes(name: str) -> tuple[int, ...]:
    if name.endswith("norm.weight") or "layernorm" in name:
        return (HIDDEN,)
    table = {"embed_tokens": (VOCAB, HIDDEN), "lm_head": (VOCAB, HIDDEN), "q_proj": (HIDDEN, HIDDEN),
             "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
             "o_proj": (HIDDEN, HIDDEN), "gate_proj": (FFN, HIDDEN), "up_proj": (FFN, HIDDEN),
             "down_proj": (HIDDEN, FFN)}
    shape = next(s for part, s in table.items() if f".{part}." in f".{name}")
    return shape[:1] if name.endswith(".bias") else shape


def add_llama_meta(w: GGUFWriter, context: int = CONTEXT, hidden: int = HIDDEN, heads: int = HEADS) -> None:
    w.add_block_count(LAYERS)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(FFN)
    w.add_head_count(heads)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_llama(path: Path, qtype: Q, arch: str = "llama", tied: bool = True, bias: bool = False,
                     seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny llama-style GGUF; return its original (HF layout, float32) tensors."""
    rng = np.random.default_rng(seed)
    weights = {hf: rng.standard_normal(llama_shapes(hf)).astype(np.float32)
               for hf in llama_names(tied, bias)}
    w = GGUFWriter(path, arch)
    add_llama_meta(w)
    for hf, gg in llama_names(tied, bias).items():
        data = weights[hf]
        if arch == "llama" and ".q_proj." in hf:
            data = llama_cpp_permute(data, HEADS)
        elif arch == "llama" and ".k_proj." in hf:
            data = llama_cpp_permute(data, KV_HEADS)
        if data.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms and biases in F32
            w.add_tensor(gg, data)
        elif qtype == Q.F16:
            w.add_tensor(gg, data.astype(np.float16))
        else:
            w.add_tensor(gg, quantize(data, qtype), raw_dtype=qtype)
    finish(w)
    return weights


def round_trip(x: np.ndarray, qtype: Q) -> torch.Tensor:
    """What a quantize -> dequantize round trip leaves of x (rows are quantized independently)."""
    if x.ndim == 1 or qtype == Q.F32:
        return torch.from_numpy(x)
    return torch.from_numpy(dequantize(quantize(x, qtype), qtype).astype(np.float32))


# ----------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def smollm2() -> GGUFSource:
    return GGUFSource(smollm2_gguf_path())


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_hf):
    return smollm2_hf


def test_real_model_tensors_equal_transformers(smollm2: GGUFSource, hf_smollm2) -> None:
    types = {t.tensor_type for t in GGUFReader(smollm2.path).tensors}
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= types  # so the comparison really covers dequantization
    state = hf_smollm2.state_dict()
    # Tied embeddings: the GGUF has no output.weight, the HF model shares lm_head with the embedding.
    assert set(smollm2.keys()) == set(state) - {"lm_head.weight"}
    for key in smollm2.keys():
        assert smollm2.shape(key) == tuple(state[key].shape), key
        got = smollm2.read(key)
        assert got.dtype == torch.float32, key
        assert torch.equal(got, state[key]), key


def test_real_model_sliced_reads(smollm2: GGUFSource, hf_smollm2) -> None:
    state = hf_smollm2.state_dict()
    q = "model.layers.3.self_attn.q_proj.weight"  # Q4_1 and row-permuted
    for part in range(3):  # tensor-parallel style row shards
        index = (slice(part * 192, (part + 1) * 192), slice(None))
        assert torch.equal(smollm2.read(q, index), state[q][index])
    emb = "model.embed_tokens.weight"  # Q8_0
    assert torch.equal(smollm2.read(emb, (slice(None), slice(100, 300))), state[emb][:, 100:300])


def test_real_model_config_matches_transformers(smollm2: GGUFSource, hf_smollm2) -> None:
    ours, theirs = smollm2.hf_config(), hf_smollm2.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias"):
        assert ours[field] == getattr(theirs, field), field
    assert ours["rms_norm_eps"] == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    assert "rope_scaling" not in ours


def test_real_model_save_tokenizer(smollm2: GGUFSource, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    smollm2.save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


# ----------------------------------------------------------------------------- synthetic llama


@pytest.mark.parametrize("qtype", list(QUANT_TYPES), ids=lambda q: q.name)
def test_quantized_round_trip(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / "tiny.gguf"
    weights = write_tiny_llama(path, qtype)
    src = GGUFSource(path)
    assert set(src.keys()) == set(weights)
    expected_dtype = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)
    for key, original in weights.items():
        assert src.shape(key) == original.shape, key
        got = src.read(key)
        assert got.dtype == (expected_dtype if original.ndim == 2 else torch.float32), key
        # q/k were written permuted: equality with the unpermuted round trip shows the undo.
        assert torch.equal(got.float(), round_trip(original, qtype)), key
        error = float((got.float() - torch.from_numpy(original)).abs().max())
        assert error <= QUANT_TYPES[qtype] * float(np.abs(original).max()), (key, error)


def test_bias_permutation_and_untied_head(tmp_path: Path) -> None:
    path = tmp_path / "bias.gguf"
    weights = write_tiny_llama(path, Q.Q8_0, tied=False, bias=True)
    src = GGUFSource(path)
    assert set(src.keys()) == set(weights)
    for key in ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(src.read(key), torch.from_numpy(weights[key]))
    config = src.hf_config()
    assert config["attention_bias"] is True and config["tie_word_embeddings"] is False


def test_qwen2_is_not_unpermuted(tmp_path: Path) -> None:
    # llama.cpp writes qwen2 q/k rows as they are, so none must be reordered on read.
    path = tmp_path / "qwen2.gguf"
    weights = write_tiny_llama(path, Q.F32, arch="qwen2", bias=True)
    src = GGUFSource(path)
    for key in weights:
        assert torch.equal(src.read(key), torch.from_numpy(weights[key])), key
    config = src.hf_config()
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"


@pytest.mark.parametrize("qtype", [Q.F32, Q.BF16, Q.Q4_1], ids=lambda q: q.name)
def test_sliced_reads_equal_slices_of_full_read(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, qtype)
    src = GGUFSource(path)
    cases = {
        "model.layers.1.self_attn.q_proj.weight": [(slice(0, 16), slice(None)), (slice(16, 64), slice(8, 40))],
        "model.layers.0.self_attn.k_proj.weight": [(slice(8, 24), slice(None))],
        "model.layers.0.mlp.down_proj.weight": [(slice(None), slice(64, 128)), (slice(3, 5), slice(1, 2))],
        "model.embed_tokens.weight": [(slice(10, 20), slice(None))],
        "model.norm.weight": [(slice(5, 9),)],
    }
    for key, indexes in cases.items():
        full = src.read(key)
        for index in indexes:
            assert torch.equal(src.read(key, index), full[index]), (key, index)
            assert src.read(key, index).is_contiguous()


def test_only_the_latest_tensor_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, Q.Q8_0)
    src = GGUFSource(path)
    calls = []
    real = gguf_source.dequantize
    monkeypatch.setattr(gguf_source, "dequantize", lambda *a: calls.append(1) or real(*a))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    for rows in range(0, 64, 16):
        src.read(q, (slice(rows, rows + 16), slice(None)))
    assert len(calls) == 1
    src.read(k, (slice(0, 16), slice(None)))
    src.read(q, (slice(0, 16), slice(None)))
    assert len(calls) == 3


def test_config_loads_into_transformers_with_matching_parameters(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, Q.Q4_0)
    src = GGUFSource(path)
    config = src.hf_config()
    assert config["head_dim"] == HEAD_DIM and config["num_key_value_heads"] == KV_HEADS
    assert config["rms_norm_eps"] == 1e-6 and config["tie_word_embeddings"] is True
    model = LlamaForCausalLM(LlamaConfig(**config))
    params = dict(model.named_parameters())  # tied lm_head is listed once, as the embedding
    assert {k: src.shape(k) for k in src.keys()} == {k: tuple(p.shape) for k, p in params.items()}


def test_dequantize_only_k_quant(tmp_path: Path) -> None:
    # The gguf package cannot write K-quants, so store random Q6_K blocks and check the decode.
    path = tmp_path / "q6k.gguf"
    raw = np.random.default_rng(1).integers(0, 256, size=(4, 210 * 2), dtype=np.uint8)
    raw[:, 208::210] = raw[:, 418::210] = 0  # keep each block's f16 scale finite
    raw[:, 209::210] = 0x1C
    w = GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", raw, raw_dtype=Q.Q6_K)
    finish(w)
    src = GGUFSource(path)
    assert src.shape("model.embed_tokens.weight") == (4, 512)
    expected = torch.from_numpy(dequantize(raw, Q.Q6_K))
    assert torch.equal(src.read("model.embed_tokens.weight"), expected)


def test_type_the_package_cannot_dequantize(tmp_path: Path) -> None:
    path = tmp_path / "q8_1.gguf"
    w = GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.zeros((2, 40 * 2), dtype=np.uint8), raw_dtype=Q.Q8_1)
    finish(w)
    with pytest.raises(CheckpointError, match=r"token_embd\.weight.*Q8_1"):
        GGUFSource(path).read("model.embed_tokens.weight")


# ----------------------------------------------------------------------------- gpt2


def write_tiny_gpt2(path: Path, n_pos: int, untied: bool = False) -> dict[str, np.ndarray]:
    """Write a tiny GPT-2 GGUF; return its tensors by GGUF name, in GGUF ([out, in]) layout."""
    rng = np.random.default_rng(2)
    ffn = 4 * HIDDEN
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "position_embd.weight": (n_pos, HIDDEN),
              "output_norm.weight": (HIDDEN,), "output_norm.bias": (HIDDEN,)}
    if untied:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.attn_norm.bias": (HIDDEN,),
                   f"blk.{i}.attn_qkv.weight": (3 * HIDDEN, HIDDEN), f"blk.{i}.attn_qkv.bias": (3 * HIDDEN,),
                   f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_output.bias": (HIDDEN,),
                   f"blk.{i}.ffn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.bias": (HIDDEN,),
                   f"blk.{i}.ffn_up.weight": (ffn, HIDDEN), f"blk.{i}.ffn_up.bias": (ffn,),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, ffn), f"blk.{i}.ffn_down.bias": (HIDDEN,)}
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    w = GGUFWriter(path, "gpt2")
    w.add_block_count(LAYERS)
    w.add_context_length(n_pos)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_layer_norm_eps(1e-5)
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    for name, data in tensors.items():
        w.add_tensor(name, data)
    finish(w)
    return tensors


def test_gpt2_names_layout_and_config(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    tensors = write_tiny_gpt2(tmp_path / "gpt2.gguf", n_pos=32)
    src = GGUFSource(tmp_path / "gpt2.gguf")
    config = src.hf_config()
    assert config["vocab_size"] == VOCAB and config["n_positions"] == 32 and config["n_inner"] == 4 * HIDDEN
    assert config["tie_word_embeddings"] is True and config["activation_function"] == "gelu_new"
    model = GPT2LMHeadModel(GPT2Config(**config))
    params = dict(model.named_parameters())
    assert {k: src.shape(k) for k in src.keys()} == {k: tuple(p.shape) for k, p in params.items()}

    # HF's Conv1D stores [in, out]: the linears come back transposed, embeddings as they are.
    c_attn = "transformer.h.1.attn.c_attn.weight"
    assert torch.equal(src.read(c_attn), torch.from_numpy(tensors["blk.1.attn_qkv.weight"]).T)
    assert torch.equal(src.read(c_attn, (slice(None), slice(64, 128))), src.read(c_attn)[:, 64:128])
    assert torch.equal(src.read("transformer.h.0.mlp.c_proj.weight"),
                       torch.from_numpy(tensors["blk.0.ffn_down.weight"]).T)
    assert torch.equal(src.read("transformer.wpe.weight"), torch.from_numpy(tensors["position_embd.weight"]))


def test_gpt2_equals_transformers_loader(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # 1024 positions: transformers maps context_length only to n_ctx, so wpe keeps its default size.
    write_tiny_gpt2(tmp_path / "gpt2.gguf", n_pos=1024, untied=True)
    src = GGUFSource(tmp_path / "gpt2.gguf")
    state = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="gpt2.gguf", dtype=torch.float32).state_dict()
    assert set(src.keys()) == set(state) and src.hf_config()["tie_word_embeddings"] is False
    for key in src.keys():
        assert torch.equal(src.read(key), state[key]), key


# ----------------------------------------------------------------------------- rope metadata


def test_linear_rope_scaling(tmp_path: Path) -> None:
    w = GGUFWriter(tmp_path / "linear.gguf", "llama")
    add_llama_meta(w)
    w.add_rope_scaling_type(RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)
    finish(w)
    config = GGUFSource(tmp_path / "linear.gguf").hf_config()
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# head_dim 64/128: several frequencies in the blend band (fitted); 16: one; 6: none.
@pytest.mark.parametrize(("factor", "head_dim"), [(8.0, 128), (32.0, 64), (8.0, 16), (8.0, 6)])
def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path: Path, factor: float, head_dim: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors, computed like this.
    theta, low, high, old_ctx = 500000.0, 1.0, 4.0, 8192
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    divisors = []
    for wavelen in 2 * np.pi / inv_freq:
        smooth = (old_ctx / wavelen - low) / (high - low)
        divisors.append(1.0 if wavelen < old_ctx / high else factor if wavelen > old_ctx / low
                        else 1 / ((1 - smooth) / factor + smooth))
    w = GGUFWriter(tmp_path / "llama3.gguf", "llama")
    add_llama_meta(w, context=131072, hidden=2 * head_dim, heads=2)
    w.add_rope_freq_base(theta)
    w.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
    finish(w)
    src = GGUFSource(tmp_path / "llama3.gguf")
    assert "rope_freqs.weight" not in set(src.keys())
    config = src.hf_config()
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_scaling"]["factor"] == factor
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**config), "cpu")
    np.testing.assert_allclose(hf_inv_freq.numpy(), inv_freq / np.array(divisors), rtol=1e-5)


# ----------------------------------------------------------------------------- bad input


def test_truncated_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, Q.Q8_0)
    data = path.read_bytes()
    for cut in (3, 40, 300, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=str(bad)):
            GGUFSource(bad)


def test_not_a_gguf_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(CheckpointError, match="junk.gguf"):
        GGUFSource(tmp_path / "junk.gguf")
    with pytest.raises(CheckpointError, match="nope.gguf"):
        GGUFSource(tmp_path / "nope.gguf")


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    w = GGUFWriter(tmp_path / "bert.gguf", "bert")
    finish(w)
    with pytest.raises(CheckpointError, match=r"'bert'.*llama.*mistral.*qwen2.*gpt2"):
        GGUFSource(tmp_path / "bert.gguf")


def test_unknown_tensor_is_an_error(tmp_path: Path) -> None:
    w = GGUFWriter(tmp_path / "extra.gguf", "llama")
    w.add_tensor("blk.0.attn_q_norm.weight", np.ones(HEAD_DIM, dtype=np.float32))
    finish(w)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q_norm\.weight"):
        GGUFSource(tmp_path / "extra.gguf")


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "tiny.gguf", Q.F32)
    src = GGUFSource(tmp_path / "tiny.gguf")
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        src.read("lm_head.weight")


def test_open_source_picks_the_gguf_in_a_directory(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "tiny.gguf", Q.F16)
    src = open_source(tmp_path)
    assert isinstance(src, GGUFSource) and src.path == tmp_path / "tiny.gguf"
