"""Each dense GGUF architecture kiln reads, as a declaration (``gguf_declaration``): the Hugging
Face class and model_type it becomes, its GGUF block tensors' Hugging Face names, the layouts
llama.cpp's converter changed (q/k rows permuted for its rotary kernel, Gemma 3's norms stored as
1 + w), and a function turning its metadata into a Hugging Face ``config.json`` dict; with the
mixture-of-experts and latent-attention ones (``gguf_moe``), Gemma 4 (``gguf_gemma4``) and the
hybrid ones (``gguf_hybrid``, ``gguf_mamba``), ``ARCHITECTURES``.

Metadata means what llama.cpp reads it to mean, with llama.cpp's defaults where a key is absent:
Gemma 3's every sixth layer global and ``1/sqrt(key_length)`` attention scale, SmolLM3's every
fourth layer without rotary. A key of the architecture nobody read is refused (``Meta``).
"""
from __future__ import annotations

from kiln.checkpoint.gguf_declaration import (ATTENTION, LLAMA_BLOCK, MLP, OUTPUT_NORMS, QK_NORM, GGUFArchitecture,
                                              Meta, decoder, layer_types)
from kiln.checkpoint.gguf_gemma4 import GEMMA4_ARCHITECTURES
from kiln.checkpoint.gguf_hybrid import HYBRID_ARCHITECTURES
from kiln.checkpoint.gguf_mamba import MAMBA_ARCHITECTURES
from kiln.checkpoint.gguf_moe import MOE_ARCHITECTURES
from kiln.checkpoint.gguf_rope import global_rope, longrope, typed_rope

_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
             "output_norm": "transformer.ln_f", "output": "lm_head"}


def _llama(m: Meta) -> dict:
    return {**decoder(m), **global_rope(m)}


def _gemma3(m: Meta) -> dict:
    config = decoder(m)
    layers = config["num_hidden_layers"]
    # llama.cpp scales scores by 1/sqrt(key_length), but by 1/sqrt(hidden / heads) in the 62-layer 27B.
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    config.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                  query_pre_attn_scalar=scalar, final_logit_softcapping=m.float("final_logit_softcapping", None))
    window = m.int("attention.sliding_window", 0)
    if not window:
        return {**config, **global_rope(m), "sliding_window": None, "layer_types": ["full_attention"] * layers}
    # Sliding layers: base freq_base_swa (llama.cpp's default 10,000), never scaled.
    return {**config, "sliding_window": window, "layer_types": layer_types(m, layers, 6),
            **typed_rope(m, swa_base=m.float("rope.freq_base_swa", 10000.0))}


def _olmo2(m: Meta) -> dict:
    config = decoder(m)
    window = m.int("attention.sliding_window", 0)
    if not window:
        return {**config, **global_rope(m)}
    # OLMo 3: sliding layers (3 of 4 unless the pattern says) rotate at freq_base_swa, unscaled.
    theta = m.float("rope.freq_base", 10000.0)
    return {**config, "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "sliding_window": window,
            "layer_types": layer_types(m, config["num_hidden_layers"], 4),
            **typed_rope(m, swa_base=m.float("rope.freq_base_swa", theta))}


def _exaone4(m: Meta) -> dict:
    config = {**decoder(m), **global_rope(m)}
    layers = config["num_hidden_layers"]
    # llama.cpp uses the hybrid attention (global layers NoPE) only in 64-layer (32B) files; the
    # others (1.2B) attend globally with rotary on every layer, whatever window the file names.
    window = m.int("attention.sliding_window", 4096 if layers == 64 else 0)
    if layers != 64 or not window:
        m.get("attention.sliding_window_pattern", None)
        return {**config, "sliding_window": None}
    base = config.get("rope_theta")
    if m.float("rope.freq_base_swa", base) != base:  # llama.cpp's graph rotates with freq_base anyway
        raise m.error(f"metadata key '{m.arch}.rope.freq_base_swa' differs from freq_base, which llama.cpp's "
                      "exaone4 graph uses on every rotary layer")
    return {**config, "sliding_window": window, "layer_types": layer_types(m, layers, 4)}


def _smollm3(m: Meta) -> dict:
    config = {**decoder(m), **global_rope(m), "use_sliding_window": False}
    # llama.cpp: every 4th layer without rotary (n_no_rope_layer_step).
    return {**config, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(config["num_hidden_layers"])]}


def _granite(m: Meta) -> dict:
    config = {**decoder(m), **global_rope(m)}
    if not m.get("rope.scaling.finetuned", True):
        raise m.error(f"metadata key '{m.arch}.rope.scaling.finetuned' is false (a Granite without rotary)")
    # llama.cpp: an absent attention.scale is 1/sqrt(head size); absent multipliers are 1.
    return {**config, "attention_multiplier": m.float("attention.scale", config["head_dim"] ** -0.5),
            "embedding_multiplier": m.float("embedding_scale", 1.0),
            "residual_multiplier": m.float("residual_scale", 1.0), "logits_scaling": m.float("logit_scale")}


