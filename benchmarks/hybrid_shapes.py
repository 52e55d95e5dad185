"""The hybrid shapes ``moe_scale.py`` writes as GGUF files (llama.cpp's ``qwen35`` / ``qwen35moe``
architectures, as its converter writes them with ``--no-mtp``): the defaults transformers 5.24
carries for ``qwen3_5_text`` (Qwen3.5-9B: hidden 4096, 32 layers, FFN 12288) and
``qwen3_5_moe_text`` (Qwen3.5-35B-A3B: hidden 2048, 40 layers, 256 experts of width 512, 8 per token,
a shared expert of 512); both with three Gated DeltaNet layers (16 key heads and 32 value heads of
128, a 4-wide convolution) before every gated full-attention layer (16 query heads of 256, 2 or 4 KV
heads, rotary on 64 of each head's 256), rotary base 10M.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HybridShape:
    arch: str  # qwen35 or qwen35moe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # the dense FFN's width (qwen35), or each expert's (qwen35moe)
    experts: int = 0
    top_k: int = 0
    shared_width: int = 0
    head: int = 256
    key_heads: int = 16
    value_heads: int = 32
    state_head: int = 128  # key and value head widths of Gated DeltaNet
    conv: int = 4
    interval: int = 4  # every 4th layer full attention
    mtp: int = 0  # multi-token-prediction blocks kept after the model's own (llama.cpp's nextn)

    @property
    def blocks(self) -> int:
        return self.layers + self.mtp

    def recurrent(self, layer: int) -> bool:
        return layer < self.layers and (layer + 1) % self.interval != 0


HYBRID_SHAPES = {
    "qwen3.5-9b": HybridShape("qwen35", 4096, 32, 16, 4, 12288),
    # as the released checkpoint converts without --no-mtp: one MTP block (benchmarks/mtp_ceiling.py)
    "qwen3.5-9b-mtp": HybridShape("qwen35", 4096, 32, 16, 4, 12288, mtp=1),
    "qwen3.5-35b-a3b": HybridShape("qwen35moe", 2048, 40, 16, 2, 512, experts=256, top_k=8, shared_width=512),
}


def hybrid_layer(m: HybridShape, i: int, linear_type, f32) -> dict[str, tuple[tuple[int, ...], object]]:
    """GGUF name -> (dims in HF order ``[..., out, in]``, type) of layer ``i``; ``linear_type(stem)``
    types a weight matrix, ``f32`` the rest."""
    keys, values = m.key_heads * m.state_head, m.value_heads * m.state_head
    if m.recurrent(i):
        matrices = {"attn_qkv": (2 * keys + values, m.hidden), "attn_gate": (values, m.hidden),
                    "ssm_beta": (m.value_heads, m.hidden), "ssm_alpha": (m.value_heads, m.hidden),
                    "ssm_out": (m.hidden, values)}
        vectors = {"ssm_conv1d.weight": (2 * keys + values, m.conv), "ssm_a": (m.value_heads,),
                   "ssm_dt.bias": (m.value_heads,), "ssm_norm.weight": (m.state_head,)}
    else:  # gated attention: each head's query rows, then its gate's
        matrices = {"attn_q": (2 * m.heads * m.head, m.hidden), "attn_k": (m.kv_heads * m.head, m.hidden),
                    "attn_v": (m.kv_heads * m.head, m.hidden), "attn_output": (m.hidden, m.heads * m.head)}
        vectors = {"attn_q_norm.weight": (m.head,), "attn_k_norm.weight": (m.head,)}
    if m.experts:
        matrices.update({"ffn_gate_exps": (m.experts, m.ffn, m.hidden), "ffn_up_exps": (m.experts, m.ffn, m.hidden),
                         "ffn_down_exps": (m.experts, m.hidden, m.ffn), "ffn_gate_shexp": (m.shared_width, m.hidden),
                         "ffn_up_shexp": (m.shared_width, m.hidden), "ffn_down_shexp": (m.hidden, m.shared_width)})
        vectors.update({"ffn_gate_inp.weight": (m.experts, m.hidden), "ffn_gate_inp_shexp.weight": (1, m.hidden)})
    else:
        matrices.update({"ffn_gate": (m.ffn, m.hidden), "ffn_up": (m.ffn, m.hidden), "ffn_down": (m.hidden, m.ffn)})
    vectors.update({"attn_norm.weight": (m.hidden,), "post_attention_norm.weight": (m.hidden,)})
    if i >= m.layers:  # an MTP block: a gated-attention layer and the nextn tensors
        matrices["nextn.eh_proj"] = (m.hidden, 2 * m.hidden)
        vectors.update({f"nextn.{n}.weight": (m.hidden,) for n in ("enorm", "hnorm", "shared_head_norm")})
    out = {f"blk.{i}.{n}.weight": (dims, linear_type(n)) for n, dims in matrices.items()}
    out.update({f"blk.{i}.{n}": (dims, f32) for n, dims in vectors.items()})
    return out


def hybrid_metadata(writer, m: HybridShape, vocab: int) -> None:
    """The keys llama.cpp's converter writes for the real model."""
    a = m.arch
    ints = [("block_count", m.blocks), ("context_length", 262144), ("embedding_length", m.hidden),
            *([] if m.experts else [("feed_forward_length", m.ffn)]), ("attention.head_count", m.heads),
            ("attention.head_count_kv", m.kv_heads), ("attention.key_length", m.head),
            ("attention.value_length", m.head), ("ssm.conv_kernel", m.conv), ("ssm.state_size", m.state_head),
            ("ssm.group_count", m.key_heads), ("ssm.time_step_rank", m.value_heads),
            ("ssm.inner_size", m.value_heads * m.state_head), ("full_attention_interval", m.interval),
            ("rope.dimension_count", m.head // 4), ("vocab_size", vocab)]
    if m.mtp:
        ints.append(("nextn_predict_layers", m.mtp))
    if m.experts:
        ints += [("expert_count", m.experts), ("expert_used_count", m.top_k), ("expert_feed_forward_length", m.ffn),
                 ("expert_shared_feed_forward_length", m.shared_width)]
    for key, value in ints:
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", 1e7)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    writer.add_array(f"{a}.attention.recurrent_layers", [m.recurrent(i) for i in range(m.blocks)])


def hybrid_float_values(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
    """Values of Gated DeltaNet's float tensors (None: not one of them): decays ``-A`` with ``A`` in
    [1, 16] (the converter stores ``-exp(A_log)``), time-step biases 1, convolution taps ~0.3."""
    if name.endswith(".ssm_a"):
        return -rng.uniform(1.0, 16.0, size=dims).astype(np.float32)
    if name.endswith(".ssm_dt.bias"):
        return np.ones(dims, dtype=np.float32)
    if name.endswith(".ssm_conv1d.weight"):
        return (rng.standard_normal(dims) * 0.3).astype(np.float32)
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return (rng.standard_normal(dims) * 0.02).astype(np.float32)
    return None
