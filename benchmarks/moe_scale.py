"""kiln beside llama.cpp on mixture-of-experts and hybrid models at their real size: Qwen3-30B-A3B's,
gpt-oss-20b's and DeepSeek-V2-Lite's shapes, and Qwen3.5's (9B dense and 35B-A3B, Gated DeltaNet
beside attention: ``hybrid_shapes.py``).

    python benchmarks/moe_scale.py --shape qwen3-30b-a3b --quant q4_0 [--work_dir /tmp/kiln-moe] [--rounds 3]
    python benchmarks/moe_scale.py --shape gpt-oss-20b --quant mxfp4
    python benchmarks/moe_scale.py --shape deepseek-v2-lite --quant q4_0
    python benchmarks/moe_scale.py --shape qwen3.5-9b --quant q4_0 --contexts 8192 32768

The models have the real shapes (Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts of width 768,
8 per token, 32 query and 4 KV heads of 128; gpt-oss-20b: 24 layers, hidden 2880, 32 experts of
width 2880, 4 per token, 64 query and 8 KV heads of 64, biases, attention sinks, a 128-token
window on every other layer, YaRN; DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads of multi-head
latent attention over a 512-wide latent, the first layer dense, then 64 experts of width 1408, 6
per token, and 2 shared) with **random weights** and SmolLM2's tokenizer (49,152
tokens, not the models' own). Each is written once as a GGUF whose quantized blocks are written
directly (random codes under scales that give weights of ~0.02; routers, norms, biases and sinks
float32), typed as llama.cpp's quantizer types a file of that kind: ``q4_0`` (every linear Q4_0,
the head Q6_K), ``q4_k_m`` (Q4_K, with Q6_K for the head and for attn_v / ffn_down_exps on
llama.cpp's "more bits" layers), ``mxfp4`` (gpt-oss as released: experts MXFP4, the other
linears Q8_0) or ``bf16`` (Qwen3.5-9B: every matrix, 18 GB; the MoE shapes' 40-70 GB of bf16 do
not fit 24 GiB). A bf16 Qwen3-30B-A3B (61 GB) would not fit this disk, so no HF directory: kiln
reads the same GGUF, keeping every block at its own precision (experts expert-major), and both
engines compute with the same numbers.

Then, with the same thread count: kiln convert and kiln build (time, peak RSS, engine size beside
the file's); rounds alternating kiln and llama.cpp (llama-cpp-python), a fresh process per engine
and round, each engine's files read into the page cache first (two 17 GB files do not both fit
in 24 GB: without it each round would start part cold): load to first token, peak RSS, prefill of
512 tokens, batch-1 greedy decode, decode after ``--contexts`` tokens of prompt, and the share of
the machine's read bandwidth the decode reaches on the bytes a token reads (attention, routers,
head and ``top_k`` of every layer's experts); kiln's batched decode at 8 and 32 sequences (each
its own random prompt, so tokens spread over the experts) beside llama.cpp's ``llama-batched-bench``
(built with cmake from the llama-cpp-python sdist: ``--batched_bench PATH``; random tokens too) at
the same batch sizes. Medians. Records go to ``--output_json`` (kind "moe_scale");
``python benchmarks/report.py`` puts the newest into benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import scale  # benchmarks/ is on the path: scripts run from it
from converted_shapes import CONVERTED_SHAPES, write_converted_gguf
from hybrid_shapes import HYBRID_SHAPES, hybrid_float_values, hybrid_layer, hybrid_metadata
from kiln.bench.common import append_record, new_record
from kiln.bench.machine import machine_facts
from kiln.examples import smollm2_gguf_path

@dataclass(frozen=True)
class Shape:
    """A mixture-of-experts model's shape, as its GGUF architecture ``arch`` describes it."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head: int
    experts: int
    top_k: int
    width: int  # each expert's intermediate size
    theta: float
    # DeepSeek-V2: shared experts (their total width), leading dense layers (their FFN width), and
    # multi-head latent attention's latent rank and head parts (no-rotary key, rotary, value)
    shared_width: int = 0
    dense_layers: int = 0
    dense_width: int = 0
    kv_lora: int = 0
    nope: int = 0
    rope: int = 0
    value: int = 0


SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 128, 128, 8, 768, 1e6),
    "gpt-oss-20b": Shape("gpt-oss", 2880, 24, 64, 8, 64, 32, 4, 2880, 150000.0),
    "deepseek-v2-lite": Shape("deepseek2", 2048, 27, 16, 16, 192, 64, 6, 1408, 10000.0, shared_width=2816,
                              dense_layers=1, dense_width=10944, kv_lora=512, nope=128, rope=64, value=128),
}
# (bf16: Qwen3.5-9B's 18 GB fit in 24 GiB, one engine's file in the page cache at a time; the MoE
# shapes' 40-70 GB do not)
QUANTS = {"qwen3moe": ("q4_0", "q4_k_m"), "gpt-oss": ("mxfp4",), "deepseek2": ("q4_0",),
          "qwen35": ("q4_0", "q4_k_m", "bf16"),
          "qwen35moe": ("q4_0", "q4_k_m"), "granitehybrid": ("q4_0", "q8_0", "q4_k_m")}
# (hybrid_shapes.py: Qwen3.5's Gated DeltaNet beside attention; converted_shapes.py: Granite 4's
# Mamba2, written by llama.cpp's own converter and quantizer)
ALL_SHAPES = {**SHAPES, **HYBRID_SHAPES, **CONVERTED_SHAPES}
VOCAB = scale.VOCAB  # SmolLM2's tokenizer
BATCHES = scale.BATCHES


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers a K-quant mix gives its larger type."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_types(quant: str, name: str, layer: int, layers: int):
    """The GGUF type llama.cpp's quantizer gives tensor ``name`` (a GGUF stem) for ``quant``."""
    from gguf import GGMLQuantizationType as Q

    if quant == "mxfp4":  # gpt-oss as released: experts MXFP4, every other linear Q8_0
        return Q.MXFP4 if name.endswith("_exps") else Q.Q8_0
    if quant == "bf16":  # convert_hf_to_gguf.py --outtype bf16: every matrix, the head and table too
        return Q.BF16
    if name == "output":
        return Q.Q6_K
    if quant == "q4_0":
        return Q.Q4_0
    if name in ("attn_v", "ffn_down_exps", "ffn_down") and _more_bits(layer, layers):
        return Q.Q6_K
    return Q.Q4_K


# Where each type keeps its float16 scales (byte offset -> magnitude), for weights of ~0.02.
SCALES = {"Q4_0": {0: 5e-3}, "Q8_0": {0: 1.6e-4}, "Q4_K": {0: 1e-4, 2: 3e-4}, "Q6_K": {208: 1e-5}}
MXFP4_EXPONENTS = (120, 122)  # E8M0 bytes of MXFP4 blocks: scales 2^-7 .. 2^-6 (E2M1 values up to 6)


