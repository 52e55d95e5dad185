"""Tiny random Hugging Face models saved to a directory, for comparing kiln against HF."""
from __future__ import annotations

from pathlib import Path

import torch


def make_llama(path: Path, *, num_heads: int = 4, num_kv_heads: int = 2, hidden: int = 64, layers: int = 2,
               vocab: int = 256, tie: bool = False, rope_scaling: dict | None = None, qkv_bias: bool = False,
               max_positions: int = 256, seed: int = 0, intermediate: int | None = None,
               max_shard_size: str | None = None, model_type: str = "llama"):
    """Save a random Llama (or Mistral / Qwen2 / Qwen3 with ``model_type``) to ``path``; return the HF model."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 2 + 8,
                  num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # .bin checkpoints: tests.utils.compare.resave_as_torch_bin (transformers 5 writes safetensors)
    save = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if model_type == "qwen2":
        return _save_random(path, "Qwen2", seed, save, **common)
    if model_type == "mistral":  # its sliding window (4,096) lies beyond these positions
        return _save_random(path, "Mistral", seed, save, **common)
    if model_type == "qwen3":  # q/k RMSNorm per head, and a head size other than hidden / heads
        return _save_random(path, "Qwen3", seed, save, head_dim=2 * hidden // num_heads, attention_bias=qkv_bias,
                            **common)
    if rope_scaling is not None:
        common["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    return _save_random(path, "Llama", seed, save, attention_bias=qkv_bias, **common)


def make_gemma(path: Path, *, hidden: int = 64, layers: int = 2, num_heads: int = 4, num_kv_heads: int = 1,
               vocab: int = 256, seed: int = 0):
    """A random Gemma (v1): multi-query attention, a head wider than hidden / heads, GeGLU, tied."""
    return _save_random(path, "Gemma", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 16,
                        num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                        head_dim=2 * hidden // num_heads, hidden_activation="gelu_pytorch_tanh",
                        max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                        pad_token_id=0)


def make_phi3(path: Path, *, hidden: int = 64, layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
              vocab: int = 256, partial_rotary: float = 0.5, seed: int = 0):
    """A random Phi-3 (fused qkv_proj and gate_up_proj), with partial rotary by default."""
    return _save_random(path, "Phi3", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
                        num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                        partial_rotary_factor=partial_rotary, max_position_embeddings=256, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_gpt_neox(path: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, vocab: int = 256,
                  parallel_residual: bool = True, seed: int = 0):
    """A random GPT-NeoX (Pythia): partial rotary (a quarter of each head), per-head fused qkv."""
    return _save_random(path, "GPTNeoX", seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                        num_hidden_layers=layers, num_attention_heads=heads, rotary_pct=0.25,
                        max_position_embeddings=256, use_parallel_residual=parallel_residual,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def make_gpt2(path: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, vocab: int = 256,
              positions: int = 128, seed: int = 0):
    return _save_random(path, "GPT2", seed, model_class="GPT2LMHeadModel", vocab_size=vocab, n_embd=hidden,
                        n_layer=layers, n_head=heads, n_positions=positions, bos_token_id=1, eos_token_id=2)


def _save_random(path: Path, family: str, seed: int, save_kwargs: dict | None = None, *,
                 model_class: str | None = None, **config):
    """``transformers.<family>Config(**config)`` as a random float32 model (norms perturbed),
    saved to ``path``; returns the model."""
    import transformers

    torch.manual_seed(seed)
    hf_config = getattr(transformers, f"{family}Config")(**config)
    model = getattr(transformers, model_class or f"{family}ForCausalLM")(hf_config)
    _randomize_norms(model)
    model = model.float().eval()
    model.save_pretrained(path, **(save_kwargs or {}))
    return model


def _randomize_norms(model) -> None:
    """Norm weights start at 1 and biases at 0: perturb them so a mixed-up norm shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.02)
