"""GGUF files of the 2025-26 families, written by llama.cpp's own converter (convert_hf_to_gguf.py),
load in kiln and compute what Hugging Face computes.

Each case is a tiny random HF model (GPT-2's 50,257-token vocabulary where the converter needs a
real tokenizer, 256 tokens for the llama-style ones), converted to an f32 GGUF by llama.cpp and
then by kiln (float32): the GGUF reads back as the HF checkpoint tensor for tensor, kiln's float32
logits of two prompts packed in one step equal HF's (1e-4 of the logit scale) and 8 greedy tokens
equal HF's. Where a GGUF leaves a setting out, llama.cpp's rule decides it, so each model is built
where HF and llama.cpp agree: Gemma 3 with 6 layers in its default pattern and
``query_pre_attn_scalar`` = head size, SmolLM3 NoPE every 4th layer without a window, EXAONE 4
without a window (llama.cpp's hybrid attention is the 64-layer model's only), Qwen3-MoE with no
dense layer and renormalised top-k, DeepSeek-V2 with YaRN's mscale equal to its mscale_all_dim
(llama.cpp's deepseek2 graph takes them equal) and greedy routing, Gemma 4 (E2B-like: per-layer
inputs, KV sharing, values from keys, per-layer head sizes and KV heads, double-wide MLPs; and
26B-A4B-like with experts) with its KV-shared layers' sources where llama.cpp and transformers
agree (the last non-shared layer full, the one before sliding). One OLMo 2 file converted to
q8_0 keeps its linears' blocks (MIXED_PRECISION) and stays within 5% of the dequantized engine,
and so does a DeepSeek-V2 file quantized to q8_0. A DeepSeek-V2 file with kv_b_proj whole (older
converters) reads as the split one. Metadata-only files check the rules on shapes no tiny model
has, and that metadata kiln does not know is refused.

The converters need real tokenizers: GPT-2's for most architectures (Phi-4-mini's tokenizer class
says GPT2Tokenizer; GLM-4 adds ``<|user|>``), a small Llama-2 style BPE for the llama-style ones, a
sentencepiece model for ERNIE 4.5 (built without biases: llama.cpp's ernie4_5 loads no MLP biases);
Gemma 4's writes the tokenizer's tokens only and keeps only their embedding rows, so its models
have exactly the Llama-2 style tokenizer's 400 tokens.

Hybrid models: LFM2 (short convolutions), Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet, converted with
``--no-mtp``), whose value heads the converter stores tiled (read back against the HF tensors put
in that order); a Qwen3.5 file as q8_0 keeps its blocks; a Qwen3.5 file keeping the MTP layer
added to its directory runs it as speculative decoding's draft. Qwen3-Next (qwen3next, without
dense layers, which llama.cpp's qwen3next cannot hold) reads back against the HF tensors with
in_proj_qkvz split as the converter splits it; its q8_0 file keeps its blocks, and so does one
holding in_proj_qkvz whole (older converters' ssm_in); its MTP file runs as Qwen3.5's does.
Mamba2 hybrids: Granite 4 (granitehybrid; dense NoPE as released, and with experts in two groups)
and Nemotron-H (nemotron_h; nemotron_h_moe with latent experts, whose q8_0 file keeps the experts'
blocks), read back against the tensors their directories hold (transformers renames some in memory).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize
from safetensors import safe_open
from safetensors.torch import load_file

from kiln.checkpoint.gguf_source import GGUFSource, _Reader
from kiln.errors import CheckpointError
from tests.conftest import convert_and_build
from tests.models.zoo import random_prompt
from tests.utils import tiny_family_models as tiny
from tests.utils import tiny_hybrid_models as hybrid
from tests.utils.compare import assert_logits_close, hf_greedy, kiln_batch_prompt_logits, kiln_greedy
from tests.utils.llama_cpp_gguf import (GPT2_VOCAB, convert_many_with_llama_cpp, save_converter_tokenizer,
                                        save_sentencepiece_tokenizer)
from tests.utils.tiny_gguf import copy_metadata, finish, requantize
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_moe_models import make_deepseek_v2, make_gpt_oss, make_qwen3_moe

V = GPT2_VOCAB
GEMMA4_VOCAB = 400  # a size the Llama-2 style BPE fills exactly (its 256 byte tokens and 144 pieces)
NEW_TOKENS = 8
# DeepSeek-V2-Lite-Chat's YaRN (mscale = mscale_all_dim = 0.707) on a 64-token original context.
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                 "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}


def _gpt2(hf_dir: Path, gpt2: Path) -> None:
    """GPT-2's tokenizer (built once in ``gpt2``), which the converter takes for any architecture."""
    for file in gpt2.iterdir():
        shutil.copy(file, hf_dir)


def _llama(hf_dir: Path, gpt2: Path) -> None:
    """A small Llama-2 style BPE, which the llama-style converters take without a hash."""
    save_converter_tokenizer(hf_dir, 256)


def _phi4(hf_dir: Path, gpt2: Path) -> None:
    """Phi-4-mini's tokenizer is a GPT2Tokenizer, which its converter reads as GPT-2 BPE."""
    _gpt2(hf_dir, gpt2)
    config = hf_dir / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "GPT2Tokenizer"}))


def _glm4(hf_dir: Path, gpt2: Path) -> None:
    """GLM-4's converter looks up its end-of-turn token, <|user|> (one token past GPT-2's)."""
    from transformers import AutoTokenizer

    _gpt2(hf_dir, gpt2)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
    tokenizer.save_pretrained(hf_dir)


def _llama_exact(hf_dir: Path, gpt2: Path) -> None:
    """The Llama-2 style BPE with exactly the model's vocabulary (Gemma 4's converter pads no
    tokens and cuts the embedding to the tokenizer's)."""
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    assert save_converter_tokenizer(hf_dir, vocab) == vocab


def _gpt2_for_qwen3_5_moe(hf_dir: Path, gpt2: Path) -> None:
    """GPT-2's tokenizer under a config whose model_type the converter's AutoTokenizer maps to no
    tokenizer class: transformers maps qwen3_5_moe_text to Qwen3_5Tokenizer, which splits digits
    and so gives GPT-2's vocabulary a pre-tokenizer hash the converter does not know. (The
    converter picks its class by ``architectures`` and reads the MoE fields all the same.)"""
    _gpt2(hf_dir, gpt2)
    config = hf_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "qwen3_5_text"}))