def random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of random ``qtype`` blocks: random codes, scales set to plausible values."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.frombuffer(rng.bytes(rows * (cols // block) * size), dtype=np.uint8).reshape(rows, cols // block, size)
    raw = raw.copy()
    if qtype.name == "MXFP4":
        raw[..., 0] = rng.integers(*MXFP4_EXPONENTS, size=raw.shape[:2], endpoint=True, dtype=np.uint8)
    for at, magnitude in SCALES.get(qtype.name, {}).items():
        halves = (rng.uniform(0.5, 1.0, size=raw.shape[:2]) * magnitude).astype(np.float16)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def gguf_tensors(shape: str, quant: str) -> dict[str, tuple[tuple[int, ...], object]]:
    """GGUF name -> (shape in HF order ``[..., out, in]``, type) of the model."""
    from gguf import GGMLQuantizationType as Q

    m = ALL_SHAPES[shape]
    out = {"token_embd.weight": ((VOCAB, m.hidden), tensor_types(quant, "token_embd", 0, m.layers)),
           "output_norm.weight": ((m.hidden,), Q.F32),
           "output.weight": ((VOCAB, m.hidden), tensor_types(quant, "output", 0, m.layers))}
    gpt_oss = m.arch == "gpt-oss"
    for i in range(getattr(m, "blocks", m.layers)):
        if shape in HYBRID_SHAPES:
            out.update(hybrid_layer(m, i, lambda stem, i=i: tensor_types(quant, stem, i, m.layers), Q.F32))
            continue
        if m.arch == "deepseek2":
            out.update(_deepseek2_layer(m, i, quant))
            continue
        matrices = {"attn_q": (m.heads * m.head, m.hidden), "attn_k": (m.kv_heads * m.head, m.hidden),
                    "attn_v": (m.kv_heads * m.head, m.hidden), "attn_output": (m.hidden, m.heads * m.head),
                    "ffn_gate_exps": (m.experts, m.width, m.hidden), "ffn_up_exps": (m.experts, m.width, m.hidden),
                    "ffn_down_exps": (m.experts, m.hidden, m.width)}
        out.update({f"blk.{i}.{n}.weight": (dims, tensor_types(quant, n, i, m.layers)) for n, dims in matrices.items()})
        vectors = {"attn_norm": (m.hidden,), "ffn_gate_inp": (m.experts, m.hidden)}
        if gpt_oss:  # every projection biased, a sink logit per head, the router biased
            vectors.update({f"{n}.bias": dims[:-1] for n, dims in matrices.items()})
            vectors.update({"post_attention_norm": (m.hidden,), "attn_sinks": (m.heads,),
                            "ffn_gate_inp.bias": (m.experts,)})
        else:
            vectors.update({"ffn_norm": (m.hidden,), "attn_q_norm": (m.head,), "attn_k_norm": (m.head,)})
        out.update({f"blk.{i}.{n}" + ("" if n.endswith(".bias") else ".weight"): (dims, Q.F32)
                    for n, dims in vectors.items()})
    return out


def _deepseek2_layer(m: Shape, i: int, quant: str) -> dict[str, tuple[tuple[int, ...], object]]:
    """One DeepSeek-V2 layer as llama.cpp's converter writes it (kv_b split per head into k_b
    ``[heads, kv_lora, nope]`` and v_b ``[heads, value, kv_lora]``); a leading dense layer, else
    routed and shared experts."""
    from gguf import GGMLQuantizationType as Q

    matrices = {"attn_q": (m.heads * (m.nope + m.rope), m.hidden), "attn_kv_a_mqa": (m.kv_lora + m.rope, m.hidden),
                "attn_k_b": (m.heads, m.kv_lora, m.nope), "attn_v_b": (m.heads, m.value, m.kv_lora),
                "attn_output": (m.hidden, m.heads * m.value)}
    if i < m.dense_layers:
        matrices.update({"ffn_gate": (m.dense_width, m.hidden), "ffn_up": (m.dense_width, m.hidden),
                         "ffn_down": (m.hidden, m.dense_width)})
    else:
        matrices.update({"ffn_gate_exps": (m.experts, m.width, m.hidden), "ffn_up_exps": (m.experts, m.width, m.hidden),
                         "ffn_down_exps": (m.experts, m.hidden, m.width), "ffn_gate_shexp": (m.shared_width, m.hidden),
                         "ffn_up_shexp": (m.shared_width, m.hidden), "ffn_down_shexp": (m.hidden, m.shared_width)})
    out = {f"blk.{i}.{n}.weight": (dims, tensor_types(quant, n, i, m.layers)) for n, dims in matrices.items()}
    vectors = {"attn_norm": (m.hidden,), "ffn_norm": (m.hidden,), "attn_kv_a_norm": (m.kv_lora,)}
    if i >= m.dense_layers:
        vectors["ffn_gate_inp"] = (m.experts, m.hidden)
    out.update({f"blk.{i}.{n}.weight": (dims, Q.F32) for n, dims in vectors.items()})
    return out


