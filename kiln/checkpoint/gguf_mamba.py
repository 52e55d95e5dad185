"""The GGUF architectures with Mamba2 layers kiln reads, as declarations (``gguf_declaration``):
granitehybrid (Granite 4 hybrids), nemotron_h (Nemotron-H without experts) and nemotron_h_moe
(Nemotron 3: with experts).

Metadata means what llama.cpp reads it to mean. Layers: granitehybrid's attention layers are
those with KV heads (``attention.head_count_kv`` per layer), the others Mamba2; nemotron_h's
attention layers have KV heads, its MLP layers a ``feed_forward_length``, the rest are Mamba2;
in nemotron_h_moe the layers with a ``feed_forward_length`` are expert layers (llama.cpp's graph
for the file's experts: sigmoid scores, ``exp_probs_b`` choosing, the top ``expert_used_count``
of ``expert_count`` weighted by their scores, renormalised by ``expert_weights_norm``, times
``expert_weights_scale`` where it is not 0; groups by ``expert_group_count`` /
``expert_group_used_count``, a group scored by its two best; squared-ReLU experts and shared
expert; ``moe_latent_size``: the experts between ``ffn_latent_down`` and ``ffn_latent_up``).
``ssm.*``: ``time_step_rank`` heads sharing ``inner_size``, ``group_count`` groups of
``state_size``, ``conv_kernel``. llama.cpp applies no time-step limit, and rotary only where
``rope.scaling.finetuned`` says (never in the converter's Granite 4 hybrids: NoPE).

llama.cpp's converter stores ``A_log`` as ``-exp(A_log)`` (``[heads, 1]``), ``D`` as ``[heads, 1]``,
the convolution weights squeezed, the gated norm's weight as ``[groups, inner / groups]``, ``dt_bias``
as ``ssm_dt.bias``, q/k rows permuted for its rotary even without rotary; Granite's fused
``input_linear`` tensors (the shared MLP's, the experts') as their gate and up halves, which read
as separate projections (``shared_mlp.gate_proj`` / ``up_proj``, stacked experts as other GGUF
MoE files: ``mlp.experts.*``), so each keeps its quantized blocks.
"""
from __future__ import annotations

import torch

from kiln.checkpoint.gguf_declaration import ATTENTION, EXPERTS, GGUFArchitecture, Meta


def _one_count(m: Meta, key: str, counts: list[int]) -> int | None:
    """The one non-zero value of per-layer ``key`` (None when every layer has 0)."""
    values = set(counts) - {0}
    if len(values) > 1:
        raise m.error(f"metadata key '{m.arch}.{key}' ({counts}) must give its layers one value")
    return values.pop() if values else None


def _ssm(m: Meta) -> dict:
    heads, inner = m.int("ssm.time_step_rank"), m.int("ssm.inner_size")
    if inner % heads:
        raise m.error(f"metadata key '{m.arch}.ssm.inner_size' ({inner}) is not a multiple of ssm.time_step_rank")
    return {"heads": heads, "head_dim": inner // heads, "state": m.int("ssm.state_size"),
            "groups": m.int("ssm.group_count"), "kernel": m.int("ssm.conv_kernel")}


def _attention(m: Meta, layers: int, head_dim: int) -> tuple[list[int], int, int]:
    """(KV heads per layer, the attention layers' KV heads, query heads); no partial rotary."""
    heads = m.int("attention.head_count")
    kv = m.per_layer("attention.head_count_kv", layers)
    if m.int("rope.dimension_count", head_dim) != head_dim:
        raise m.error(f"metadata key '{m.arch}.rope.dimension_count' is not the head size ({head_dim})")
    return kv, _one_count(m, "attention.head_count_kv", kv) or heads, heads


