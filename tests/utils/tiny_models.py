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
                 model_class: str | None = None, config_class: str | None = None, **config):
    """``transformers.<family>Config(**config)`` (or ``config_class``) as a random float32 model
    (norms perturbed), saved to ``path``; returns the model."""
    import transformers

    torch.manual_seed(seed)
    hf_config = getattr(transformers, config_class or f"{family}Config")(**config)
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


def make_qwen1(path: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, vocab: int = 256,
               seq_length: int = 64, seed: int = 0):
    """A random model saved in Qwen-1's own layout (``QWenLMHeadModel``, whose modeling code is
    not part of transformers); returns the HF Qwen2 model that computes the same function, the
    reference: same RMSNorms, rotate-half rotary, q/k/v bias, SiLU-gated MLP."""
    import json

    from safetensors.torch import save_file

    ref = make_llama(path.parent / f"{path.name}-as-qwen2", model_type="qwen2", num_heads=heads, num_kv_heads=heads,
                     hidden=hidden, layers=layers, vocab=vocab, seed=seed, max_positions=seq_length)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    out = {"transformer.wte.weight": sd["model.embed_tokens.weight"], "transformer.ln_f.weight": sd["model.norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(layers):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}attn.c_attn.{kind}"] = torch.cat([sd[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv"])
        # Qwen-1's MLP is c_proj(w1(x) * silu(w2(x))): w2 is the activated (gate) projection.
        for theirs, ours in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"),
                             ("attn.c_proj", "self_attn.o_proj"), ("mlp.w1", "mlp.up_proj"),
                             ("mlp.w2", "mlp.gate_proj"), ("mlp.c_proj", "mlp.down_proj")):
            out[f"{dst}{theirs}.weight"] = sd[f"{src}{ours}.weight"]
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    c = ref.config
    (path / "config.json").write_text(json.dumps({
        "architectures": ["QWenLMHeadModel"], "model_type": "qwen", "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "kv_channels": hidden // heads,
        "intermediate_size": 2 * c.intermediate_size, "layer_norm_epsilon": c.rms_norm_eps,
        "rotary_emb_base": c.rope_parameters["rope_theta"], "rotary_pct": 1.0, "seq_length": seq_length,
        "max_position_embeddings": seq_length, "no_bias": True, "tie_word_embeddings": False,
        "use_dynamic_ntk": True, "use_logn_attn": True, "torch_dtype": "float32"}))
    return ref


def make_llava(path: Path, *, text_type: str = "llama", later_layout: bool = False, hidden: int = 64, layers: int = 2,
               vocab: int = 256, seed: int = 0):
    """A random LLaVA (tiny CLIP tower, projector, a Llama or Mistral language model) saved to
    ``path``; ``later_layout`` renames its tensors the way transformers 4.52-4.57 saved them
    (``model.language_model.*``, ``lm_head``). The image token id lies outside the vocabulary
    used by test prompts, so HF runs the language model alone on them."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    text = getattr(transformers, "MistralConfig" if text_type == "mistral" else "LlamaConfig")(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=8)
    model = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=vocab + 7))
    _randomize_norms(model)
    model = model.float().eval()
    model.save_pretrained(path)
    if later_layout:
        renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                   ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))
        tensors = load_file(str(path / "model.safetensors"))
        renamed = {}
        for key, tensor in tensors.items():
            for old, new in renames:
                if key.startswith(old):
                    key = new + key[len(old):]
                    break
            renamed[key] = tensor
        save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model