def _deepseek2_metadata(writer, m: Shape) -> None:
    """V2-Lite's keys: one latent "KV head", the latent widths as key/value lengths, each head's
    in the *_mla keys; softmax routing, weights unscaled; YaRN x40 over 4096 tokens with
    mscale_all_dim 0.707 (its log multiplier 0.1 x that)."""
    a = m.arch
    for key, value in (("block_count", m.layers), ("context_length", 163840), ("embedding_length", m.hidden),
                       ("feed_forward_length", m.dense_width), ("attention.head_count", m.heads),
                       ("attention.head_count_kv", 1), ("attention.kv_lora_rank", m.kv_lora),
                       ("attention.key_length", m.kv_lora + m.rope), ("attention.value_length", m.kv_lora),
                       ("attention.key_length_mla", m.nope + m.rope), ("attention.value_length_mla", m.value),
                       ("rope.dimension_count", m.rope), ("leading_dense_block_count", m.dense_layers),
                       ("vocab_size", VOCAB), ("expert_count", m.experts), ("expert_used_count", m.top_k),
                       ("expert_shared_count", m.shared_width // m.width), ("expert_feed_forward_length", m.width),
                       ("expert_gating_func", 1), ("rope.scaling.original_context_length", 4096)):
        writer.add_uint32(f"{a}.{key}", value)
    for key, value in (("rope.freq_base", m.theta), ("attention.layer_norm_rms_epsilon", 1e-6),
                       ("expert_weights_scale", 1.0), ("rope.scaling.factor", 40.0),
                       ("rope.scaling.yarn_log_multiplier", 0.0707)):
        writer.add_float32(f"{a}.{key}", value)
    writer.add_string(f"{a}.rope.scaling.type", "yarn")


def _metadata(writer, m: Shape) -> None:
    """The architecture's keys as llama.cpp's converter writes them for the real model."""
    a = m.arch
    if a == "deepseek2":
        _deepseek2_metadata(writer, m)
        return
    if a in ("qwen35", "qwen35moe"):
        hybrid_metadata(writer, m, VOCAB)
        return
    for key, value in (("block_count", m.layers), ("context_length", 131072 if a == "gpt-oss" else 32768),
                       ("embedding_length", m.hidden), ("feed_forward_length", m.width if a == "gpt-oss" else 6144),
                       ("attention.head_count", m.heads), ("attention.head_count_kv", m.kv_heads),
                       ("attention.key_length", m.head), ("attention.value_length", m.head), ("vocab_size", VOCAB),
                       ("expert_count", m.experts), ("expert_used_count", m.top_k),
                       ("expert_feed_forward_length", m.width)):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", m.theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5 if a == "gpt-oss" else 1e-6)
    if a == "gpt-oss":  # a 128-token window on even layers; YaRN x32 over 4096 tokens
        writer.add_uint32(f"{a}.attention.sliding_window", 128)
        writer.add_string(f"{a}.rope.scaling.type", "yarn")
        writer.add_float32(f"{a}.rope.scaling.factor", 32.0)
        writer.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)