def _granitehybrid(m: Meta) -> dict:
    layers, hidden = m.int("block_count"), m.int("embedding_length")
    head_dim = hidden // m.int("attention.head_count")
    kv, kv_heads, heads = _attention(m, layers, head_dim)
    ssm, experts = _ssm(m), m.int("expert_count", 0)
    ffn = m.int("feed_forward_length")
    return {"vocab_size": m.vocab(), "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": m.int("context_length"), "tie_word_embeddings": not m.has("output.weight"),
            "layer_types": ["attention" if n else "mamba" for n in kv],
            "position_embedding_type": "rope" if m.get("rope.scaling.finetuned", False) else "nope",
            "rope_theta": m.float("rope.freq_base", 10000.0),
            # llama.cpp: an absent attention.scale is 1/sqrt(head size); absent multipliers are 1
            "attention_multiplier": m.float("attention.scale", head_dim ** -0.5),
            "embedding_multiplier": m.float("embedding_scale", 1.0), "residual_multiplier": m.float("residual_scale", 1.0),
            "logits_scaling": m.float("logit_scale", 1.0), "intermediate_size": ffn,
            "shared_intermediate_size": m.int("expert_shared_feed_forward_length", ffn),
            "num_local_experts": experts, "num_experts_per_tok": m.int("expert_used_count", 0),
            "mamba_n_heads": ssm["heads"], "mamba_d_head": ssm["head_dim"], "mamba_d_state": ssm["state"],
            "mamba_n_groups": ssm["groups"], "mamba_d_conv": ssm["kernel"],
            "mamba_conv_bias": m.any_tensor(".ssm_conv1d.bias"), "mamba_proj_bias": m.any_tensor(".ssm_in.bias"),
            "attention_bias": m.any_tensor(".attn_q.bias"), "time_step_limit": [0.0, None]}


def _nemotron_h(m: Meta, ffn_block: str = "-") -> dict:
    """nemotron_h's fields (``ffn_block``: the pattern character of its layers with a
    ``feed_forward_length``: MLP, or experts in nemotron_h_moe)."""
    layers, hidden = m.int("block_count"), m.int("embedding_length")
    head_dim = m.int("attention.key_length")
    if m.int("attention.value_length", head_dim) != head_dim:
        raise m.error(f"metadata key '{m.arch}.attention.value_length' differs from key_length ({head_dim})")
    kv, kv_heads, heads = _attention(m, layers, head_dim)
    ffn = m.per_layer("feed_forward_length", layers)
    if any(k and f for k, f in zip(kv, ffn)):
        raise m.error(f"metadata keys '{m.arch}.attention.head_count_kv' and 'feed_forward_length' both give a "
                      "layer a value: a Nemotron-H layer is one block")
    m.get("rope.scaling.finetuned", False)  # (its attention has no positions either way)
    ssm = _ssm(m)
    return {"vocab_size": m.vocab(), "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "hybrid_override_pattern": "".join("*" if k else ffn_block if f else "M" for k, f in zip(kv, ffn)),
            "intermediate_size": _one_count(m, "feed_forward_length", ffn) or 0,
            "layer_norm_epsilon": m.float("attention.layer_norm_epsilon"), "mlp_hidden_act": "relu2",
            "max_position_embeddings": m.int("context_length"), "tie_word_embeddings": not m.has("output.weight"),
            "mamba_num_heads": ssm["heads"], "mamba_head_dim": ssm["head_dim"], "ssm_state_size": ssm["state"],
            "n_groups": ssm["groups"], "conv_kernel": ssm["kernel"], "use_conv_bias": m.any_tensor(".ssm_conv1d.bias"),
            "use_bias": m.any_tensor(".ssm_in.bias"), "mlp_bias": m.any_tensor(".ffn_up.bias"),
            "attention_bias": m.any_tensor(".attn_q.bias"), "time_step_min": 0.0}


def _nemotron_h_moe(m: Meta) -> dict:
    if m.int("nextn_predict_layers", 0):
        raise m.error(f"metadata key '{m.arch}.nextn_predict_layers' is set: the file keeps a multi-token-prediction "
                      "block among its layers, which kiln does not read (convert with --no-mtp)")
    config = _nemotron_h(m, ffn_block="E")
    experts, width = m.int("expert_count"), m.int("expert_feed_forward_length")
    if config["intermediate_size"] != width:
        raise m.error(f"metadata key '{m.arch}.feed_forward_length' ({config['intermediate_size']}) differs from "
                      f"expert_feed_forward_length ({width}) on the expert layers")
    groups, used_groups = m.int("expert_group_count", 0), m.int("expert_group_used_count", 0)
    if groups > 1 and not used_groups:
        raise m.error(f"metadata key '{m.arch}.expert_group_count' is {groups} without expert_group_used_count")
    m.int("expert_shared_count", 0)  # (one shared expert of the shared width: neither graph reads the count)
    shared, scale = m.int("expert_shared_feed_forward_length"), m.float("expert_weights_scale", 0.0)
    return {**config, "intermediate_size": shared, "n_routed_experts": experts,
            "num_experts_per_tok": m.int("expert_used_count"), "moe_intermediate_size": width,
            "moe_shared_expert_intermediate_size": shared, "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
            "routed_scaling_factor": scale or 1.0,  # llama.cpp: 0 scales nothing
            "n_group": max(groups, 1), "topk_group": max(used_groups, 1),
            "moe_latent_size": m.int("moe_latent_size", 0) or None}