def _seed_oss(m: Meta) -> dict:
    return {**_llama(m), "attention_out_bias": m.any_tensor(".attn_output.bias")}


def _ernie4_5(m: Meta) -> dict:
    return {**_llama(m), "use_bias": m.any_tensor(".attn_q.bias")}


def _glm4(m: Meta) -> dict:
    return {**decoder(m, partial_rotary=True), **global_rope(m)}


def _phi3(m: Meta) -> dict:
    config = decoder(m, partial_rotary=True)
    m.int("attention.sliding_window", 0)  # llama.cpp turns Phi-3's window off (its converter writes 0 for none)
    return {**config, "sliding_window": None, **longrope(m, config)}


def _gpt2(m: Meta) -> dict:
    config = {"vocab_size": m.vocab(), "n_embd": m.int("embedding_length"), "n_layer": m.int("block_count"),
              "n_head": m.int("attention.head_count"), "n_positions": m.int("context_length"),
              "n_ctx": m.int("context_length"), "layer_norm_epsilon": m.float("attention.layer_norm_epsilon", 1e-5),
              "activation_function": "gelu_new", "tie_word_embeddings": not m.has("output.weight")}
    if (ffn := m.int("feed_forward_length", None)) is not None:
        config["n_inner"] = ffn
    return config


_LLAMA_ROPE = ("rope_freqs.weight",)  # llama 3's per-frequency divisors (gguf_rope reads them)

# GGUF architecture -> its declaration. (llama.cpp itself labels Mistral 7B files "llama"; "mistral"
# is accepted for other writers.)
ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", _llama, LLAMA_BLOCK, permuted_qk=True,
                              extra_tensors=_LLAMA_ROPE),
    "mistral": GGUFArchitecture("MistralForCausalLM", "mistral", _llama, LLAMA_BLOCK, permuted_qk=True,
                                extra_tensors=_LLAMA_ROPE),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", _llama, LLAMA_BLOCK, extra_tensors=_LLAMA_ROPE),
    "gpt2": GGUFArchitecture("GPT2LMHeadModel", "gpt2", _gpt2, _GPT2_BLOCK, top=_GPT2_TOP, layers="transformer.h",
                             transposed=(".c_attn.weight", ".c_proj.weight", ".c_fc.weight")),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", _llama, {**LLAMA_BLOCK, **QK_NORM}),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", "gemma3_text", _gemma3,
        {**ATTENTION, **MLP, **QK_NORM, **OUTPUT_NORMS, "attn_norm": "input_layernorm",
         "ffn_norm": "pre_feedforward_layernorm"}, norm_offset=1.0),
    "olmo2": GGUFArchitecture("Olmo2ForCausalLM", "olmo2", _olmo2, {**ATTENTION, **MLP, **QK_NORM, **OUTPUT_NORMS}),
    "exaone4": GGUFArchitecture("Exaone4ForCausalLM", "exaone4", _exaone4,
                                {**ATTENTION, **MLP, **QK_NORM, **OUTPUT_NORMS}, extra_tensors=_LLAMA_ROPE),
    "smollm3": GGUFArchitecture("SmolLM3ForCausalLM", "smollm3", _smollm3, LLAMA_BLOCK, permuted_qk=True),
    "granite": GGUFArchitecture("GraniteForCausalLM", "granite", _granite, LLAMA_BLOCK, permuted_qk=True,
                                extra_tensors=_LLAMA_ROPE),
    "seed_oss": GGUFArchitecture("SeedOssForCausalLM", "seed_oss", _seed_oss,
                                 {**ATTENTION, **MLP, "attn_norm": "input_layernorm",
                                  "post_attention_norm": "post_attention_layernorm"}),
    "ernie4_5": GGUFArchitecture("Ernie4_5ForCausalLM", "ernie4_5", _ernie4_5, LLAMA_BLOCK),
    "glm4": GGUFArchitecture(
        "Glm4ForCausalLM", "glm4", _glm4,
        {**ATTENTION, "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
         "post_attention_norm": "post_self_attn_layernorm", "ffn_norm": "post_attention_layernorm",
         "post_ffw_norm": "post_mlp_layernorm"}),
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM", "phi3", _phi3,
        {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
        extra_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
    **MOE_ARCHITECTURES,
    **GEMMA4_ARCHITECTURES,
    **HYBRID_ARCHITECTURES,
    **MAMBA_ARCHITECTURES,
}
