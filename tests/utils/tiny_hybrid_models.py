"""Tiny random Hugging Face models of hybrid families (recurrent layers beside attention), saved
to a directory: LFM2's short convolutions, Qwen3.5's Gated DeltaNet (dense and MoE). Each maker
takes ``vocab`` and config overrides."""
from __future__ import annotations

from pathlib import Path

from tests.utils.tiny_models import _save_random


def make_lfm2(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """LFM2: short-convolution layers around one attention layer (per-head q/k norms), the
    feed-forward width adjusted from ``block_ff_dim`` as the real configs do."""
    fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, norm_eps=1e-5,
                  conv_L_cache=3, block_multiple_of=32, block_ffn_dim_multiplier=1.5, block_auto_adjust_ff_dim=True,
                  layer_types=["conv", "conv", "full_attention", "conv"], bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    return _save_random(path, "Lfm2", seed, **{**fields, **config})


QWEN3_5 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def make_qwen3_5(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Qwen3.5 (text): three Gated DeltaNet layers, then a gated full-attention layer."""
    return _save_random(path, "Qwen3_5", seed, config_class="Qwen3_5TextConfig",
                        **{**QWEN3_5, "vocab_size": vocab, **config})


def make_qwen3_5_moe(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Qwen3.5-MoE (text): the same layers with 8 experts (top 2) and a gated shared expert."""
    fields = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return _save_random(path, "Qwen3_5Moe", seed, config_class="Qwen3_5MoeTextConfig",
                        **{**QWEN3_5, **fields, "vocab_size": vocab, **config})


def make_qwen3_next(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Qwen3-Next: Qwen3.5-MoE's layers with fused in_proj_qkvz / in_proj_ba, a dense layer among
    the sparse ones (mlp_only_layers)."""
    fields = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  mlp_only_layers=[1])
    return _save_random(path, "Qwen3Next", seed, **{**QWEN3_5, **fields, "vocab_size": vocab, **config})
