"""Tiny random Hugging Face models of the decoder-layer layout variants (OPT, GPT-J, Phi-2,
Falcon), saved to a directory for comparing kiln against HF."""
from __future__ import annotations

from pathlib import Path

from tests.utils.tiny_models import _save_random

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_opt(path: Path, *, pre_norm: bool = True, embed_dim: int | None = None, hidden: int = 64, layers: int = 2,
             heads: int = 4, vocab: int = 256, positions: int = 128, seed: int = 0):
    """A random OPT: pre-norm (125m-style) or post-norm without a final norm (350m-style); an
    ``embed_dim`` below ``hidden`` adds project_in / project_out. ReLU, biases, tied lm_head."""
    return _save_random(path, "OPT", seed, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        ffn_dim=2 * hidden + 8, num_attention_heads=heads, max_position_embeddings=positions,
                        do_layer_norm_before=pre_norm, word_embed_proj_dim=embed_dim or hidden,
                        activation_function="relu", enable_bias=True, tie_word_embeddings=True, **IDS)


def make_gptj(path: Path, *, rotary_dim: int = 8, hidden: int = 64, layers: int = 2, heads: int = 4,
              vocab: int = 256, positions: int = 128, seed: int = 0):
    """A random GPT-J: rotary (adjacent pairs) on ``rotary_dim`` of each head's 16 dims, shared ``ln_1``."""
    return _save_random(path, "GPTJ", seed, vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                        rotary_dim=rotary_dim, n_positions=positions, activation_function="gelu_new",
                        tie_word_embeddings=False, **IDS)


def make_phi(path: Path, *, partial_rotary: float = 0.4, qk_layernorm: bool = False, hidden: int = 64,
             layers: int = 2, heads: int = 4, kv_heads: int | None = None, vocab: int = 256, seed: int = 0):
    """A random Phi-2: shared input LayerNorm, partial rotary (0.4 of 16 dims: 6), biases everywhere."""
    return _save_random(path, "Phi", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                        hidden_act="gelu_new", max_position_embeddings=256, partial_rotary_factor=partial_rotary,
                        qk_layernorm=qk_layernorm, tie_word_embeddings=False, **IDS)


def make_falcon(path: Path, *, new_arch: bool = False, multi_query: bool = True, parallel_attn: bool = True,
                bias: bool = False, heads: int = 4, kv_heads: int | None = None, hidden: int = 64, layers: int = 2,
                vocab: int = 256, seed: int = 0, alibi: bool = False):
    """A random Falcon: 7B-style by default (multi-query, parallel off one norm); ``new_arch``
    for 40B-style KV groups with ``ln_attn`` / ``ln_mlp``; ``parallel_attn=False`` sequential;
    ``alibi`` for Falcon-RW's ALiBi biases."""
    return _save_random(path, "Falcon", seed, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_kv_heads=kv_heads, new_decoder_architecture=new_arch,
                        multi_query=multi_query, parallel_attn=parallel_attn, bias=bias, alibi=alibi,
                        ffn_hidden_size=2 * hidden + 8, max_position_embeddings=256, activation="gelu", **IDS)
