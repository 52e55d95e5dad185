"""Each GGUF architecture kiln reads, as a declaration: the Hugging Face class and model_type it
becomes, its GGUF block tensors' Hugging Face names, the layouts llama.cpp's converter changed
(q/k rows permuted for its rotary kernel, Gemma 3's norms stored as 1 + w), and a function
turning its metadata into a Hugging Face ``config.json`` dict.

Metadata means what llama.cpp (``src/llama-model.cpp``, ``src/models/<arch>.cpp``) reads it to
mean, with llama.cpp's defaults where a key is absent: Gemma 3's every sixth layer global and
``1/sqrt(key_length)`` attention scale, SmolLM3's every fourth layer without rotary, Qwen3-MoE's
renormalised top-k weights. A config function reads keys through :class:`Meta`, which records
them: a key of the architecture nobody read would change llama.cpp's computation in a way kiln
does not know, so it is refused with a ``CheckpointError`` naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from gguf.gguf_reader import ReaderField, ReaderTensor

from kiln.checkpoint.gguf_rope import global_rope, longrope, typed_rope
from kiln.errors import CheckpointError

_MISSING = object()
# Keys llama.cpp reads that change nothing kiln computes (granite reads finetuned as a switch).
_HARMLESS = frozenset({"rope.scaling.finetuned"})


class Meta:
    """A GGUF file's metadata and its non-weight tensors as an architecture's config function
    reads them; every ``<arch>.<key>`` asked for is recorded (``unread`` lists the others)."""

    def __init__(self, path: Path, arch: str, fields: Mapping[str, ReaderField], tensors: Mapping[str, ReaderTensor]):
        self.path, self.arch, self._fields, self._tensors = path, arch, fields, tensors
        self._read: set[str] = set()

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """``<arch>.<key>`` (a list for arrays), or ``default``; without one a missing key is an error."""
        name = f"{self.arch}.{key}"
        self._read.add(name)
        field = self._fields.get(name)
        if field is not None:
            return field.contents()
        if default is _MISSING:
            raise self.error(f"metadata key {name!r} is missing")
        return default

    def int(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        if isinstance(value, list):
            raise self.error(f"metadata key '{self.arch}.{key}' has a value per layer, which kiln does not support")
        return value if value is None or value is default else int(value)

    def float(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        # Metadata floats are float32; their shortest repr is the decimal the converter wrote (1e-05).
        return value if value is None or value is default else float(str(np.float32(value)))

    def has(self, tensor: str) -> bool:
        return tensor in self._tensors

    def any_tensor(self, suffix: str) -> bool:
        return any(name.endswith(suffix) for name in self._tensors)

    def values(self, tensor: str) -> np.ndarray:
        return np.asarray(self._tensors[tensor].data, dtype=np.float64).reshape(-1)

    def vocab(self) -> int:
        tokens = self._fields.get("tokenizer.ggml.tokens")
        embedding = self._tensors.get("token_embd.weight")
        return int(self.get("vocab_size", None) or (len(tokens.data) if tokens else None)
                   or (embedding.shape[-1] if embedding is not None else 0))

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def unread(self) -> list[str]:
        prefix = f"{self.arch}."
        return [k for k in self._fields if k.startswith(prefix) and k not in self._read
                and k[len(prefix):] not in _HARMLESS]


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF architecture's file reads as a Hugging Face checkpoint."""

    hf_architecture: str
    model_type: str
    config: Callable[[Meta], dict]  # the metadata -> config.json fields (may override the two above)
    block: Mapping[str, str]  # blk.N.<gguf stem> -> <layers>.N.<HF name> (weights and biases)
    top: Mapping[str, str] = field(default_factory=lambda: LLAMA_TOP)
    layers: str = "model.layers"
    permuted_qk: bool = False  # llama.cpp's converter interleaved each head's rotary halves
    norm_offset: float = 0.0  # stored norm weights are the HF weights plus this (Gemma 3: 1)
    transposed: tuple[str, ...] = ()  # HF name suffixes stored [out, in] in GGUF, [in, out] in HF
    unsuffixed: tuple[str, ...] = ()  # HF names under <layers>.N without ".weight" (gpt-oss's sinks)
    extra_tensors: tuple[str, ...] = ()  # tensors the config function reads, not weights

    def hf_name(self, name: str) -> str | None:
        """The HF name of GGUF tensor ``name``; None when it has no HF counterpart."""
        stem, dot, suffix = name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            return None
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            hf = self.block.get(part)
            if hf in self.unsuffixed:
                return f"{self.layers}.{layer}.{hf}" if suffix == "weight" else None
            return None if hf is None else f"{self.layers}.{layer}.{hf}.{suffix}"
        return f"{self.top[stem]}.{suffix}" if stem in self.top else None

    def offset_of(self, gguf_name: str) -> float:
        return self.norm_offset if gguf_name.rpartition(".")[0].endswith("norm") else 0.0


