"""Tiny llama GGUF files whose linears come in any mix of GGUF types, as llama.cpp writes them.

Types the gguf package quantizes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from random
weights; K-quants (which it cannot write) are random blocks with small finite float16 scales.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 2, 512, 128  # 256 inputs: K-quants' super-blocks
LINEARS = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HIDDEN // HEADS, HIDDEN),
           "attn_v": (KV_HEADS * HIDDEN // HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
           "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
# Byte offsets of each K-quant block's float16 scales, and their size: weights of ~0.05.
K_SCALES = {Q.Q4_K: {0: 2e-4, 2: 1.5e-3}, Q.Q5_K: {0: 1e-4, 2: 1.5e-3}, Q.Q6_K: {208: 2.5e-5}}


def finish(w: GGUFWriter) -> None:
    """Write out and close ``w`` (header, metadata, tensors)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def copy_metadata(reader, w: GGUFWriter, skip: tuple[str, ...] = (), changes: dict | None = None) -> None:
    """``reader``'s metadata (a ``GGUFReader``, or kiln's faster reader) into ``w``, but keys
    starting with a prefix in ``skip``; ``changes``: key -> new value, or None to drop the key
    (keys the file lacks are added as uint32)."""
    changes = dict(changes or {})
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture", *skip)) or (key in changes and changes[key] is None):
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, changes.pop(key, field.contents()), field.types[0], sub)
    for key, value in changes.items():
        if value is not None:
            w.add_key_value(key, value, GGUFValueType.UINT32)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row reorder llama.cpp's converter applies to llama q/k projections."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_bytes(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator, permute_heads: int | None) -> np.ndarray:
    """A GGUF tensor of ``shape`` ``[out, in]`` (or ``[experts, out, in]``) and ``qtype``: random
    weights quantized (rows permuted as llama.cpp does for q/k), or random K-quant blocks."""
    if len(shape) == 3:
        return np.stack([tensor_bytes(shape[1:], qtype, rng, permute_heads) for _ in range(shape[0])])
    if qtype in K_SCALES:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
        for at, scale in K_SCALES[qtype].items():
            halves = (rng.uniform(0.5, 1.0, size=raw.shape[:2]) * scale).astype(np.float16)
            raw[..., at:at + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(shape[0], -1)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    if permute_heads:
        w = llama_cpp_permute(w, permute_heads)
    if qtype == Q.F32:
        return w
    return w.astype(np.float16) if qtype == Q.F16 else quantize(w, qtype)


def write_llama(path: Path, types: list[dict[str, Q]], output: Q | None = None, embedding: Q = Q.Q8_0,
                seed: int = 0) -> None:
    """A llama GGUF with ``len(types)`` layers, layer i's linears of ``types[i]`` (GGUF short
    names, e.g. ``attn_q``); an untied ``output`` head of that type, or a tied one (None)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "llama")
    for add, value in ((w.add_block_count, len(types)), (w.add_context_length, 256), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                       (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, VOCAB)):
        add(value)
    tensors = {"token_embd.weight": ((VOCAB, HIDDEN), embedding, None)}
    for i, layer in enumerate(types):
        for name, shape in LINEARS.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            tensors[f"blk.{i}.{name}.weight"] = (shape, layer[name], heads)
    if output is not None:
        tensors["output.weight"] = ((VOCAB, HIDDEN), output, None)
    for name, (shape, qtype, heads) in tensors.items():
        data = tensor_bytes(shape, qtype, rng, heads)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(len(types)) for n in ("attn", "ffn")]
    for name in norms:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    finish(w)


EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 256
EXPERT_LINEARS = {"ffn_gate_exps": (EXPERTS, EXPERT_FFN, HIDDEN), "ffn_up_exps": (EXPERTS, EXPERT_FFN, HIDDEN),
                  "ffn_down_exps": (EXPERTS, HIDDEN, EXPERT_FFN)}


def write_qwen3_moe(path: Path, types: list[dict[str, Q]], seed: int = 0) -> None:
    """A Qwen3-MoE GGUF with ``len(types)`` layers, layer i's stacked experts of ``types[i]``
    (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``); attention in Q8_0, routers in float32
    with weights large enough that rounding flips no expert choice."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "qwen3moe")
    for add, value in ((w.add_block_count, len(types)), (w.add_context_length, 256), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, EXPERT_FFN), (w.add_head_count, HEADS),
                       (w.add_head_count_kv, KV_HEADS), (w.add_rope_freq_base, 10000.0),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, VOCAB), (w.add_expert_count, EXPERTS),
                       (w.add_expert_used_count, TOP_K), (w.add_expert_feed_forward_length, EXPERT_FFN)):
        add(value)
    tensors = {"token_embd.weight": ((VOCAB, HIDDEN), Q.Q8_0), "output.weight": ((VOCAB, HIDDEN), Q.Q8_0)}
    for i, layer in enumerate(types):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors[f"blk.{i}.{name}.weight"] = (LINEARS[name], Q.Q8_0)
        for name, shape in EXPERT_LINEARS.items():
            tensors[f"blk.{i}.{name}.weight"] = (shape, layer[name])
    for name, (shape, qtype) in tensors.items():
        w.add_tensor(name, tensor_bytes(shape, qtype, rng, None), raw_dtype=None if qtype == Q.F32 else qtype)
    head_dim = HIDDEN // HEADS
    for i in range(len(types)):
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (rng.standard_normal((EXPERTS, HIDDEN)) * 0.5).astype(np.float32))
        for name, size in (("attn_norm", HIDDEN), ("ffn_norm", HIDDEN), ("attn_q_norm", head_dim),
                           ("attn_k_norm", head_dim)):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    finish(w)


def requantize(src: Path, dst: Path, types: dict[str, Q]) -> Path:
    """A copy of the float GGUF ``src`` whose tensors named ``*.<stem>.weight`` for a stem in
    ``types`` are quantized to its type by the gguf package (row by row: stacked experts too)."""
    from gguf import GGUFReader

    reader = GGUFReader(src)
    w = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_metadata(reader, w)
    for t in reader.tensors:
        data = np.array(t.data)
        qtype = types.get(t.name.rpartition(".")[0].rpartition(".")[2]) if t.name.endswith(".weight") else None
        if qtype is None:
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
    finish(w)
    return dst