def _mamba_tensors(mixer: str) -> tuple[dict, dict, dict]:
    """(block names, whole names, conversions) of a Mamba2 mixer named ``mixer`` in HF."""
    block = {"ssm_in": f"{mixer}.in_proj", "ssm_conv1d": f"{mixer}.conv1d", "ssm_norm": f"{mixer}.norm",
             "ssm_out": f"{mixer}.out_proj"}
    whole = {"ssm_a": f"{mixer}.A_log", "ssm_d": f"{mixer}.D", "ssm_dt.bias": f"{mixer}.dt_bias"}
    converted = {f"{mixer}.A_log": lambda a: torch.log(-a).reshape(-1), f"{mixer}.D": lambda d: d.reshape(-1),
                 f"{mixer}.norm.weight": lambda w: w.reshape(-1), f"{mixer}.conv1d.weight": lambda w: w.unsqueeze(1)}
    return block, whole, converted


_GRANITE_MAMBA = _mamba_tensors("mamba")
# The shared MLP's halves as separate projections (kiln.models.granite_hybrid reads either form);
# with experts the converter names them *_shexp.
_GRANITE_SHARED_MLP = {"ffn_gate": "shared_mlp.gate_proj", "ffn_up": "shared_mlp.up_proj",
                       "ffn_down": "shared_mlp.down_proj"}
_NEMOTRON_MAMBA = _mamba_tensors("mixer")
_NEMOTRON_BLOCK = {**{k: v.replace("self_attn", "mixer") for k, v in ATTENTION.items()}, **_NEMOTRON_MAMBA[0],
                   "attn_norm": "norm", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj"}
# The experts stacked under mixer (kiln.models.nemotron_h's per-projection names), router mixer.gate.
_NEMOTRON_EXPERTS = {"ffn_gate_inp": "mixer.gate", "ffn_up_exps": "mixer.experts.up_proj",
                     "ffn_down_exps": "mixer.experts.down_proj", "ffn_up_shexp": "mixer.shared_experts.up_proj",
                     "ffn_down_shexp": "mixer.shared_experts.down_proj", "ffn_latent_down": "mixer.fc1_latent_proj",
                     "ffn_latent_up": "mixer.fc2_latent_proj"}
_NEMOTRON_TOP = {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"}

MAMBA_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "granitehybrid": GGUFArchitecture(
        "GraniteMoeHybridForCausalLM", "granitemoehybrid", _granitehybrid,
        {**ATTENTION, **_GRANITE_MAMBA[0], **EXPERTS, **_GRANITE_SHARED_MLP,
         **{f"{stem}_shexp": name for stem, name in _GRANITE_SHARED_MLP.items()},
         "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
        permuted_qk=True, whole=_GRANITE_MAMBA[1], converted=_GRANITE_MAMBA[2]),
    "nemotron_h": GGUFArchitecture(
        "NemotronHForCausalLM", "nemotron_h", _nemotron_h, _NEMOTRON_BLOCK, top=_NEMOTRON_TOP,
        layers="backbone.layers", permuted_qk=True, whole=_NEMOTRON_MAMBA[1], converted=_NEMOTRON_MAMBA[2]),
    "nemotron_h_moe": GGUFArchitecture(
        "NemotronHForCausalLM", "nemotron_h", _nemotron_h_moe, {**_NEMOTRON_BLOCK, **_NEMOTRON_EXPERTS},
        top=_NEMOTRON_TOP, layers="backbone.layers", permuted_qk=True,
        whole={**_NEMOTRON_MAMBA[1], "exp_probs_b.bias": "mixer.gate.e_score_correction_bias"},
        converted=_NEMOTRON_MAMBA[2]),
}