def _gpt2_for_nemotron_h(hf_dir: Path, gpt2: Path) -> None:
    """GPT-2's tokenizer under a config.json without ``model_type``: the converter then reads the
    file as released (transformers 5's NemotronHConfig adds expert fields to every config, which
    make the converter write a dense model as nemotron_h_moe)."""
    _gpt2(hf_dir, gpt2)
    config = hf_dir / "config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "model_type"}))


def _sentencepiece(hf_dir: Path, gpt2: Path) -> None:
    """ERNIE 4.5's converter reads only a sentencepiece tokenizer.model."""
    save_sentencepiece_tokenizer(hf_dir, 256)


# name -> (maker, its keyword arguments, the tokenizer its converter takes)
CASES: dict[str, tuple[Callable, dict, Callable]] = {
    "qwen3": (make_llama, dict(model_type="qwen3", vocab=V), _gpt2),
    "qwen3moe": (make_qwen3_moe, dict(vocab=V, layers=2, mlp_only_layers=[]), _gpt2),
    "gpt-oss": (make_gpt_oss, dict(vocab=V, intermediate=64, truncate=True), _gpt2),
    # V2-Lite's direct q_proj; V2's low-rank q with YaRN
    "deepseek2": (make_deepseek_v2, dict(vocab=V), _gpt2),
    "deepseek2-q-lora-yarn": (make_deepseek_v2, dict(vocab=V, q_lora_rank=48, rope_parameters=DEEPSEEK_YARN, seed=1),
                              _gpt2),
    "gemma3": (tiny.make_gemma3, dict(vocab=V, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16), _gpt2),
    "olmo2": (tiny.make_olmo2, dict(vocab=V), _gpt2),
    "olmo3": (tiny.make_olmo3, dict(vocab=V), _gpt2),
    "smollm3": (tiny.make_smollm3, dict(no_rope_layer_interval=4, use_sliding_window=False, sliding_window=None),
                _llama),
    "granite": (tiny.make_granite, {}, _llama),
    "exaone4": (tiny.make_exaone4, dict(vocab=V, sliding_window=None, layer_types=["full_attention"] * 4), _gpt2),
    "seed-oss": (tiny.make_seed_oss, dict(vocab=V), _gpt2),
    "ernie4.5": (tiny.make_ernie4_5, dict(use_bias=False), _sentencepiece),  # llama.cpp loads no MLP biases
    "glm4": (tiny.make_glm4, dict(vocab=V + 1), _glm4),
    "phi4-mini": (tiny.make_phi4_mini, dict(vocab=V), _phi4),
    "gemma4": (tiny.make_gemma4, dict(vocab=GEMMA4_VOCAB, vocab_size_per_layer_input=GEMMA4_VOCAB), _llama_exact),
    "gemma4-moe": (tiny.make_gemma4, dict(vocab=GEMMA4_VOCAB, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                                          use_double_wide_mlp=False, enable_moe_block=True, num_experts=4,
                                          top_k_experts=2, moe_intermediate_size=32), _llama_exact),
    "lfm2": (hybrid.make_lfm2, dict(vocab=V), _gpt2),
    "qwen3.5": (hybrid.make_qwen3_5, dict(vocab=V), _gpt2),  # 2 key heads, 4 value heads: stored tiled
    "qwen3.5-moe": (hybrid.make_qwen3_5_moe, dict(vocab=V), _gpt2_for_qwen3_5_moe),
    # (llama.cpp's qwen3next has no dense layers)
    "qwen3-next": (hybrid.make_qwen3_next, dict(vocab=V, mlp_only_layers=[]), _gpt2),
    "granite-hybrid": (hybrid.make_granite_hybrid, dict(vocab=V), _gpt2),
    "granite-hybrid-moe": (hybrid.make_granite_hybrid, dict(vocab=V, num_local_experts=4, mamba_n_groups=2), _gpt2),
    "nemotron-h": (hybrid.make_nemotron_h, dict(vocab=V), _gpt2_for_nemotron_h),
    # Nemotron 3's expert layers, in a latent width (Super's shape)
    "nemotron-h-moe": (hybrid.make_nemotron_h, dict(vocab=V, pattern="ME*E", moe_latent_size=32), _gpt2_for_nemotron_h),
}
# read back against their files' names, not memory's
SAVED_NAMES = ("granite-hybrid-moe", "nemotron-h", "nemotron-h-moe")
# (the tiny models have no MTP layers)
CONVERTER_OPTIONS = {"qwen3.5": ["--no-mtp"], "qwen3.5-moe": ["--no-mtp"], "qwen3-next": ["--no-mtp"]}
WITH_TOKENIZER = "smollm3"  # kiln saves its tokenizer (transformers reads no smollm3 config); the others skip it


@dataclass
class Case:
    hf: object
    hf_dir: Path
    gguf: Path
    engine: Path


def _vocab(hf) -> int:
    return hf.config.vocab_size


@pytest.fixture(scope="module")
def no_tokenizer():
    """GGUFSource.save_tokenizer as a no-op (the engines run on token ids; a 50k-token tokenizer
    takes seconds to rebuild), but for ``WITH_TOKENIZER``."""
    real = GGUFSource.save_tokenizer

    def save(self, out):
        if self.arch == WITH_TOKENIZER:
            real(self, out)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GGUFSource, "save_tokenizer", save)
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[object, Path, Path]]:
    """name -> (HF model, its directory, its f32 GGUF), and "olmo2-q8_0" -> (None, None, a q8_0
    GGUF of the olmo2 model): every model made, then converted in one converter process."""
    gpt2 = tmp_path_factory.mktemp("gpt2-tokenizer")
    save_converter_tokenizer(gpt2, V)  # built once, copied into each directory that needs it
    made, jobs = {}, []
    for name, (make, kwargs, tokenizer) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        hf = make(root / "hf", **kwargs)
        tokenizer(root / "hf", gpt2)
        made[name] = (hf, root / "hf", root / f"{name}-f32.gguf")
        jobs.append((root / "hf", root / f"{name}-f32.gguf", "f32", *CONVERTER_OPTIONS.get(name, [])))
    q8 = made["olmo2"][2].with_name("olmo2-q8_0.gguf")
    q8_0 = {name: made[name][2].with_name(f"{name}-q8_0.gguf") for name in ("qwen3.5", "qwen3-next")}
    # Qwen3.5 and Qwen3-Next with a multi-token-prediction layer, kept in the file (the converter's default).
    mtp = {name: (hybrid.add_mtp_layer(made[name][1], made[name][0]), made[name][1],
                  made[name][2].with_name(f"{name}-mtp-f32.gguf")) for name in ("qwen3.5", "qwen3-next")}
    # (first: the converter's --no-mtp stays set on its model class for the later jobs of the process)
    convert_many_with_llama_cpp([*((hf_dir, gguf, "f32") for _, hf_dir, gguf in mtp.values()), *jobs,
                                 (made["olmo2"][1], q8, "q8_0"),
                                 *((made[name][1], out, "q8_0", *CONVERTER_OPTIONS[name]) for name, out in q8_0.items())])
    return {**made, "olmo2-q8_0": (None, None, q8), **{f"{name}-q8_0": (None, None, out) for name, out in q8_0.items()},
            **{f"{name}-mtp": made_mtp for name, made_mtp in mtp.items()}}


