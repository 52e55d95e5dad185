"""Tiny random Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss,
DeepSeek-V2) saved to a directory."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.utils.tiny_models import _save_random


def make_mixtral(path: Path, *, hidden: int = 64, layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                 experts: int = 4, top_k: int = 2, intermediate: int = 64, vocab: int = 256, seed: int = 0,
                 stacked: bool = False):
    """A random Mixtral; ``stacked`` saves transformers' in-memory layout (``mlp.experts.gate_up_proj``
    ``[E, 2I, H]``, ``mlp.experts.down_proj``) instead of one tensor per expert (``block_sparse_moe.experts.{e}.w1``)."""
    hf = _save_random(path, "Mixtral", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _decisive_routers(hf, path, seed, stacked)


def make_qwen2_moe(path: Path, *, hidden: int = 64, layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                   experts: int = 8, top_k: int = 2, moe_intermediate: int = 32, shared_intermediate: int = 48,
                   intermediate: int = 96, norm_topk_prob: bool = False, decoder_sparse_step: int = 1,
                   mlp_only_layers: list[int] | None = None, vocab: int = 256, seed: int = 0, stacked: bool = False):
    """A random Qwen2-MoE: routed experts, a gated shared expert, and dense layers where
    ``decoder_sparse_step`` / ``mlp_only_layers`` say."""
    hf = _save_random(path, "Qwen2Moe", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate,
                      shared_expert_intermediate_size=shared_intermediate, norm_topk_prob=norm_topk_prob,
                      decoder_sparse_step=decoder_sparse_step, mlp_only_layers=mlp_only_layers or [],
                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    return _decisive_routers(hf, path, seed, stacked)


def make_qwen3_moe(path: Path, *, hidden: int = 64, layers: int = 3, experts: int = 8, top_k: int = 3,
                   moe_intermediate: int = 32, intermediate: int = 96, norm_topk_prob: bool = True,
                   mlp_only_layers: list[int] | None = None, vocab: int = 256, seed: int = 0):
    """A random Qwen3-MoE: per-head q/k norms, routed experts without a shared one, heads wider
    than hidden / heads, and a dense layer where ``mlp_only_layers`` says."""
    hf = _save_random(path, "Qwen3Moe", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate,
                      norm_topk_prob=norm_topk_prob, mlp_only_layers=[1] if mlp_only_layers is None else mlp_only_layers,
                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    return _decisive_routers(hf, path, seed, stacked=False)


def _decisive_routers(hf, path: Path, seed: int, stacked: bool):
    """Give routers (and shared-expert gates) weights large enough that tokens pick different
    experts by clear margins (the default init makes every expert almost equally likely, so
    rounding could flip a choice), then save again."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    if stacked:
        from safetensors.torch import save_file

        for old in Path(path).glob("*.safetensors"):
            old.unlink()
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        save_file(state, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    else:
        hf.save_pretrained(path)
    return hf


def make_gpt_oss(path: Path, *, hidden: int = 64, layers: int = 2, experts: int = 8, top_k: int = 3,
                 intermediate: int = 48, window: int = 8, vocab: int = 256, truncate: bool = False, seed: int = 0):
    """A random gpt-oss: alternating sliding (``window``) and full layers, attention sinks,
    YaRN (``truncate``: its correction range rounded outwards, as llama.cpp always does), biased
    attention, router and experts, the clamped SwiGLU. Routers, sinks and expert biases get
    weights large enough to matter (the default init leaves sinks and biases at 0), and expert
    weights are large enough that the SwiGLU's clamp cuts some values."""
    hf = _save_random(path, "GptOss", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=window,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": truncate, "original_max_position_embeddings": 16},
                      max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("router.weight", "sinks")):
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 if "router" in name else 1.0))
            elif name.endswith(("router.bias", "_proj_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.6)
    hf.save_pretrained(path)
    return hf


def make_deepseek_v2(path: Path, *, hidden: int = 64, layers: int = 2, num_heads: int = 4,
                     q_lora_rank: int | None = None, kv_lora_rank: int = 32, qk_nope: int = 16, qk_rope: int = 8,
                     v_head: int = 16, experts: int = 8, top_k: int = 2, shared_experts: int = 1,
                     moe_intermediate: int = 32, intermediate: int = 96, first_dense: int = 1,
                     routed_scaling_factor: float = 1.5, topk_method: str = "greedy", n_group: int | None = None,
                     topk_group: int | None = None, rope_parameters: dict | None = None, vocab: int = 256,
                     seed: int = 0):
    """A random DeepSeek-V2: multi-head latent attention (``q_lora_rank`` None: V2-Lite's direct
    q_proj), dense first layers, routed experts plus shared ones, scaled routing weights."""
    hf = _save_random(path, "DeepseekV2", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                      q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope,
                      qk_rope_head_dim=qk_rope, v_head_dim=v_head, n_routed_experts=experts, num_experts_per_tok=top_k,
                      n_shared_experts=shared_experts, moe_intermediate_size=moe_intermediate,
                      first_k_dense_replace=first_dense, routed_scaling_factor=routed_scaling_factor,
                      topk_method=topk_method, n_group=n_group, topk_group=topk_group,
                      rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    return _decisive_routers(hf, path, seed, stacked=False)
