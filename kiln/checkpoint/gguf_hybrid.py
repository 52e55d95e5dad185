"""The hybrid GGUF architectures kiln reads (recurrent layers beside attention), as declarations
(``gguf_declaration``): lfm2 (LFM2's short convolutions), qwen35 / qwen35moe (Qwen3.5's Gated
DeltaNet, dense and MoE) and qwen3next (Qwen3-Next).

Metadata means what llama.cpp reads it to mean. lfm2: a layer with no KV heads
(``attention.head_count_kv`` 0) is a convolution layer; ``feed_forward_length`` is the width the
weights have. qwen35: ``attention.recurrent_layers`` marks the Gated DeltaNet layers (without it,
as in older files, all but every ``full_attention_interval``-th, default 4), ``ssm.*``
their widths (``group_count`` key heads of ``state_size``, ``time_step_rank`` value heads sharing
``inner_size``), ``rope.dimension_count`` the rotary part of a head (its M-RoPE sections are plain
rotary for text). llama.cpp's converter stores convolution weights squeezed, Qwen3.5's norms as
``1 + w`` (not the delta-rule output norm), ``A_log`` as ``-exp(A_log)`` and, where value heads
outnumber key heads, the value heads tiled (``v0 of every key head, then v1 ...``) instead of
grouped; kiln reads that order as it is (``linear_value_heads_tiled``). A file may keep the
multi-token-prediction layer after the model's own (``nextn_predict_layers``, counted in
``block_count``): its block reads as the checkpoint's ``mtp.*`` (``kiln.models.mtp``).

qwen3next (Qwen3-Next): qwen35moe's metadata and tensors, with Hugging Face's fused projections.
The converter splits ``in_proj_qkvz`` (per key head its q, k, v and z rows) into ``attn_qkv`` (all
q, all k, all v: Qwen3.5's ``in_proj_qkv``) and ``attn_gate`` (``in_proj_z``), the value heads
grouped by key head as in Hugging Face; older files keep it whole as ``ssm_in``, which reads as
``in_proj_qkvz`` (llama.cpp reads either). ``ssm_ba`` is ``in_proj_ba`` as it is (per key head its
b rows, then its a rows). ``kiln.models.qwen3_next`` picks each projection's rows from whichever
the file holds. Every layer is sparse (llama.cpp's qwen3next holds no dense MLP tensors) and the
top-k weights are renormalised.
"""
from __future__ import annotations

import torch

from kiln.checkpoint.gguf_declaration import (ATTENTION, EXPERTS, MLP, QK_NORM, GGUFArchitecture, Meta, decoder)
from kiln.checkpoint.gguf_rope import global_rope