@pytest.fixture(scope="module")
def converted(files, tmp_path_factory, no_tokenizer) -> Callable[[str], Case]:
    """name -> its Case, the GGUF converted and built by kiln (float32) on first use."""
    cache: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cache:
            hf, hf_dir, gguf = files[name]
            engine = convert_and_build(gguf, tmp_path_factory.mktemp(f"{name}-kiln"), {}, dtype="float32")
            cache[name] = Case(hf, hf_dir, gguf, engine)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_reads_back_as_the_hf_checkpoint(converted, name: str) -> None:
    """HF names, shapes and values (q/k rows un-permuted, Gemma 3's norms less 1, experts each
    projection stacked, DeepSeek-V2's kv_b_proj joined from attn_k_b and attn_v_b)."""
    case = converted(name)
    source = GGUFSource(case.gguf)
    state = (load_file(case.hf_dir / "model.safetensors") if name in SAVED_NAMES
             else _per_projection_experts(case.hf.state_dict()))
    if case.hf.config.tie_word_embeddings:
        del state["lm_head.weight"]  # llama.cpp writes no output tensor for a tied head
    if name.startswith("qwen3.5"):
        state = _tiled_value_heads(state, case.hf.config)
    if name == "qwen3-next":
        state = _split_qkvz(state, case.hf.config)
    if name.startswith("granite"):
        state = _granite_split(state)
    if name == "nemotron-h-moe":
        state = _stacked_experts(state)
    assert sorted(source.keys()) == sorted(state)
    # Stored as 1 + w (and Qwen3.5's and Mamba2's A_log as -exp(A_log)) in float32
    atol = 1e-6 if name in ("gemma3", "qwen3.5", "qwen3.5-moe", "qwen3-next", "granite-hybrid", *SAVED_NAMES) else 0.0
    for key, want in state.items():
        torch.testing.assert_close(source.read(key), want, rtol=0, atol=atol, msg=key)


def _granite_split(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Granite 4's fused ``input_linear`` tensors as the GGUF file's separate projections: the
    shared MLP's gate / up / down under ``shared_mlp``, the experts' stacked under ``mlp.experts``
    with the router as ``mlp.gate`` (llama.cpp's converter splits the halves)."""
    out = {}
    for key, tensor in state.items():
        stem, _, _ = key.rpartition(".")
        layer, _, rest = stem.partition(".shared_mlp.") if ".shared_mlp." in stem else stem.partition(".block_sparse_moe.")
        if rest == "input_linear":
            prefix = f"{layer}.shared_mlp" if ".shared_mlp." in key else f"{layer}.mlp.experts"
            out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = tensor.chunk(2, dim=-2)
        elif rest == "output_linear":
            prefix = f"{layer}.shared_mlp" if ".shared_mlp." in key else f"{layer}.mlp.experts"
            out[f"{prefix}.down_proj.weight"] = tensor
        elif rest == "router.layer":
            out[f"{layer}.mlp.gate.weight"] = tensor
        else:
            out[key] = tensor
    return out


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Nemotron-H's experts as its files hold them (``mixer.experts.{e}.up_proj.weight``) stacked
    as the GGUF file's read (``mixer.experts.up_proj.weight``, ``[experts, out, in]``)."""
    out, stacks = {}, {}
    for key, tensor in state.items():
        layer, sep, rest = key.partition(".mixer.experts.")
        if not sep:
            out[key] = tensor
            continue
        expert, _, name = rest.partition(".")
        stacks.setdefault(f"{layer}.mixer.experts.{name}", {})[int(expert)] = tensor
    return {**out, **{key: torch.stack([by[e] for e in sorted(by)]) for key, by in stacks.items()}}


def _tiled_value_heads(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Qwen3.5's Gated DeltaNet tensors with their value heads in llama.cpp's order: tiled (v0 of
    every key head, then v1, ...) rather than grouped by key head."""
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    qk = 2 * keys * config.linear_key_head_dim

    def tiled(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
        return t.unflatten(dim, (keys, values // keys, width)).transpose(dim, dim + 1).flatten(dim, dim + 2)

    out = {}
    for key, t in state.items():
        width = config.linear_value_head_dim
        if key.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            t = torch.cat([t[:qk], tiled(t[qk:], 0, width)])
        elif key.endswith("in_proj_z.weight"):
            t = tiled(t, 0, width)
        elif key.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            t = tiled(t, 0, 1)
        elif key.endswith("linear_attn.out_proj.weight"):
            t = tiled(t, 1, width)
        out[key] = t
    return out


def _qkvz_parts(qkvz: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: its q, k, v and z rows) as the converter splits
    it: all q, all k, all v rows (Qwen3.5's ``in_proj_qkv``), then all z rows (``in_proj_z``)."""
    key = config.linear_key_head_dim
    value = config.linear_num_value_heads // config.linear_num_key_heads * config.linear_value_head_dim
    q, k, v, z = qkvz.unflatten(0, (config.linear_num_key_heads, -1)).split([key, key, value, value], dim=1)
    return torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)]), z.flatten(0, 1)


