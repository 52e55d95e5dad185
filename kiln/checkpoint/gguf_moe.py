"""The mixture-of-experts GGUF architectures kiln reads, as declarations (``gguf_declaration``):
qwen3moe, gpt-oss and deepseek2 (DeepSeek-V2 and V2-Lite: multi-head latent attention).

Metadata means what llama.cpp reads it to mean: Qwen3-MoE's top-k weights always renormalised;
gpt-oss's even layers sliding; DeepSeek-V2's routing (softmax, the chosen weights times
``expert_weights_scale``, none when it is absent) and its YaRN, whose
``rope.scaling.yarn_log_multiplier`` is 0.1 x Hugging Face's ``mscale_all_dim`` (llama.cpp's
deepseek2 graph takes ``mscale`` equal to it). deepseek2 files from llama.cpp's current converter
hold ``kv_b_proj`` split for llama.cpp's absorbed attention (``attn_k_b``, each head's key part
transposed, and ``attn_v_b``), joined back here; older files' whole ``attn_kv_b`` reads as it is.
"""
from __future__ import annotations

import numpy as np
import torch

from kiln.checkpoint.gguf_declaration import (ATTENTION, EXPERTS, MLP, QK_NORM, GGUFArchitecture, Joined, Meta,
                                              decoder, layer_types)
from kiln.checkpoint.gguf_rope import global_rope

# llama.cpp's expert_gating_func values (gguf's ExpertGatingFuncType): 1 softmax, 2 sigmoid.
_SOFTMAX = 1


