"""Gemma 4 text GGUF files (llama.cpp architecture ``gemma4``: E2B/E4B, 31B, 26B-A4B), as a
declaration (``gguf_declaration``) reading as transformers' ``Gemma4ForCausalLM``.

llama.cpp's converter keeps Gemma 4's weights as they are (its norms are plain ``x * w``: no
``1 + w`` shift, unlike Gemma 3) and describes the rest in metadata, read here as llama.cpp's
``gemma4`` graph reads it:

- ``attention.sliding_window_pattern``: a sliding flag per layer (``layer_types``);
- ``attention.key_length`` / ``key_length_swa``: the full and sliding layers' head sizes, with
  ``attention.head_count_kv`` a KV head count per layer: transformers' ``per_layer_config``;
- the full layers' proportional rotary as ``rope.dimension_count`` = their head size and a
  ``rope_freqs`` tensor of divisors, 1 for the turning frequency pairs and 1e30 for the still
  ones (``partial_rotary_factor`` = the ones' share); sliding layers at ``rope.freq_base_swa``;
- ``attention.shared_kv_layers``: the last n layers read the KV cache of an earlier layer
  (llama.cpp: the last but one non-shared layer for a sliding layer, the last for a full one);
- values from keys (``attention_k_eq_v``) where a layer with its own KV has no ``attn_v``;
- ``feed_forward_length`` per layer: double-wide MLPs on the KV-shared layers;
- per-layer inputs (PLE) of ``embedding_length_per_layer_input`` a layer;
- experts (26B-A4B) where the layers have ``ffn_gate_inp``: the router's input scale
  (``ffn_gate_inp.scale``), per-expert scales (``ffn_down_exps.scale``), gate and up stacked in one
  tensor (``ffn_gate_up_exps``) as transformers holds them.

What transformers' Gemma 4 config cannot say (values per layer in another pattern, partial rotary
on sliding layers, a KV-sharing rule other than transformers') is refused, naming the key.
"""
from __future__ import annotations

import numpy as np

from kiln.checkpoint.gguf_declaration import (ATTENTION, LLAMA_TOP, MLP, OUTPUT_NORMS, QK_NORM, GGUFArchitecture,
                                              Meta, layer_types)

_FULL, _SLIDING = "full_attention", "sliding_attention"
# llama.cpp's divisor for a frequency pair that does not turn (the converter writes 1e30).
_STILL = 1e30


def _uniform(m: Meta, key: str, layers: int) -> int:
    """``<arch>.<key>`` (required), one value for every layer (a per-layer array of equal values included)."""
    values = set(m.per_layer(key, layers))
    if len(values) != 1:
        raise m.error(f"metadata key '{m.arch}.{key}' differs between layers ({sorted(values)}), which kiln's "
                      "Gemma 4 does not support")
    return values.pop()