def write_gguf(shape: str, quant: str, out: Path) -> None:
    """The model as a GGUF, tensor by tensor (never more than one in memory)."""
    import gguf

    m = ALL_SHAPES[shape]
    writer = gguf.GGUFWriter(str(out), m.arch)
    writer.add_name(f"random {shape} {quant}")
    _metadata(writer, m)
    writer.add_uint32("general.file_type", {"q4_0": 2, "q4_k_m": 15, "mxfp4": 38, "bf16": 32}[quant])
    for key, field in gguf.GGUFReader(smollm2_gguf_path()).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    tensors = gguf_tensors(shape, quant)
    for name, (dims, qtype) in tensors.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * size
        byte_shape = (*dims[:-1], dims[-1] // block * size)
        writer.add_tensor_info(name, byte_shape if qtype != gguf.GGMLQuantizationType.F32 else dims,
                               np.dtype(np.uint8 if qtype != gguf.GGMLQuantizationType.F32 else np.float32),
                               nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, (dims, qtype) in tensors.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.write_tensor_data(_float_values(name, dims, rng))
        elif qtype == gguf.GGMLQuantizationType.BF16:  # ~N(0, 0.02), truncated to bf16's top 16 bits
            values = (rng.standard_normal(dims, dtype=np.float32) * 0.02).view(np.uint32) >> 16
            writer.write_tensor_data(values.astype(np.uint16).view(np.uint8).reshape(*dims[:-1], -1))
        else:
            rows = int(np.prod(dims[:-1]))
            writer.write_tensor_data(random_blocks(rows, dims[-1], qtype, rng))
    writer.close()


def _float_values(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norm weights 1; router weights spread so routing varies; biases small; sinks ~N(0, 1);
    Gated DeltaNet's as ``hybrid_float_values``."""
    if (hybrid := hybrid_float_values(name, dims, rng)) is not None:
        return hybrid
    if "ffn_gate_inp.weight" in name:
        values = rng.standard_normal(dims) * 0.5
    elif name.endswith(".bias"):
        values = rng.standard_normal(dims) * 0.02
    elif "attn_sinks" in name:
        values = rng.standard_normal(dims)
    else:
        values = np.ones(dims)
    return values.astype(np.float32)


def warm_page_cache(path: Path) -> float:
    """Read ``path`` (a file, or every file under a directory) once, so the next engine starts
    from the page cache; the seconds it took."""
    started, chunk = time.perf_counter(), bytearray(64 << 20)
    for f in ([path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())):
        with open(f, "rb", buffering=0) as handle:
            while handle.readinto(chunk):
                pass
    return time.perf_counter() - started


def llama_batched_bench(binary: str, gguf_path: Path, batches: tuple[int, ...], new_tokens: int) -> dict:
    """llama.cpp's batched decode tok/s (``S_TG``) at each batch size, 32-token prompts."""
    argv = [binary, "-m", str(gguf_path), "-c", str(max(batches) * (32 + new_tokens) + 64), "-b", "512",
            "-ub", "512", "-npp", "32", "-ntg", str(new_tokens), "-npl", ",".join(map(str, batches)),
            "-t", str(torch.get_num_threads())]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed:\n{done.stderr[-2000:]}")
    figures = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[2] or ""):
            figures[f"decode_tok_s_batch{int(cells[2])}"] = float(cells[7])
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(ALL_SHAPES), default="qwen3-30b-a3b",
                   help="model shape (default qwen3-30b-a3b; qwen3.5-*: hybrid, see hybrid_shapes.py; granite-*: "
                        "written by llama.cpp's converter, see converted_shapes.py)")
    p.add_argument("--quant", choices=sorted({q for qs in QUANTS.values() for q in qs}), default=None,
                   help="the GGUF's types: q4_0 or q4_k_m (Qwen3 shape; default q4_0), mxfp4 (gpt-oss; its default), "
                        "bf16 (qwen3.5-9b: every matrix bf16, as convert_hf_to_gguf.py --outtype bf16 writes it)")
    p.add_argument("--work_dir", default="/tmp/kiln-moe", help="where the file and engine go (reused)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians (default 3)")
    p.add_argument("--new_tokens", type=int, default=32, help="greedy tokens decoded per round (default 32)")
    p.add_argument("--contexts", nargs="*", type=int, default=[2048],
                   help="also decode batch-1 after prompts of these many tokens (default 2048)")
    p.add_argument("--batched_bench", default=None,
                   help="path of llama.cpp's llama-batched-bench, for its batched decode beside kiln's")
    p.add_argument("--output_json", default=str(Path(__file__).parent / "results.jsonl"),
                   help="append the record here (default benchmarks/results.jsonl)")
    args = p.parse_args(argv)
    allowed = QUANTS[ALL_SHAPES[args.shape].arch]
    args.quant = args.quant or allowed[0]
    if args.quant not in allowed:
        p.error(f"--quant {args.quant} does not apply to {args.shape} (choose from {', '.join(allowed)})")
    kiln = [str(Path(sys.executable).parent / "kiln")]
    work = Path(args.work_dir) / f"{args.shape}-{args.quant}"
    work.mkdir(parents=True, exist_ok=True)
    gguf_path, ckpt, engine = work / "model.gguf", work / "ckpt", work / "engine"
    if not gguf_path.is_file():
        print(f"writing {gguf_path} (random {args.quant} blocks)", flush=True)
        started = time.perf_counter()
        write = write_converted_gguf if args.shape in CONVERTED_SHAPES else write_gguf
        write(args.shape, args.quant, gguf_path.with_suffix(".partial"))
        gguf_path.with_suffix(".partial").rename(gguf_path)
        print(f"  {gguf_path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - started:.0f} s", flush=True)
    machine = machine_facts()
    vocab = CONVERTED_SHAPES[args.shape].vocab if args.shape in CONVERTED_SHAPES else VOCAB
    record = new_record("moe_scale", shape=args.shape, quant=args.quant, random_weights=True, vocab=vocab,
                        threads=torch.get_num_threads(), new_tokens=args.new_tokens, rounds=args.rounds,
                        machine=machine, gguf_bytes=gguf_path.stat().st_size)
    steps = work / "steps.json"
    if steps.is_file():
        record.update(json.loads(steps.read_text()))
    if not (engine / "config.json").is_file():
        print("kiln convert + build", flush=True)
        record["convert"] = scale.timed_child([*kiln, "convert", "--model_dir", str(gguf_path), "--output_dir",
                                               str(ckpt)])
        record["build"] = scale.timed_child([*kiln, "build", "--checkpoint_dir", str(ckpt), "--output_dir",
                                             str(engine), "--max_batch_size", "32", "--max_seq_len",
                                             str(max([8192, *args.contexts]) + 256), "--max_input_len",
                                             str(max([8192, *args.contexts])),
                                             *(["--dtype", "bfloat16"] if args.quant == "bf16" else [])])
        subprocess.run(["rm", "-rf", str(ckpt)], check=True)
        steps.write_text(json.dumps({"convert": record["convert"], "build": record["build"]}))
    record["engine_bytes"] = sum(f.stat().st_size for f in engine.glob("*.safetensors"))
    engines = {f"kiln {args.quant}": ("kiln", str(engine)), f"llama.cpp {args.quant}": ("llamacpp", str(gguf_path))}
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, (kind, path) in engines.items():
            warm_page_cache(Path(path))
            runs[name].append(scale.child(kind, path, args.new_tokens, tuple(args.contexts)))
            print(f"round {r + 1}: {name}: {runs[name][-1]['decode_tok_s']:.2f} tok/s", flush=True)
    bandwidth = machine.get("read_gbs")
    record["engines"] = {}
    for name, results in runs.items():
        figures = {key: statistics.median(run[key] for run in results) for key in results[0] if key != "weight_bytes"}
        figures["weight_bytes"] = results[0]["weight_bytes"]
        if bandwidth:
            figures["bandwidth_share"] = figures["decode_tok_s"] * figures["weight_bytes"] / (bandwidth * 1e9)
        record["engines"][name] = figures
    if args.batched_bench:
        record["engines"][f"llama.cpp {args.quant}"].update(
            llama_batched_bench(args.batched_bench, gguf_path, BATCHES, args.new_tokens // 2))
    record["command"] = " ".join(["python", "benchmarks/moe_scale.py", *(argv if argv is not None else sys.argv[1:])])
    print(format_moe_scale(record))
    append_record(args.output_json, record)
    return 0


def format_moe_scale(record: dict) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    lines = [f"{record['shape']} {record['quant']} (random weights, vocab {record['vocab']}), {record['threads']} threads, "
             f"{record['new_tokens']} new tokens, median of {record['rounds']} (page cache warmed); read bandwidth "
             f"{record['machine'].get('read_gbs', 0):.1f} GB/s; GGUF {gb(record['gguf_bytes'])}, "
             f"kiln engine {gb(record['engine_bytes'])}"]
    for step in ("convert", "build"):
        if step in record:
            f = record[step]
            lines.append(f"  kiln {step}: {f['seconds']:.0f} s, peak RSS {f['peak_rss_mb']:.0f} MB")
    for name, f in record["engines"].items():
        share = f", {100 * f['bandwidth_share']:.0f}% of read bandwidth" if "bandwidth_share" in f else ""
        extra = [f"batch {k.rpartition('batch')[2]}: {v:.1f}" for k, v in f.items()
                 if k.startswith("decode_tok_s_batch")]
        extra += [f"after {k.rpartition('context')[2]}: {v:.2f}" for k, v in f.items()
                  if k.startswith("decode_tok_s_context")]
        lines.append(f"  {name}: decode {f['decode_tok_s']:.2f} tok/s{share}; prefill {f['prefill_tok_s']:.1f} tok/s; "
                     f"load {f['load_to_first_token_s']:.1f} s; peak RSS {f['peak_rss_mb']:.0f} MB; "
                     f"{'; '.join(extra)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