def _qwen3_moe(m: Meta) -> dict:
    experts = m.int("expert_feed_forward_length")
    # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights (norm_w = true).
    return {**decoder(m, ffn=experts), **global_rope(m), "num_experts": m.int("expert_count"),
            "num_experts_per_tok": m.int("expert_used_count"), "moe_intermediate_size": experts,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _gpt_oss(m: Meta) -> dict:
    experts = m.int("expert_feed_forward_length")
    config = decoder(m, ffn=experts)
    # llama.cpp: even layers slide (a period of 2), every layer at one rotary base and scaling
    # (YaRN, its correction range rounded outwards: transformers' truncate), softmax over the
    # chosen router logits, the clamped SwiGLU at OpenAI's alpha 1.702 and limit 7.
    return {**config, **global_rope(m), "intermediate_size": experts, "num_local_experts": m.int("expert_count"),
            "num_experts_per_tok": m.int("expert_used_count"), "sliding_window": m.int("attention.sliding_window"),
            "layer_types": layer_types(m, config["num_hidden_layers"], 2), "swiglu_limit": 7.0,
            "swiglu_alpha": 1.702}


# ----------------------------------------------------------------------------- deepseek2


def _kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """``kv_b_proj`` (``[heads * (nope + v), kv_lora_rank]``: each head's key rows, then its value
    rows) from the converter's ``attn_k_b`` (``[heads, kv_lora_rank, nope]``, transposed for
    llama.cpp's absorbed query) and ``attn_v_b`` (``[heads, v, kv_lora_rank]``)."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)


def _mla(m: Meta, heads: int) -> dict:
    """The latent attention's widths. With ``attention.key_length_mla`` / ``value_length_mla``
    (llama.cpp's ``is_mla``: the converter's split kv_b) key/value_length are the latent cache's
    (kv_lora_rank + rope, kv_lora_rank) and the *_mla keys a head's; without them, a head's."""
    kv_lora, rope = m.int("attention.kv_lora_rank"), m.int("rope.dimension_count")
    key, value = m.int("attention.key_length"), m.int("attention.value_length")
    key_mla, value_mla = m.int("attention.key_length_mla", 0), m.int("attention.value_length_mla", 0)
    if bool(key_mla) != bool(value_mla):
        raise m.error(f"metadata keys '{m.arch}.attention.key_length_mla' and 'value_length_mla' come together")
    if key_mla:
        if (key, value) != (kv_lora + rope, kv_lora):
            raise m.error(f"metadata keys '{m.arch}.attention.key_length' / 'value_length' ({key}, {value}) are not "
                          f"the latent's kv_lora_rank + rope ({kv_lora + rope}) and kv_lora_rank ({kv_lora})")
        key, value = key_mla, value_mla
    if key <= rope or rope % 2:
        raise m.error(f"metadata key '{m.arch}.rope.dimension_count' ({rope}) must be even and below the "
                      f"head's key size ({key})")
    q_lora = m.int("attention.q_lora_rank", None)
    if q_lora is None and m.any_tensor(".attn_q_a.weight"):
        raise m.error(f"metadata key '{m.arch}.attention.q_lora_rank' is missing (the file has attn_q_a tensors)")
    # head_count_kv is 1 in MLA files (one latent row a token): nothing kiln computes depends on it.
    m.int("attention.head_count_kv", heads)
    return {"q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_nope_head_dim": key - rope,
            "qk_rope_head_dim": rope, "v_head_dim": value, "head_dim": rope}


def _deepseek2_routing(m: Meta, layers: int, vocab: int) -> dict:
    """DeepSeekMoE's fields, refusing what Hugging Face's DeepseekV2 cannot compute as llama.cpp does."""
    gating = m.int("expert_gating_func", None)
    if gating is None:  # llama.cpp's default: sigmoid for GLM-4.7-Flash's shape, else softmax
        gating = 2 if layers in (47, 48) and vocab == 154880 else _SOFTMAX
    if gating != _SOFTMAX:
        raise m.error(f"metadata key '{m.arch}.expert_gating_func' is {gating} (not softmax, 1), which kiln's "
                      "DeepSeek-V2 does not support")
    if m.get("expert_weights_norm", False):
        raise m.error(f"metadata key '{m.arch}.expert_weights_norm' is true (top-k weights renormalised), which "
                      "kiln's DeepSeek-V2 does not support (Hugging Face's ignores norm_topk_prob)")
    if m.int("expert_group_count", 0) > 1:
        # llama.cpp scores a group by its two best experts (DeepSeek-V3's rule), V2's code by its best.
        raise m.error(f"metadata key '{m.arch}.expert_group_count' above 1 (group-limited routing, llama.cpp "
                      "scoring groups by their two best experts) is not supported")
    m.int("expert_group_used_count", 0)  # without groups llama.cpp ignores it
    scale = m.float("expert_weights_scale", 0.0)
    return {"first_k_dense_replace": m.int("leading_dense_block_count", 0), "n_routed_experts": m.int("expert_count"),
            "num_experts_per_tok": m.int("expert_used_count"), "n_shared_experts": m.int("expert_shared_count"),
            "moe_intermediate_size": m.int("expert_feed_forward_length"), "topk_method": "greedy",
            "norm_topk_prob": False, "routed_scaling_factor": scale or 1.0}  # llama.cpp: 0 scales nothing


def _deepseek2_rope(m: Meta) -> dict:
    """Rotary base and YaRN. llama.cpp's deepseek2 graph scales scores by mscale(factor,
    mscale_all_dim)^2 and the rotary dims by mscale / mscale_all_dim, with mscale_all_dim
    = yarn_log_multiplier / 0.1 and mscale taken equal to it: Hugging Face's YaRN with both so.
    Any other scaling (linear; YaRN without the multiplier) scales its scores in ways no
    Hugging Face config says, so it is refused."""
    rope = global_rope(m)
    scaling = rope.get("rope_scaling")
    log_mul = m.float("rope.scaling.yarn_log_multiplier", None)
    if scaling is None:
        return rope
    if scaling["rope_type"] != "yarn" or not log_mul:
        raise m.error(f"metadata key '{m.arch}.rope.scaling.type' ({scaling['rope_type']}) without "
                      f"'{m.arch}.rope.scaling.yarn_log_multiplier' is not supported: llama.cpp's deepseek2 graph "
                      "then scales attention scores in a way no Hugging Face config describes")
    mscale = float(str(np.float32(log_mul / 0.1)))  # the decimal the converter multiplied: 0.08 -> 0.8
    return {**rope, "rope_scaling": {**scaling, "mscale": mscale, "mscale_all_dim": mscale}}


def _deepseek2(m: Meta) -> dict:
    hidden, heads, layers = m.int("embedding_length"), m.int("attention.head_count"), m.int("block_count")
    vocab = m.vocab()
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": m.int("feed_forward_length"),
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": m.int("context_length"), "tie_word_embeddings": not m.has("output.weight"),
            "hidden_act": "silu", "attention_bias": False, **_mla(m, heads),
            **_deepseek2_routing(m, layers, vocab), **_deepseek2_rope(m)}


_DEEPSEEK2_BLOCK = {
    **ATTENTION, **MLP, **EXPERTS, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # older converters wrote kv_b whole
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}

MOE_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_moe,
        {**ATTENTION, **QK_NORM, **EXPERTS, "attn_norm": "input_layernorm",
         "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}),
    "gpt-oss": GGUFArchitecture(
        "GptOssForCausalLM", "gpt_oss", _gpt_oss,
        {**ATTENTION, **EXPERTS, "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router"}, unsuffixed=("self_attn.sinks",)),
    "deepseek2": GGUFArchitecture(
        "DeepseekV2ForCausalLM", "deepseek_v2", _deepseek2, _DEEPSEEK2_BLOCK,
        joined={"self_attn.kv_b_proj": Joined(("attn_k_b", "attn_v_b"), _kv_b)}),
}