# ----------------------------------------------------------------------------- tensor names

LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Experts, each projection stacked ([experts, out, in]): kiln.layers.moe's ``per_projection`` layout.
_EXPERTS = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_OUTPUT_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
LLAMA_BLOCK = {**_ATTENTION, **_MLP, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
             "output_norm": "transformer.ln_f", "output": "lm_head"}


# ----------------------------------------------------------------------------- configs


def decoder(m: Meta, *, partial_rotary: bool = False, ffn: Any = _MISSING) -> dict:
    """The fields every rotary decoder shares (no rotary base or scaling: see ``gguf_rope``)."""
    hidden, heads = m.int("embedding_length"), m.int("attention.head_count")
    head_dim = m.int("attention.key_length", hidden // heads)
    if m.int("attention.value_length", head_dim) != head_dim:
        raise m.error(f"metadata key '{m.arch}.attention.value_length' differs from key_length ({head_dim})")
    config = {
        "vocab_size": m.vocab(), "hidden_size": hidden, "intermediate_size": m.int("feed_forward_length", ffn),
        "num_hidden_layers": m.int("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": m.int("attention.head_count_kv", heads), "head_dim": head_dim,
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": m.int("context_length"), "tie_word_embeddings": not m.has("output.weight"),
        "hidden_act": "silu", "attention_bias": m.any_tensor(".attn_q.bias"),
    }
    rotary = m.int("rope.dimension_count", head_dim)
    if rotary != head_dim:
        if not partial_rotary:
            raise m.error(f"metadata key '{m.arch}.rope.dimension_count' ({rotary}) is not the head size "
                          f"({head_dim}): partial rotary is not supported for {m.arch!r}")
        config["partial_rotary_factor"] = rotary / head_dim
    return config


def layer_types(m: Meta, layers: int, period: int) -> list[str]:
    """Sliding or full per layer as llama.cpp's ``load_swa_pattern``: a flag per layer in
    ``attention.sliding_window_pattern``, or a period n (default ``period``) whose last layer
    of every n is full."""
    pattern = m.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise m.error(f"metadata key '{m.arch}.attention.sliding_window_pattern' has {len(pattern)} flags "
                          f"for {layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _llama(m: Meta) -> dict:
    return {**decoder(m), **global_rope(m)}


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
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", _llama, {**LLAMA_BLOCK, **_QK_NORM}),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_moe,
        {**_ATTENTION, **_QK_NORM, **_EXPERTS, "attn_norm": "input_layernorm",
         "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}),
    "gpt-oss": GGUFArchitecture(
        "GptOssForCausalLM", "gpt_oss", _gpt_oss,
        {**_ATTENTION, **_EXPERTS, "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router"}, unsuffixed=("self_attn.sinks",)),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", "gemma3_text", _gemma3,
        {**_ATTENTION, **_MLP, **_QK_NORM, **_OUTPUT_NORMS, "attn_norm": "input_layernorm",
         "ffn_norm": "pre_feedforward_layernorm"}, norm_offset=1.0),
    "olmo2": GGUFArchitecture("Olmo2ForCausalLM", "olmo2", _olmo2, {**_ATTENTION, **_MLP, **_QK_NORM, **_OUTPUT_NORMS}),
    "exaone4": GGUFArchitecture("Exaone4ForCausalLM", "exaone4", _exaone4,
                                {**_ATTENTION, **_MLP, **_QK_NORM, **_OUTPUT_NORMS}, extra_tensors=_LLAMA_ROPE),
    "smollm3": GGUFArchitecture("SmolLM3ForCausalLM", "smollm3", _smollm3, LLAMA_BLOCK, permuted_qk=True),
    "granite": GGUFArchitecture("GraniteForCausalLM", "granite", _granite, LLAMA_BLOCK, permuted_qk=True,
                                extra_tensors=_LLAMA_ROPE),
    "seed_oss": GGUFArchitecture("SeedOssForCausalLM", "seed_oss", _seed_oss,
                                 {**_ATTENTION, **_MLP, "attn_norm": "input_layernorm",
                                  "post_attention_norm": "post_attention_layernorm"}),
    "ernie4_5": GGUFArchitecture("Ernie4_5ForCausalLM", "ernie4_5", _ernie4_5, LLAMA_BLOCK),
    "glm4": GGUFArchitecture(
        "Glm4ForCausalLM", "glm4", _glm4,
        {**_ATTENTION, "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
         "post_attention_norm": "post_self_attn_layernorm", "ffn_norm": "post_attention_layernorm",
         "post_ffw_norm": "post_mlp_layernorm"}),
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM", "phi3", _phi3,
        {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
        extra_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
}
