"""Tiny random Hugging Face models of 2025-26 dense families, each with its quirks switched on
(no-rope layers, output norms, per-layer-type rotary, multipliers, biases, adjacent rotary
pairs, LongRoPE), saved to a directory. Each maker takes ``vocab`` and config overrides (the
GGUF tests' models need GPT-2's vocabulary and llama.cpp's layer rules)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.utils.tiny_models import _randomize_norms, _save_random

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 8  # shorter than the tests' prompts plus their 32 new tokens: windows really slide


def _fields(vocab: int, defaults: dict, overrides: dict) -> dict:
    """COMMON with ``vocab`` tokens, the maker's own ``defaults``, then the caller's ``overrides``."""
    return {**COMMON, **defaults, "vocab_size": vocab, **overrides}


def make_smollm3(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """SmolLM3 with every second layer NoPE and, on those, a sliding window (its config's rule)."""
    return _save_random(path, "SmolLM3", seed, **_fields(vocab, dict(
        num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW,
        tie_word_embeddings=True), config))


def make_olmo2(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    return _save_random(path, "Olmo2", seed, **_fields(vocab, dict(
        num_hidden_layers=2, tie_word_embeddings=False), config))


def make_olmo3(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """OLMo 3: three sliding layers to one full; YaRN on the full layer only."""
    rope = {"full_attention": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                               "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return _save_random(path, "Olmo3", seed, **_fields(vocab, dict(
        num_hidden_layers=4, sliding_window=WINDOW, rope_parameters=rope, tie_word_embeddings=False), config))


def make_exaone4(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """EXAONE 4: three sliding (rotary) layers to one global (NoPE) layer."""
    return _save_random(path, "Exaone4", seed, **_fields(vocab, dict(
        num_hidden_layers=4, sliding_window=WINDOW, sliding_window_pattern=4, tie_word_embeddings=False), config))


def make_granite(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Granite 3 with every multiplier away from 1."""
    return _save_random(path, "Granite", seed, **_fields(vocab, dict(
        num_hidden_layers=2, embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.4,
        logits_scaling=4.0, tie_word_embeddings=True), config))


def make_seed_oss(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Seed-OSS: q/k/v and attention-output biases, heads wider than hidden / heads."""
    return _save_random(path, "SeedOss", seed, **_fields(vocab, dict(
        num_hidden_layers=2, head_dim=32, attention_bias=True, attention_out_bias=True,
        tie_word_embeddings=False), config))


def make_ernie4_5(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """ERNIE 4.5 with every bias on (adjacent-pair rotary is its own)."""
    return _save_random(path, "Ernie4_5", seed, **_fields(vocab, dict(
        num_hidden_layers=2, head_dim=16, use_bias=True, tie_word_embeddings=True), config))


def make_glm4(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """GLM-4: sandwich norms, fused gate_up_proj, q/k/v biases, rotary on half of each head."""
    return _save_random(path, "Glm4", seed, **_fields(vocab, dict(
        num_hidden_layers=2, head_dim=16, attention_bias=True, partial_rotary_factor=0.5,
        tie_word_embeddings=False), config))


GEMMA3_TEXT = dict(COMMON, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   hidden_activation="gelu_pytorch_tanh")


def make_gemma3(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Gemma 3 (text): three sliding layers (base 10k) to one global (1M, linear scaling 8)."""
    return _save_random(path, "Gemma3", seed, model_class="Gemma3ForCausalLM", config_class="Gemma3TextConfig",
                        **_fields(vocab, GEMMA3_TEXT, config))


def make_gemma3_multimodal(path: Path, *, seed: int = 0):
    """A ``Gemma3ForConditionalGeneration`` checkpoint (a tiny vision tower beside the language
    model); returns the HF model (its text logits are the reference)."""
    import transformers

    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return _save_random(path, "Gemma3", seed, model_class="Gemma3ForConditionalGeneration",
                        text_config=transformers.Gemma3TextConfig(**GEMMA3_TEXT), vision_config=vision,
                        mm_tokens_per_image=4, image_token_index=255, boi_token_index=253, eoi_token_index=254)


def make_phi4_mini(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Phi-4-mini's shape: 3/4 partial rotary with LongRoPE (short factors up to 16 positions,
    long ones past them), tied embeddings."""
    gen = torch.Generator().manual_seed(seed + 7)
    rotary_half = int(16 * 0.75) // 2
    factors = {name: (1.0 + torch.rand(rotary_half, generator=gen) * scale).tolist()
               for name, scale in (("short_factor", 0.5), ("long_factor", 4.0))}
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "partial_rotary_factor": 0.75, **factors}
    return _save_random(path, "Phi3", seed, **_fields(vocab, dict(
        max_position_embeddings=128, num_hidden_layers=2, rope_parameters=rope, original_max_position_embeddings=16,
        tie_word_embeddings=True), config))


GEMMA4_TEXT = dict(COMMON, num_hidden_layers=5, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                   attention_k_eq_v=True, sliding_window=WINDOW, num_kv_shared_layers=2,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, use_double_wide_mlp=True,
                   final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")


def make_gemma4(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Gemma 4 (text) shaped like the small releases (E2B/E4B): sliding and full layers with their
    own head sizes, KV heads (K reused as V on full layers) and rotary (proportional on full
    layers), the last two layers reading earlier layers' KV cache with double-wide MLPs, per-layer
    input embeddings, final soft-capping; the layer scalars are random, not 1."""
    import transformers

    torch.manual_seed(seed)
    fields = _fields(vocab, GEMMA4_TEXT, config)
    fields.setdefault("vocab_size_per_layer_input", vocab)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**fields))
    _randomize_norms(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
            if fields.get("enable_moe_block"):  # the router's scales start at 1 too
                layer.router.scale.uniform_(0.5, 1.5)
                layer.router.per_expert_scale.uniform_(0.5, 1.5)
    model = model.float().eval()
    model.save_pretrained(path)
    return model