def tiled_delta_net_order(num_key_heads: int, num_value_heads: int, key_dim: int,
                          value_dim: int) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Where a file with llama.cpp's tiled value heads puts each Gated DeltaNet projection's rows
    and input columns: projection name -> (the Hugging Face index of each of its rows, of each of
    its input columns; None: Hugging Face's own order). Tiled value head ``j`` is value head
    ``j // key heads`` of key head ``j % key heads``; the q and k rows keep their order."""
    j = torch.arange(num_value_heads)
    heads = (j % num_key_heads) * (num_value_heads // num_key_heads) + j // num_key_heads
    channels = (heads[:, None] * value_dim + torch.arange(value_dim)).flatten()
    qk = 2 * num_key_heads * key_dim
    return {"in_proj_qkv": (torch.cat([torch.arange(qk), qk + channels]), None), "in_proj_z": (channels, None),
            "in_proj_b": (heads, None), "in_proj_a": (heads, None), "out_proj": (None, channels)}


def untiled_delta_net_weight(key: str, weight: torch.Tensor, config: dict) -> torch.Tensor:
    """A Gated DeltaNet projection's ``weight`` (Hugging Face name ``key``) read from a file whose
    value heads are tiled (``linear_value_heads_tiled`` in its config), in Hugging Face's order
    again; any other weight as it is."""
    keys, values = config.get("linear_num_key_heads"), config.get("linear_num_value_heads")
    if not config.get("linear_value_heads_tiled") or ".linear_attn." not in key or keys == values:
        return weight
    order = tiled_delta_net_order(keys, values, config["linear_key_head_dim"], config["linear_value_head_dim"])
    projection = key.removesuffix(".weight").rpartition(".")[2]
    if projection not in order:
        return weight
    rows, columns = order[projection]
    return weight[rows.argsort()] if rows is not None else weight[:, columns.argsort()]


def _lfm2(m: Meta) -> dict:
    layers, heads, hidden = m.int("block_count"), m.int("attention.head_count"), m.int("embedding_length")
    kv_heads = m.per_layer("attention.head_count_kv", layers)
    attention_kv = set(kv_heads) - {0}
    if len(attention_kv) != 1:
        raise m.error(f"metadata key '{m.arch}.attention.head_count_kv' ({kv_heads}) must give the attention layers "
                      "one KV head count")
    return {"vocab_size": m.vocab(), "hidden_size": hidden, "block_ff_dim": m.int("feed_forward_length"),
            "block_auto_adjust_ff_dim": False, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": attention_kv.pop(), "norm_eps": m.float("attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": m.int("context_length"), "tie_embedding": not m.has("output.weight"),
            "conv_L_cache": m.int("shortconv.l_cache"), "conv_bias": m.any_tensor(".shortconv.in_proj.bias"),
            "layer_types": ["full_attention" if kv else "conv" for kv in kv_heads], **global_rope(m)}


def _delta_net_hybrid(m: Meta, **ffn: int) -> dict:
    """What qwen35, qwen35moe and qwen3next share: Gated DeltaNet layers before gated full
    attention, and maybe an MTP block. (``ffn``: the MoE files' default feed-forward width, which
    they need not write.)"""
    config = {**decoder(m, partial_rotary=True, **ffn), **global_rope(m)}
    nextn = m.int("nextn_predict_layers", 0)
    if nextn > 1:
        raise m.error(f"metadata key '{m.arch}.nextn_predict_layers' is {nextn}: kiln runs one multi-token-prediction "
                      "layer (as Qwen3.5 has)")
    blocks = config["num_hidden_layers"]
    layers = config["num_hidden_layers"] = blocks - nextn
    interval = m.int("full_attention_interval", 4)
    if interval < 1:
        raise m.error(f"metadata key '{m.arch}.full_attention_interval' is {interval}: it must be positive")
    # llama.cpp: without recurrent_layers (older files), every interval-th layer is full attention
    recurrent = m.get("attention.recurrent_layers", None)
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(layers)] + [False] * nextn
    if not isinstance(recurrent, list) or len(recurrent) != blocks or any(recurrent[layers:]):
        raise m.error(f"metadata key '{m.arch}.attention.recurrent_layers' must flag each of the {layers} layers "
                      f"(and no multi-token-prediction block)")
    recurrent = recurrent[:layers]
    value_heads = m.int("ssm.time_step_rank")
    return {**config, "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
            "linear_conv_kernel_dim": m.int("ssm.conv_kernel"), "linear_key_head_dim": m.int("ssm.state_size"),
            "linear_num_key_heads": m.int("ssm.group_count"), "linear_num_value_heads": value_heads,
            "linear_value_head_dim": m.int("ssm.inner_size") // value_heads}


def _qwen35(m: Meta, **ffn: int) -> dict:
    """Qwen3.5's value heads are stored tiled (the converter reorders them for llama.cpp)."""
    m.get("rope.dimension_sections", None)  # M-RoPE's sections: text positions are equal in all of them
    return {**_delta_net_hybrid(m, **ffn), "linear_value_heads_tiled": True}


def _experts(m: Meta) -> dict:
    """The sparse layers' fields (a sigmoid-gated shared expert beside the routed ones)."""
    return {"num_experts": m.int("expert_count"), "num_experts_per_tok": m.int("expert_used_count"),
            "moe_intermediate_size": m.int("expert_feed_forward_length"),
            "shared_expert_intermediate_size": m.int("expert_shared_feed_forward_length")}


def _qwen35moe(m: Meta) -> dict:
    return {**_qwen35(m, ffn=m.int("expert_feed_forward_length")), **_experts(m)}


def _qwen3next(m: Meta) -> dict:
    if m.any_tensor(".ssm_in.weight") and m.any_tensor(".attn_qkv.weight"):
        # (llama.cpp would read each layer's own form; no converter writes both)
        raise m.error("holds both ssm_in (in_proj_qkvz whole) and attn_qkv / attn_gate (it split) tensors")
    # llama.cpp's qwen3next graph: every layer sparse, the chosen experts' weights renormalised.
    return {**_delta_net_hybrid(m, ffn=m.int("expert_feed_forward_length")), **_experts(m),
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _a_log(stored: torch.Tensor) -> torch.Tensor:
    """``A_log`` from the converter's ``-exp(A_log)``."""
    return torch.log(-stored)


def _conv_weight(stored: torch.Tensor) -> torch.Tensor:
    """A depthwise ``Conv1d`` weight ``[channels, 1, kernel]`` from the converter's squeezed one."""
    return stored.unsqueeze(1)


_LFM2_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
    "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2", "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj"}
_QWEN35_BLOCK = {
    **ATTENTION, **QK_NORM, "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj"}
_QWEN35_WHOLE = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
_QWEN35_CONVERTED = {"linear_attn.A_log": _a_log, "linear_attn.conv1d.weight": _conv_weight}
_QWEN35_MOE_BLOCK = {
    **_QWEN35_BLOCK, **EXPERTS, "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}

# in_proj_qkvz split in two (attn_qkv, attn_gate: _QWEN35_BLOCK's names) or whole (older files' ssm_in)
_QWEN3NEXT_BLOCK = {
    **{k: v for k, v in _QWEN35_MOE_BLOCK.items() if k not in ("ssm_beta", "ssm_alpha")},
    "ssm_in": "linear_attn.in_proj_qkvz", "ssm_ba": "linear_attn.in_proj_ba"}

# The MTP block's own tensors (the rest of it is a decoder layer's): Hugging Face's mtp.* names.
_QWEN35_NEXTN = {"nextn.eh_proj": "fc", "nextn.enorm": "pre_fc_norm_embedding", "nextn.hnorm": "pre_fc_norm_hidden",
                 "nextn.shared_head_norm": "norm"}

HYBRID_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "lfm2": GGUFArchitecture(
        "Lfm2ForCausalLM", "lfm2", _lfm2, _LFM2_BLOCK,
        top={"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm", "output": "lm_head"},
        converted={"conv.conv.weight": _conv_weight}),
    "qwen35": GGUFArchitecture(
        "Qwen3_5ForCausalLM", "qwen3_5_text", _qwen35, {**_QWEN35_BLOCK, **MLP}, norm_offset=1.0,
        plain_norms=("ssm_norm",), whole=_QWEN35_WHOLE, converted=_QWEN35_CONVERTED, nextn=_QWEN35_NEXTN),
    "qwen35moe": GGUFArchitecture(
        "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", _qwen35moe, _QWEN35_MOE_BLOCK, norm_offset=1.0,
        plain_norms=("ssm_norm",), whole=_QWEN35_WHOLE, converted=_QWEN35_CONVERTED, nextn=_QWEN35_NEXTN),
    "qwen3next": GGUFArchitecture(
        "Qwen3NextForCausalLM", "qwen3_next", _qwen3next, _QWEN3NEXT_BLOCK, norm_offset=1.0,
        plain_norms=("ssm_norm",), whole=_QWEN35_WHOLE, converted=_QWEN35_CONVERTED, nextn=_QWEN35_NEXTN),
}