def _head_sizes(m: Meta, hidden: int, heads: int) -> tuple[int, int]:
    """The full and sliding layers' head sizes; llama.cpp's gemma4 requires the sliding ones and
    refuses values of another size than keys."""
    full = m.int("attention.key_length", hidden // heads)
    sliding = m.int("attention.key_length_swa")
    for key, size, value in (("attention.value_length", full, m.int("attention.value_length", hidden // heads)),
                             ("attention.value_length_swa", sliding, m.int("attention.value_length_swa"))):
        if value != size:
            raise m.error(f"metadata key '{m.arch}.{key}' ({value}) differs from the key size ({size})")
    return full, sliding


def _rope(m: Meta, full_head: int, sliding_head: int) -> dict:
    """``rope_parameters`` per layer type: the full layers' proportional rotary from ``rope_freqs``."""
    if m.int("rope.dimension_count", full_head) != full_head:
        raise m.error(f"metadata key '{m.arch}.rope.dimension_count' is not the full layers' head size "
                      f"({full_head}); kiln's Gemma 4 rotates them proportionally only")
    rotary_swa = m.int("rope.dimension_count_swa", full_head)
    if rotary_swa != sliding_head:
        raise m.error(f"metadata key '{m.arch}.rope.dimension_count_swa' ({rotary_swa}) is not the sliding layers' "
                      f"head size ({sliding_head}): partial rotary on sliding layers is not supported")
    if not m.has("rope_freqs.weight"):
        raise m.error("tensor 'rope_freqs.weight' (the full layers' proportional rotary) is missing")
    divisors = m.values("rope_freqs.weight")
    turning = int(np.argmax(divisors != 1.0)) if (divisors != 1.0).any() else divisors.size
    if divisors.size != full_head // 2 or not (divisors[turning:] >= _STILL).all():
        raise m.error(f"tensor 'rope_freqs.weight' is not proportional rotary's divisors ({full_head // 2} values: "
                      "ones, then 1e30 for the pairs that do not turn)")
    return {"rope_parameters": {
        _FULL: {"rope_type": "proportional", "partial_rotary_factor": turning / (full_head // 2),
                "rope_theta": m.float("rope.freq_base", 10000.0)},
        _SLIDING: {"rope_type": "default", "rope_theta": m.float("rope.freq_base_swa", 10000.0)}}}


def _kv_sharing(m: Meta, types: list[str]) -> int:
    """``num_kv_shared_layers``, where llama.cpp's choice of each shared layer's source (the
    last non-shared layer for full, the one before for sliding) is transformers' (the last
    non-shared layer of its kind)."""
    layers = len(types)
    shared = m.int("attention.shared_kv_layers", 0)
    first = layers - shared
    for i in range(first, layers):
        theirs = first - (2 if types[i] == _SLIDING else 1)
        ours = max((j for j in range(first) if types[j] == types[i]), default=None)
        if theirs < 0 or theirs != ours:
            raise m.error(f"metadata key '{m.arch}.attention.shared_kv_layers' ({shared}): llama.cpp reads layer "
                          f"{i}'s KV from layer {theirs}, transformers' Gemma 4 from layer {ours}")
    return shared


def _values_from_keys(m: Meta, types: list[str], shared: int) -> bool:
    """``attention_k_eq_v``: the full layers with their own KV have no attn_v (llama.cpp then
    takes the keys as values on any layer without one; transformers on exactly those)."""
    own = range(len(types) - shared)
    without = [i for i in own if not m.has(f"blk.{i}.attn_v.weight")]
    full = [i for i in own if types[i] == _FULL]
    if without and without != full:
        raise m.error(f"layers {without} have no 'attn_v' tensor (values from keys); kiln's Gemma 4 takes values "
                      f"from keys on all the full layers with their own KV ({full}) or none")
    return bool(without)


def _double_wide(m: Meta, layers: int, shared: int) -> tuple[int, bool]:
    """``intermediate_size`` and ``use_double_wide_mlp`` from ``feed_forward_length`` per layer."""
    sizes = m.per_layer("feed_forward_length", layers)
    base, first = sizes[0], layers - shared
    if all(s == base for s in sizes):
        return base, False
    if shared and all(s == base for s in sizes[:first]) and all(s == 2 * base for s in sizes[first:]):
        return base, True
    raise m.error(f"metadata key '{m.arch}.feed_forward_length' ({sizes}) is neither one size nor twice it on the "
                  "KV-shared layers (use_double_wide_mlp)")


def _per_layer_config(m: Meta, types: list[str], heads: tuple[int, int], kv_heads: list[int]) -> dict:
    """``head_dim``, ``num_key_value_heads`` and transformers' ``per_layer_config`` (the layers
    whose head size or KV heads differ from those)."""
    full_head, sliding_head = heads
    base = kv_heads[types.index(_SLIDING)] if _SLIDING in types else kv_heads[0]
    per_layer = {}
    for i, kind in enumerate(types):
        head = full_head if kind == _FULL else sliding_head
        if (head, kv_heads[i]) != (sliding_head, base):
            per_layer[str(i)] = {"head_dim": head, "num_key_value_heads": kv_heads[i]}
    return {"head_dim": sliding_head, "num_key_value_heads": base, "per_layer_config": per_layer}


def _experts(m: Meta, layers: int) -> dict:
    """The 26B-A4B's experts (every layer with a router: transformers' ``enable_moe_block``)."""
    routed = [m.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(layers)]
    if not any(routed):
        return {"enable_moe_block": False}
    if not all(routed):
        raise m.error(f"only layers {[i for i, r in enumerate(routed) if r]} have experts (ffn_gate_inp); kiln's "
                      "Gemma 4 has them on every layer or none")
    return {"enable_moe_block": True, "num_experts": m.int("expert_count"), "top_k_experts": m.int("expert_used_count"),
            "moe_intermediate_size": _uniform(m, "expert_feed_forward_length", layers)}


def _gemma4(m: Meta) -> dict:
    hidden, layers = m.int("embedding_length"), m.int("block_count")
    heads = _uniform(m, "attention.head_count", layers)
    if not isinstance(m.get("attention.sliding_window_pattern"), list):
        raise m.error(f"metadata key '{m.arch}.attention.sliding_window_pattern' is not a flag per layer")
    types = layer_types(m, layers, 0)
    if types[-1] != _FULL:  # transformers makes the last layer full whatever the config says
        raise m.error(f"metadata key '{m.arch}.attention.sliding_window_pattern' makes the last layer sliding")
    head_sizes = _head_sizes(m, hidden, heads)
    shared = _kv_sharing(m, types)
    intermediate, double_wide = _double_wide(m, layers, shared)
    per_layer_input = m.int("embedding_length_per_layer_input")  # llama.cpp's gemma4 requires it (0: none)
    return {
        "vocab_size": m.vocab(), "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "layer_types": types,
        **_per_layer_config(m, types, head_sizes, m.per_layer("attention.head_count_kv", layers, heads)),
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon"), "max_position_embeddings": m.int("context_length"),
        "tie_word_embeddings": not m.has("output.weight"), "attention_bias": False,
        "hidden_activation": "gelu_pytorch_tanh", "sliding_window": m.int("attention.sliding_window"),
        "final_logit_softcapping": m.float("final_logit_softcapping", None), **_rope(m, *head_sizes),
        "attention_k_eq_v": _values_from_keys(m, types, shared), "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double_wide, "hidden_size_per_layer_input": per_layer_input,
        # llama.cpp's per-layer token table has a row per token of the vocabulary
        "vocab_size_per_layer_input": m.vocab(), **_experts(m, layers)}


_BLOCK = {
    **ATTENTION, **QK_NORM, **OUTPUT_NORMS, **MLP, "attn_norm": "input_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm", "ffn_gate_inp": "router.proj",
    # the 26B-A4B's norms around its experts
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2"}
# Names transformers keeps without ".weight", and the router's scales (GGUF suffix "scale").
_WHOLE = {"layer_output_scale.weight": "layer_scalar", "ffn_gate_inp.scale": "router.scale",
          "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
          "ffn_down_exps.weight": "experts.down_proj"}
_TOP = {**LLAMA_TOP, "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm"}

GEMMA4_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "gemma4": GGUFArchitecture("Gemma4ForCausalLM", "gemma4_text", _gemma4, _BLOCK, top=_TOP, whole=_WHOLE,
                               extra_tensors=("rope_freqs.weight",)),
}
