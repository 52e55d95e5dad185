"""Tiny random Hugging Face models of hybrid families (recurrent layers beside attention), saved
to a directory: LFM2's short convolutions, Qwen3.5's Gated DeltaNet (dense and MoE), Mamba2 in
Granite 4 hybrids and Nemotron-H. Each maker takes ``vocab`` and config overrides."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.utils.tiny_models import _randomize_norms, _save_random


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


def add_mtp_layer(path: Path, hf_model, *, seed: int = 1) -> dict:
    """Give the Qwen3.5 directory at ``path`` (``hf_model`` its model) a random multi-token-prediction
    layer as the released checkpoints carry (``mtp.*``: the norms, ``fc``, one full-attention
    decoder layer), in a safetensors file of its own listed in a new index. Returns the HF modules
    (``layer``, ``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm``) holding them."""
    import json

    import torch
    from safetensors.torch import save_file

    from kiln.checkpoint.safetensors_io import SafetensorsReader

    config = hf_model.config
    decoder = type(hf_model.model.layers[config.layer_types.index("full_attention")])
    norm_class = type(hf_model.model.norm)
    torch.manual_seed(seed)
    modules = {"layer": decoder(config, config.layer_types.index("full_attention")),
               "fc": torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
               **{name: norm_class(config.hidden_size, eps=config.rms_norm_eps)
                  for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    tensors = {}
    for name, module in modules.items():
        for key, tensor in module.state_dict().items():
            tensor.copy_(torch.randn_like(tensor) * (0.3 if "norm" in key else 0.08))
            tensors[f"mtp.{'layers.0' if name == 'layer' else name}.{key}"] = tensor.contiguous()
    for key in [k for k in tensors if k.endswith("experts.gate_up_proj")]:  # per expert, as checkpoints hold them
        base, fused, down = key[:-len("gate_up_proj")], tensors.pop(key), tensors.pop(key[:-12] + "down_proj")
        for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in fused):
            tensors.update({f"{base}{e}.gate_proj.weight": gate.contiguous(), f"{base}{e}.up_proj.weight": up.contiguous(),
                            f"{base}{e}.down_proj.weight": down[e].contiguous()})
    save_file(tensors, str(path / "mtp.safetensors"))
    with SafetensorsReader(path / "model.safetensors") as reader:
        weight_map = {key: "model.safetensors" for key in reader.keys()}
    weight_map.update({key: "mtp.safetensors" for key in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config_file = path / "config.json"  # the released configs count it (llama.cpp's converter reads this)
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "mtp_num_hidden_layers": 1}))
    for module in modules.values():
        module.eval()
    return modules


def _save_mamba_hybrid(path: Path, family: str, seed: int, released: dict, drop: tuple[str, ...], **config):
    """``_save_random`` with Mamba2's A_log, D and dt_bias perturbed too (they start at log(1..H),
    1 and 1) and Nemotron-H's router correction bias set (a buffer at 0: as large as the spread of
    the routing scores, so it changes which experts are picked), the saved config.json then written
    as the released checkpoints' are (``released`` fields set, ``drop`` fields removed)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**config))
    _randomize_norms(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
            if "latent_proj" in name:  # (Nemotron-H's) the latent experts' output as large as the others'
                p.mul_(5.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model = model.float().eval()
    model.save_pretrained(path)
    file = path / "config.json"
    fields = {k: v for k, v in json.loads(file.read_text()).items() if k not in drop}
    file.write_text(json.dumps({**fields, **released}, indent=2))
    return model


def make_granite_hybrid(path: Path, *, seed: int = 0, vocab: int = 256, **config):
    """Granite 4 hybrid: Mamba2 layers around one attention layer, Granite's multipliers, a
    shared MLP (and experts with ``num_local_experts``), no positions unless
    ``position_embedding_type`` is rope; the config's layer types as released (mamba / attention)."""
    fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16,
                  mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, num_local_experts=0,
                  num_experts_per_tok=2, position_embedding_type="nope", embedding_multiplier=4.0,
                  residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    fields.update(config)
    kinds = {"linear_attention": "mamba", "full_attention": "attention"}
    types = [kinds.get(t, t) for t in fields["layer_types"]]
    return _save_mamba_hybrid(path, "GraniteMoeHybrid", seed, {"layer_types": types}, (), **fields)


# Nemotron 3's expert fields, tiny: 4 experts, top 2 (HF's defaults: one group, renormalised).
NEMOTRON_H_EXPERTS = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5)


def make_nemotron_h(path: Path, *, seed: int = 0, vocab: int = 256, pattern: str = "M-M*-", **config):
    """Nemotron-H: one block a layer (``pattern``: M Mamba2, * attention, - squared-ReLU MLP, E
    experts: ``NEMOTRON_H_EXPERTS`` unless ``config`` says otherwise); the config as the released
    ones write it (``hybrid_override_pattern``; expert fields only with E layers)."""
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    fields = dict(vocab_size=vocab, hidden_size=64, layers_block_type=[kinds[c] for c in pattern],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                  mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fields.update({**NEMOTRON_H_EXPERTS, **config} if "E" in pattern else config)
    drop = ("layers_block_type", "mtp_layers_block_type")
    if "E" not in pattern:
        drop += ("num_experts_per_tok", "n_routed_experts", "moe_intermediate_size",
                 "moe_shared_expert_intermediate_size", "n_shared_experts", "n_group", "topk_group",
                 "routed_scaling_factor", "norm_topk_prob", "moe_latent_size", "moe_shared_expert_overlap")
    released = {"hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    return _save_mamba_hybrid(path, "NemotronH", seed, released, drop, **fields)
