"""Tiny random Hugging Face models whose attention is more than causal: Mistral with a small
sliding window, Gemma 2 (alternating windows, soft-capping), BLOOM (ALiBi).

Each forces HF's eager attention, the plain reference implementation that applies every one
of these features in the scores (sdpa would take the window from a mask too, but soft-capping
only exists in eager).
"""
from __future__ import annotations

from pathlib import Path

from tests.utils.tiny_models import _save_random


def make_mistral_windowed(path: Path, *, window: int = 8, hidden: int = 64, layers: int = 2, num_heads: int = 4,
                          num_kv_heads: int = 2, vocab: int = 256, seed: int = 0):
    """A random Mistral whose sliding window (``window`` tokens) is shorter than the prompts."""
    return _save_random(path, "Mistral", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
                        num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                        sliding_window=window, max_position_embeddings=256, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        attn_implementation="eager")


def make_gemma2(path: Path, *, window: int = 6, hidden: int = 64, layers: int = 3, num_heads: int = 4,
                num_kv_heads: int = 2, vocab: int = 256, attn_softcap: float = 0.5, final_softcap: float = 2.0,
                seed: int = 0):
    """A random Gemma 2: GQA, head_dim 32 (not hidden / heads), query_pre_attn_scalar 24 (not
    head_dim), the window on layers 0 and 2, and soft-caps small enough to bite (dropping either
    moves the logits by 7% / 19%). Weights are drawn wider than usual (initializer_range 0.05)
    so scores reach the caps and greedy tokens vary (with the default, every prompt repeats one
    token)."""
    return _save_random(path, "Gemma2", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 16,
                        num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                        head_dim=32, query_pre_attn_scalar=24, sliding_window=window,
                        attn_logit_softcapping=attn_softcap, final_logit_softcapping=final_softcap,
                        hidden_activation="gelu_pytorch_tanh", initializer_range=0.05, max_position_embeddings=256,
                        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        attn_implementation="eager")


def make_bloom(path: Path, *, heads: int = 6, hidden: int = 96, layers: int = 2, vocab: int = 256, seed: int = 0):
    """A random BLOOM (ALiBi, embedding LayerNorm, per-head fused query_key_value, tied lm_head);
    6 heads by default, not a power of two, so the extra ALiBi slopes are used. Weights are drawn
    10x wider than usual (initializer_range 0.2): with the default every prompt's greedy tokens
    repeat one token, whatever the attention does."""
    return _save_random(path, "Bloom", seed, vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads,
                        layer_norm_epsilon=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                        pad_token_id=0, attn_implementation="eager")