def _split_qkvz(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Qwen3-Next's state with ``in_proj_qkvz`` split as in llama.cpp's qwen3next files."""
    out = {}
    for key, t in state.items():
        if key.endswith("in_proj_qkvz.weight"):
            stem = key[:-len("in_proj_qkvz.weight")]
            out[f"{stem}in_proj_qkv.weight"], out[f"{stem}in_proj_z.weight"] = _qkvz_parts(t, config)
        else:
            out[key] = t
    return out


def _per_projection_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused experts under an ``mlp`` block as GGUF's stacked projections:
    ``gate_up_proj`` gate rows then up rows (Qwen3-MoE), or gpt-oss's ``[E, in, out]`` with gate
    and up columns alternating. (Gemma 4's, directly under the layer, stay fused in its GGUF.)"""
    gpt_oss = any(k.endswith(".gate_up_proj_bias") for k in state)
    out = {}
    for key, tensor in state.items():
        stem, _, name = key.rpartition(".")
        if ".mlp.experts." not in key:
            out[key] = tensor
        elif name == "gate_up_proj":
            gate, up = (tensor[..., 0::2].transpose(1, 2), tensor[..., 1::2].transpose(1, 2)) if gpt_oss \
                else tensor.chunk(2, dim=1)
            out[f"{stem}.gate_proj.weight"], out[f"{stem}.up_proj.weight"] = gate, up
        elif name == "gate_up_proj_bias":
            out[f"{stem}.gate_proj.bias"], out[f"{stem}.up_proj.bias"] = tensor[:, 0::2], tensor[:, 1::2]
        elif name == "down_proj":
            out[f"{key}.weight"] = tensor.transpose(1, 2) if gpt_oss else tensor
        elif name == "down_proj_bias":
            out[f"{stem}.down_proj.bias"] = tensor
        else:
            out[key] = tensor
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_equal_hf(converted, name: str) -> None:
    case = converted(name)
    prompts = [random_prompt(24, _vocab(case.hf), seed=1), random_prompt(9, _vocab(case.hf), seed=2)]
    for prompt, logits in zip(prompts, kiln_batch_prompt_logits(case.engine, prompts)):
        with torch.no_grad():
            ref = case.hf(torch.tensor([prompt])).logits[0].float()
        assert_logits_close(logits, ref)
    assert kiln_greedy(case.engine, prompts, NEW_TOKENS) == hf_greedy(case.hf, prompts, NEW_TOKENS)


def test_tokenizer_of_an_architecture_transformers_does_not_read(converted) -> None:
    from transformers import AutoTokenizer

    from kiln.tokenizer import hf_tokenizer

    case = converted(WITH_TOKENIZER)
    text = "The quick brown fox jumps over the lazy dog."
    ours = hf_tokenizer(case.engine.parent / "checkpoint")
    theirs = AutoTokenizer.from_pretrained(case.hf_dir)
    ids = theirs(text, add_special_tokens=False).input_ids
    assert ours(text, add_special_tokens=False).input_ids == ids and ours.decode(ids) == theirs.decode(ids)


def test_q8_0_linears_keep_their_precision(files, no_tokenizer, tmp_path: Path) -> None:
    """OLMo 2 (q/k not permuted, whole-projection q/k norms) as q8_0: each linear imports its
    blocks (W8A16, a scale per 32 weights); logits within 5% of the same file dequantized."""
    q8 = files["olmo2-q8_0"][2]
    native = convert_and_build(q8, tmp_path / "native", {}, dtype=None)
    dequantized = convert_and_build(q8, tmp_path / "float", {}, dtype="float32")
    quant = json.loads((tmp_path / "native" / "checkpoint" / "config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION"
    linears = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
    assert set(quant["quantized_layers"]) == {f"transformer.layers.{i}.{n}" for i in range(2) for n in linears}
    assert {(q["quant_algo"], q["group_size"]) for q in quant["quantized_layers"].values()} == {("W8A16", 32)}
    prompts = [random_prompt(24, V, seed=1), random_prompt(9, V, seed=2)]
    for ours, ref in zip(kiln_batch_prompt_logits(native, prompts), kiln_batch_prompt_logits(dequantized, prompts)):
        assert (ours.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_qwen3_5_q8_0_keeps_its_blocks(files, no_tokenizer, tmp_path: Path) -> None:
    """Qwen3.5 as llama.cpp's q8_0: the Gated DeltaNet projections (in_proj_qkv, in_proj_z,
    out_proj), attention and MLP linears import their blocks (in_proj_a / in_proj_b, 4 rows: no
    whole tile, dequantized); logits within 5% of the same file dequantized."""
    q8 = files["qwen3.5-q8_0"][2]
    native = convert_and_build(q8, tmp_path / "native", {}, dtype=None)
    dequantized = convert_and_build(q8, tmp_path / "float", {}, dtype="float32")
    quant = json.loads((tmp_path / "native" / "checkpoint" / "config.json").read_text())["quantization"]
    mlp = ("mlp.fc", "mlp.gate", "mlp.proj")
    recurrent = ("mixer.in_proj_qkv", "mixer.in_proj_z", "mixer.out_proj", *mlp)
    assert set(quant["quantized_layers"]) == {f"transformer.layers.{i}.{n}" for i in range(4) for n in
                                              (("attention.qkv", "attention.dense", *mlp) if i == 3 else recurrent)}
    prompts = [random_prompt(24, V, seed=1), random_prompt(9, V, seed=2)]
    for ours, ref in zip(kiln_batch_prompt_logits(native, prompts), kiln_batch_prompt_logits(dequantized, prompts)):
        assert (ours.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def _whole_qkvz(src: Path, dst: Path, state: dict[str, torch.Tensor], keep_split: bool = False) -> Path:
    """``src`` (qwen3next) as older converters wrote it: each layer's in_proj_qkvz whole (``ssm_in``,
    from the HF ``state``, in attn_qkv's type) instead of attn_qkv and attn_gate (with
    ``keep_split``, beside them); no vocabulary lists."""
    reader = _Reader(src)
    w = GGUFWriter(dst, "qwen3next")
    copy_metadata(reader, w, skip=("tokenizer.ggml.t", "tokenizer.ggml.m"))
    for t in reader.tensors:
        if t.name.endswith(".attn_qkv.weight"):
            layer = t.name.split(".")[1]
            qkvz = state[f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"].numpy()
            w.add_tensor(f"blk.{layer}.ssm_in.weight", quantize(qkvz, t.tensor_type), raw_dtype=t.tensor_type)
        if keep_split or not t.name.endswith((".attn_qkv.weight", ".attn_gate.weight")):
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    finish(w)
    return dst


def test_qwen3_next_q8_0_keeps_its_blocks(files, no_tokenizer, tmp_path: Path) -> None:
    """Qwen3-Next as llama.cpp's q8_0: in_proj_qkv and in_proj_z (the converter's attn_qkv and
    attn_gate), out_proj, attention, the experts and the shared expert's gate and up import their
    blocks (in_proj_b / in_proj_a, 4 rows each of ssm_ba: no whole tile; the shared expert's
    48-wide down, left F16), logits within 5% of the same file dequantized. A file holding
    in_proj_qkvz whole (older converters' ssm_in, here quantized from HF's tensor) imports the same
    blocks, each projection picking its rows of ssm_in's, and computes the same logits."""
    q8 = files["qwen3-next-q8_0"][2]
    whole = _whole_qkvz(q8, tmp_path / "whole.gguf", files["qwen3-next"][0].state_dict())
    engines = [convert_and_build(q8, tmp_path / "split", {}, dtype=None),
               convert_and_build(whole, tmp_path / "whole", {}, dtype=None),
               convert_and_build(q8, tmp_path / "float", {}, dtype="float32")]
    moe = ("mlp.fc", "mlp.gate", "mlp.proj", "mlp.shared_expert.fc", "mlp.shared_expert.gate")
    recurrent = ("mixer.in_proj_qkv", "mixer.in_proj_z", "mixer.out_proj", *moe)
    want = {f"transformer.layers.{i}.{n}" for i in range(4)
            for n in (("attention.qkv", "attention.dense", *moe) if i == 3 else recurrent)}
    for kind in ("split", "whole"):
        quant = json.loads((tmp_path / kind / "checkpoint" / "config.json").read_text())["quantization"]
        assert set(quant["quantized_layers"]) == want, kind
    prompts = [random_prompt(24, V, seed=1), random_prompt(9, V, seed=2)]
    for split, whole, ref in zip(*(kiln_batch_prompt_logits(e, prompts) for e in engines)):
        assert (split.float() - ref).abs().max() <= 0.05 * ref.abs().max()
        torch.testing.assert_close(whole, split, rtol=0, atol=0)


def test_qwen3_next_with_in_proj_qkvz_both_whole_and_split_is_refused(files, tmp_path: Path) -> None:
    path = _whole_qkvz(files["qwen3-next"][2], tmp_path / "both.gguf", files["qwen3-next"][0].state_dict(),
                       keep_split=True)
    with pytest.raises(CheckpointError, match="both ssm_in"):
        GGUFSource(path).hf_config()


def test_granite_hybrid_q8_0_keeps_its_blocks(files, no_tokenizer, tmp_path: Path) -> None:
    """Granite 4 with experts as q8_0 (quantized from the f32 file): the shared MLP's gate and up
    halves and the stacked experts import their blocks (the converter splits Granite's fused
    input_linear; read as separate projections, each keeps its blocks); logits within 5% of the
    same file dequantized."""
    stems = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    q8 = requantize(files["granite-hybrid-moe"][2], tmp_path / "granite-q8_0.gguf", dict.fromkeys(stems, Q.Q8_0))
    native = convert_and_build(q8, tmp_path / "native", {}, dtype=None)
    dequantized = convert_and_build(q8, tmp_path / "float", {}, dtype="float32")
    quant = json.loads((tmp_path / "native" / "checkpoint" / "config.json").read_text())["quantization"]
    layers = files["granite-hybrid-moe"][0].config.num_hidden_layers
    assert set(quant["quantized_layers"]) == {f"transformer.layers.{i}.mlp.{n}" for i in range(layers)
                                              for n in ("fc", "gate", "proj", "shared_expert.fc", "shared_expert.gate")}
    prompts = [random_prompt(24, V, seed=1), random_prompt(9, V, seed=2)]
    for ours, ref in zip(kiln_batch_prompt_logits(native, prompts), kiln_batch_prompt_logits(dequantized, prompts)):
        assert (ours.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_deepseek2_q8_0_keeps_its_blocks(files, no_tokenizer, tmp_path: Path) -> None:
    """DeepSeek-V2-Lite as q8_0 (quantized from the f32 file; attn_k_b's 16-wide rows stay f32, as
    llama.cpp leaves rows that are no whole block): o_proj, the dense MLP, the experts and the
    shared expert import their blocks, and so does q_proj (its rotary rows reordered whole on
    loading; kv_a_proj_with_mqa would too, but its 40 rows are no whole 16-row tiles);
    kv_b_proj (joined from attn_k_b and a q8_0 attn_v_b) is dequantized; logits within 5% of
    the same file dequantized."""
    stems = ("attn_q", "attn_kv_a_mqa", "attn_v_b", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps",
             "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
    q8 = requantize(files["deepseek2"][2], tmp_path / "deepseek2-q8_0.gguf", dict.fromkeys(stems, Q.Q8_0))
    native = convert_and_build(q8, tmp_path / "native", {}, dtype=None)
    dequantized = convert_and_build(q8, tmp_path / "float", {}, dtype="float32")
    quant = json.loads((tmp_path / "native" / "checkpoint" / "config.json").read_text())["quantization"]
    mlp = ("mlp.fc", "mlp.gate", "mlp.proj")
    shared = ("mlp.shared_expert.fc", "mlp.shared_expert.gate", "mlp.shared_expert.proj")
    assert set(quant["quantized_layers"]) == {f"transformer.layers.{i}.{n}" for i, names in
                                              enumerate([mlp, (*mlp, *shared)])
                                              for n in ("attention.dense", "attention.q_proj", *names)}
    prompts = [random_prompt(24, V, seed=1), random_prompt(9, V, seed=2)]
    for ours, ref in zip(kiln_batch_prompt_logits(native, prompts), kiln_batch_prompt_logits(dequantized, prompts)):
        assert (ours.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_gpt_oss_mxfp4_experts_keep_their_precision(files, no_tokenizer, tmp_path: Path) -> None:
    """gpt-oss's GGUF as released, its experts MXFP4 (here quantized from the f32 file): each
    expert imports its blocks exactly (4-bit E2M1 codes under 2^(e - 128) scales). The native
    engine (bf16) stays as close to the file's float32 engine as a bf16 engine of the dequantized
    file does (within twice its error: gpt-oss's clamped experts make bf16 itself err by ~3%).
    (Decode-sized steps read x in int8 blocks, as llama.cpp does, which this tiny model's large
    experts amplify to ~15% of its logits: ``test_mxfp4`` checks that kernel path exactly.)"""
    mxfp4 = requantize(files["gpt-oss"][2], tmp_path / "oss-mxfp4.gguf",
                       dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), Q.MXFP4))
    native = convert_and_build(mxfp4, tmp_path / "native", {}, dtype=None)
    quant = json.loads((tmp_path / "native" / "checkpoint" / "config.json").read_text())["quantization"]
    experts = {n: q for n, q in quant["quantized_layers"].items() if ".mlp." in n}
    assert set(experts) == {f"transformer.layers.{i}.mlp.{p}" for i in range(2) for p in ("fc", "gate", "proj")}
    assert {(q["quant_algo"], q["group_size"], q["has_offset"], q["codebook"]) for q in experts.values()} == {
        ("W4A16", 32, False, "e2m1")}
    fp32, bf16 = (convert_and_build(mxfp4, tmp_path / d, {}, dtype=d) for d in ("float32", "bfloat16"))
    prompts = [random_prompt(24, V, seed=1)]
    for ours, ref, plain in zip(*(kiln_batch_prompt_logits(e, prompts) for e in (native, fp32, bf16))):
        assert (ours.float() - ref).abs().max() <= 2 * (plain.float() - ref).abs().max()
    # the engine holds 4.5 bits a weight of experts, as the file's 4.25
    experts = sum(t.n_bytes for t in GGUFReader(mxfp4).tensors if "_exps.weight" in t.name)
    with safe_open(str(native / "rank0.safetensors"), "pt") as f:
        held = sum(f.get_tensor(k).nbytes for k in f.keys() if ".mlp.fused_fc." in k or ".mlp.proj." in k
                   if not k.endswith(".bias"))
    assert held <= experts * 4.5 / 4.25 + 1


# ----------------------------------------------------------------------------- metadata rules


def _metadata_file(path: Path, arch: str, layers: int, hidden: int = 64, heads: int = 4, **extra) -> Path:
    """A GGUF of ``arch`` with a decoder's metadata and no tensors; ``extra``: key -> value."""
    w = GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(128)
    for key, value in extra.items():
        name = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_string(name, value)
    finish(w)
    return path


def test_gemma3_rules(tmp_path: Path) -> None:
    """llama.cpp's defaults: every 6th layer global, sliding layers at base 10,000 unscaled, scores
    scaled by 1/sqrt(key_length), but by 1/sqrt(hidden / heads) in the 62-layer 27B."""
    meta = {"attention.sliding_window": 512, "attention.key_length": 32, "attention.value_length": 32,
            "rope.freq_base": 1e6, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    config = GGUFSource(_metadata_file(tmp_path / "g.gguf", "gemma3", 12, **meta)).hf_config()
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert config["query_pre_attn_scalar"] == 32 and config["sliding_window"] == 512
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    big = GGUFSource(_metadata_file(tmp_path / "g27.gguf", "gemma3", 62, hidden=5376, heads=32, **meta)).hf_config()
    assert big["query_pre_attn_scalar"] == 168


def test_smollm3_exaone4_and_qwen3moe_rules(tmp_path: Path) -> None:
    smollm3 = GGUFSource(_metadata_file(tmp_path / "s.gguf", "smollm3", 8)).hf_config()
    assert smollm3["no_rope_layers"] == [1, 1, 1, 0] * 2 and not smollm3["use_sliding_window"]
    window = {"attention.sliding_window": 4096}
    small = GGUFSource(_metadata_file(tmp_path / "e4.gguf", "exaone4", 4, **window)).hf_config()
    assert small["sliding_window"] is None  # llama.cpp attends globally, rotary everywhere
    big = GGUFSource(_metadata_file(tmp_path / "e64.gguf", "exaone4", 64, **window)).hf_config()
    assert big["sliding_window"] == 4096 and big["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 16
    experts = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32}
    moe = GGUFSource(_metadata_file(tmp_path / "m.gguf", "qwen3moe", 2, **experts)).hf_config()
    assert moe["norm_topk_prob"] is True and moe["mlp_only_layers"] == [] and moe["moe_intermediate_size"] == 32


# DeepSeek-V2-Lite's metadata as llama.cpp's converter writes it (kv_b split: the *_mla keys a head's sizes).
DEEPSEEK2 = {"attention.kv_lora_rank": 512, "attention.key_length": 576, "attention.value_length": 512,
             "attention.key_length_mla": 192, "attention.value_length_mla": 128, "rope.dimension_count": 64,
             "expert_count": 64, "expert_used_count": 6, "expert_feed_forward_length": 1408, "expert_shared_count": 2,
             "leading_dense_block_count": 1}


def test_deepseek2_rules(tmp_path: Path) -> None:
    """The latent attention's sizes from either form of file; no expert_weights_scale: unscaled;
    YaRN's yarn_log_multiplier is 0.1 x mscale_all_dim, and mscale the same."""
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 4096,
            "rope.scaling.yarn_log_multiplier": 0.0707}
    config = GGUFSource(_metadata_file(tmp_path / "d.gguf", "deepseek2", 27, hidden=2048, heads=16,
                                       **DEEPSEEK2, **yarn)).hf_config()
    assert {k: config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                   "v_head_dim", "first_k_dense_replace", "routed_scaling_factor")} == {
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0}
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                      "mscale": 0.707, "mscale_all_dim": 0.707}
    whole = {**DEEPSEEK2, "attention.key_length": 192, "attention.value_length": 128}
    del whole["attention.key_length_mla"], whole["attention.value_length_mla"]
    older = GGUFSource(_metadata_file(tmp_path / "w.gguf", "deepseek2", 27, hidden=2048, heads=16, **whole,
                                      **yarn)).hf_config()
    assert older == config


def _whole_kv_b(src: Path, dst: Path, state: dict[str, torch.Tensor]) -> Path:
    """``src`` (deepseek2) as older converters wrote it: each layer's kv_b_proj whole (``attn_kv_b``,
    from the HF ``state``), key/value_length a head's, no *_mla keys (and no vocabulary lists)."""
    reader = _Reader(src)  # kiln's: the gguf package's takes seconds over GPT-2's vocabulary
    head = {f"deepseek2.attention.{k}": reader.fields[f"deepseek2.attention.{k}_mla"].contents()
            for k in ("key_length", "value_length")}
    w = GGUFWriter(dst, "deepseek2")
    copy_metadata(reader, w, skip=("tokenizer.ggml.t", "tokenizer.ggml.m"),
                  changes={**head, **{key: None for key in reader.fields if key.endswith("_mla")}})
    for t in reader.tensors:
        if t.name.endswith(".attn_k_b.weight"):
            layer = t.name.split(".")[1]
            kv_b = state[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
            w.add_tensor(f"blk.{layer}.attn_kv_b.weight", kv_b.numpy())
        elif not t.name.endswith(".attn_v_b.weight"):
            w.add_tensor(t.name, np.array(t.data))
    finish(w)
    return dst


def test_deepseek2_whole_kv_b_reads_alike(files, tmp_path: Path) -> None:
    """A deepseek2 file with kv_b_proj whole (older converters) reads as the split one does."""
    hf, _, split = files["deepseek2"]
    whole, split = GGUFSource(_whole_kv_b(split, tmp_path / "whole.gguf", hf.state_dict())), GGUFSource(split)
    assert whole.hf_config() == split.hf_config() and sorted(whole.keys()) == sorted(split.keys())
    for key in split.keys():
        torch.testing.assert_close(whole.read(key), split.read(key), rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(("arch", "extra", "match"), [
    ("qwen3", {"attention.causal": False}, "qwen3.attention.causal"),
    ("qwen3moe", {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
                  "expert_shared_feed_forward_length": 64}, "qwen3moe.expert_shared_feed_forward_length"),
    ("llama", {"rope.scaling.type": "longrope"}, "llama.rope.scaling.type"),
    ("olmo2", {"rope.dimension_count": 8}, "olmo2.rope.dimension_count"),
    ("granite", {"logit_scale": 4.0, "rope.scaling.finetuned": False}, "granite.rope.scaling.finetuned"),
    ("deepseek2", {**DEEPSEEK2, "expert_weights_norm": True}, "deepseek2.expert_weights_norm"),
    ("deepseek2", {**DEEPSEEK2, "expert_gating_func": 2}, "deepseek2.expert_gating_func"),  # sigmoid
    ("deepseek2", {**DEEPSEEK2, "expert_group_count": 8, "expert_group_used_count": 3}, "deepseek2.expert_group_count"),
    ("deepseek2", {**DEEPSEEK2, "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0},
     "deepseek2.rope.scaling.yarn_log_multiplier"),
    ("deepseek2", {**DEEPSEEK2, "attention.temperature_scale": 0.1}, "deepseek2.attention.temperature_scale"),
])
def test_metadata_kiln_does_not_know_is_refused(tmp_path: Path, arch: str, extra: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match.replace(".", r"\.")):
        GGUFSource(_metadata_file(tmp_path / "x.gguf", arch, 2, **extra)).hf_config()




def _rewritten(src: Path, dst: Path, changes: dict) -> Path:
    """``src`` with the metadata ``changes`` (``<arch>.<key>`` -> value, a list for an array; None
    drops the key) and its tensors as they are (no vocabulary lists: the embedding's rows count)."""
    reader = _Reader(src)
    arch = reader.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    copy_metadata(reader, w, skip=("tokenizer.ggml.t", "tokenizer.ggml.s"),
                  changes={f"{arch}.{k}": v for k, v in changes.items()})
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    finish(w)
    return dst


def test_gemma4_reads_llama_cpps_per_layer_metadata(files) -> None:
    """The converter's per-layer arrays (sliding flags, KV heads, double-wide feed-forward sizes)
    and proportional rotary (rope_freqs) read as the HF config's per-layer head sizes and KV heads,
    KV sharing and values from keys."""
    config = GGUFSource(files["gemma4"][2]).hf_config()
    hf = files["gemma4"][0].config
    assert config["layer_types"] == hf.layer_types and config["head_dim"] == 16
    assert config["per_layer_config"] == {"2": {"head_dim": 32, "num_key_value_heads": 1},
                                          "4": {"head_dim": 32, "num_key_value_heads": 1}}
    assert (config["num_kv_shared_layers"], config["attention_k_eq_v"], config["use_double_wide_mlp"],
            config["intermediate_size"], config["hidden_size_per_layer_input"]) == (2, True, True, 96, 8)
    assert config["rope_parameters"] == hf.rope_parameters
    moe = GGUFSource(files["gemma4-moe"][2]).hf_config()
    assert (moe["enable_moe_block"], moe["num_experts"], moe["top_k_experts"], moe["moe_intermediate_size"]) == (
        True, 4, 2, 32)


@pytest.mark.parametrize(("name", "changes", "match"), [
    # llama.cpp: the last sliding layer's KV is the last non-shared layer's but one (here full)
    ("gemma4", {"attention.shared_kv_layers": 1}, "gemma4.attention.shared_kv_layers"),
    ("gemma4", {"feed_forward_length": [96, 192, 96, 192, 192]}, "gemma4.feed_forward_length"),
    ("gemma4", {"rope.dimension_count_swa": 8}, "gemma4.rope.dimension_count_swa"),
    ("gemma4", {"attention.sliding_window_pattern": [True] * 5}, "gemma4.attention.sliding_window_pattern"),
    ("gemma4-moe", {"expert_gating_func": 2}, "gemma4.expert_gating_func"),  # read by no Gemma 4 graph
])
def test_gemma4_metadata_kiln_cannot_represent_is_refused(files, tmp_path: Path, name: str, changes: dict,
                                                          match: str) -> None:
    path = _rewritten(files[name][2], tmp_path / "x.gguf", changes)
    with pytest.raises(CheckpointError, match=match.replace(".", r"\.")):
        GGUFSource(path).hf_config()


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next"])
def test_mtp_layer_from_the_converters_file(files, no_tokenizer, tmp_path: Path, name: str) -> None:
    """A Qwen3.5 or Qwen3-Next GGUF keeping its MTP layer (llama.cpp's converter without --no-mtp:
    one more block with nextn tensors; Qwen3-Next's with its experts): the model's own layers as
    without it, and speculative decoding's MTP guesses equal the reference built from Hugging
    Face's modules."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.engine_core import EngineCore
    from tests.models.test_mtp import GREEDY, MTP, PROMPTS, reference_guesses

    modules, _, gguf = files[f"{name}-mtp"]
    hf = files[name][0]
    assert GGUFSource(gguf).hf_config()["num_hidden_layers"] == hf.config.num_hidden_layers
    core = EngineCore(Engine(convert_and_build(gguf, tmp_path, {}, dtype="float32")), num_blocks=64,
                      speculative_config=MTP)
    (seq,) = core.add_request(PROMPTS[0], GREEDY, end_id=None).seqs
    core.step()
    count, guesses = core.runner.mtp.drafts[seq.seq_id]
    assert guesses == reference_guesses(hf, modules, seq.token_ids[:count], 2)


def test_delta_net_layers_without_recurrent_layers_follow_the_interval(files, tmp_path: Path) -> None:
    """A file without attention.recurrent_layers (older converters): llama.cpp's rule, every
    full_attention_interval-th layer full attention (4 when absent), the MTP block none of them."""
    path = files["qwen3-next-mtp"][2]
    older = _rewritten(path, tmp_path / "older.gguf", {"attention.recurrent_layers": None,
                                                       "full_attention_interval": None})
    assert GGUFSource(older).hf_config() == GGUFSource(path).hf_config()
    every_2nd = _rewritten(path, tmp_path / "2.gguf", {"attention.recurrent_layers": None, "full_attention_interval": 2})
    assert GGUFSource(every_2nd).hf_config()["layer_types"] == ["linear_attention", "full_attention"] * 2


def test_nemotron_h_moe_q8_0_keeps_its_blocks(files, no_tokenizer, tmp_path: Path) -> None:
    """Nemotron 3 (latent experts) as q8_0 (quantized from the f32 file): the un-gated experts'
    stacked up and down projections and the shared expert's up projection import their blocks
    (its down projection's 48-wide rows hold no whole block); the router and the latent
    projections stay float; logits within 5% of the same file dequantized."""
    q8 = requantize(files["nemotron-h-moe"][2], tmp_path / "nemotron-q8_0.gguf",
                    dict.fromkeys(("ffn_up_exps", "ffn_down_exps", "ffn_up_shexp"), Q.Q8_0))
    native = convert_and_build(q8, tmp_path / "native", {}, dtype=None)
    dequantized = convert_and_build(q8, tmp_path / "float", {}, dtype="float32")
    quant = json.loads((tmp_path / "native" / "checkpoint" / "config.json").read_text())["quantization"]
    assert set(quant["quantized_layers"]) == {f"transformer.layers.{i}.mlp.{n}" for i in (1, 3)
                                              for n in ("fc", "proj", "shared_expert.fc")}
    prompts = [random_prompt(24, V, seed=1), random_prompt(9, V, seed=2)]
    for ours, ref in zip(kiln_batch_prompt_logits(native, prompts), kiln_batch_prompt_logits(dequantized, prompts)):
        assert (ours.float() - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize(("name", "changes", "match"), [
    ("qwen3.5-mtp", {"nextn_predict_layers": 2}, "qwen35.nextn_predict_layers"),  # kiln runs one MTP layer
    ("qwen3.5", {"attention.recurrent_layers": [True, True, True]}, "qwen35.attention.recurrent_layers"),
    ("qwen3-next-mtp", {"nextn_predict_layers": 2}, "qwen3next.nextn_predict_layers"),
    ("qwen3-next-mtp", {"attention.recurrent_layers": [True, True, True, False, True]},
     "qwen3next.attention.recurrent_layers"),  # the MTP block is no Gated DeltaNet layer
    ("qwen3-next", {"attention.recurrent_layers": None, "full_attention_interval": 0},
     "qwen3next.full_attention_interval"),
    ("lfm2", {"attention.head_count_kv": [0, 2, 1, 0]}, "lfm2.attention.head_count_kv"),
    ("granite-hybrid", {"attention.head_count_kv": [1, 2, 0, 0]}, "granitehybrid.attention.head_count_kv"),
    ("nemotron-h", {"feed_forward_length": [0, 96, 0, 96, 96]}, "nemotron_h.attention.head_count_kv"),  # one block
    # a multi-token-prediction block among the layers (the converter's default where a model has one)
    ("nemotron-h-moe", {"nextn_predict_layers": 1}, "nemotron_h_moe.nextn_predict_layers"),
    ("nemotron-h-moe", {"expert_group_count": 2, "expert_group_used_count": None}, "nemotron_h_moe.expert_group_count"),
    ("nemotron-h-moe", {"expert_gating_func": 1}, "nemotron_h_moe.expert_gating_func"),  # its graph: sigmoid always
])
def test_hybrid_metadata_kiln_cannot_represent_is_refused(files, tmp_path: Path, name: str, changes: dict,
                                                          match: str) -> None:
    path = _rewritten(files[name][2], tmp_path / "x.gguf", changes)
    with pytest.raises(CheckpointError, match=match.replace(".", r"\.")):
        GGUFSource(path).hf_config()


def test_qwen3_5_lora_reaches_the_tiled_value_heads(converted) -> None:
    """An adapter trained on the Hugging Face model adapts the GGUF's Gated DeltaNet projections,
    whose value heads llama.cpp stores tiled: each module's rows (and out_proj's columns) are
    taken in the file's order, so the tokens and logits are PEFT's."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.lora_cache import parse_adapter
    from tests.runtime.test_lora_hybrid import CASES as LORA_CASES
    from tests.runtime.test_lora_hybrid import _peft_model
    from tests.runtime.test_lora_runtime import PROMPT, _hf_greedy, _kiln_greedy

    case = converted("qwen3.5")
    assert case.hf.config.linear_num_value_heads > case.hf.config.linear_num_key_heads  # tiled in the file
    model, (weights, config) = _peft_model(case.hf_dir, LORA_CASES["qwen3.5"][2])
    expected_tokens, expected_logits = _hf_greedy(model, PROMPT)
    engine = Engine(case.engine)
    adapter = parse_adapter(weights, config, engine.config, engine.lora_config, "lora")
    ((tokens, logits),) = _kiln_greedy(engine, [PROMPT], [adapter])
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_qwen3_5_dora_normalizes_alike_against_the_gguf(files, tmp_path: Path) -> None:
    """DoRA's magnitudes normalized against the GGUF (value heads tiled) equal those against the
    Hugging Face directory: the base weights are read back in the adapter's order."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kiln.checkpoint.peft import peft_to_lora_modules

    _, hf_dir, gguf = files["qwen3.5"]
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                           LoraConfig(r=2, lora_alpha=4, use_dora=True, init_lora_weights=False,
                                      target_modules=["in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj"]))
    model.save_pretrained(tmp_path / "dora")
    from_hf, from_gguf = (peft_to_lora_modules(tmp_path / "dora", base_model=base) for base in (hf_dir, gguf))
    assert [(m.layer, m.module_id) for m in from_hf] == [(m.layer, m.module_id) for m in from_gguf]
    for ours, theirs in zip(from_gguf, from_hf):
        torch.testing.assert_close(ours.magnitude, theirs.magnitude, rtol=1e-5, atol=1e-6)
