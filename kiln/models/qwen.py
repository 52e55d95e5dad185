"""Qwen (the first generation, ``QWenLMHeadModel``): the LLaMA computation under its own
names, which reference 000 lists among the customised key maps: one fused ``c_attn`` (q, k
and v rows, with bias), ``w1``/``w2``/``c_proj`` for the MLP (``c_proj(w1(x) * silu(w2(x)))``,
so ``w2`` is the activated input), ``ln_1``/``ln_2`` RMSNorms, and a config with its own field
names (``kv_channels``, ``layer_norm_epsilon``, ``rotary_emb_base``, ``no_bias``, and an
``intermediate_size`` twice the MLP width).

Beyond ``seq_length`` tokens Qwen's own code stretches rotary by a dynamic NTK factor and
scales queries by log-n; kiln does neither, so the engine stops at ``seq_length``.
"""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.hf_config import hf_dtype, hf_get
from kiln.models.key_maps import GPT2_NAMES
from kiln.models.llama import LlamaForCausalLM
from kiln.models.registry import register_model


@register_model("QWenLMHeadModel")
class QWenForCausalLM(LlamaForCausalLM):
    hf_key_map = {**GPT2_NAMES, "qkv": "c_attn", "dense": "c_proj", "post_layernorm": "ln_2", "fc": "w2",
                  "gate": "w1", "proj": "c_proj"}

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        hidden, heads = hf_get(hf, "hidden_size"), hf_get(hf, "num_attention_heads")
        bias = not hf.get("no_bias", True)
        context = hf_get(hf, "seq_length", "max_position_embeddings")
        tied = bool(hf.get("tie_word_embeddings", False))
        return PretrainedConfig(
            architecture="QWenLMHeadModel",
            dtype=hf_dtype(hf, dtype),
            vocab_size=hf_get(hf, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=hf_get(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_size=hf_get(hf, "kv_channels", default=hidden // heads),
            hidden_act="silu",
            intermediate_size=hf_get(hf, "intermediate_size") // 2,
            norm_epsilon=float(hf_get(hf, "layer_norm_epsilon", default=1e-6)),
            max_position_embeddings=context,
            position_embedding_type="rope_gpt_neox",
            mapping=mapping,
            share_embedding_table=tied,
            extra={"rotary_base": float(hf_get(hf, "rotary_emb_base", default=10000.0)),
                   "rotary_pct": float(hf_get(hf, "rotary_pct", default=1.0)), "rotary_scaling": None,
                   "tie_word_embeddings": tied, "attn_bias": True, "dense_bias": bias, "mlp_bias": bias,
                   # Past seq_length Qwen's NTK stretching and log-n scaling take over (not in kiln).
                   "max_seq_len_limit": context if hf.get("use_dynamic_ntk", True) or hf.get("use_logn_attn", True)
                   else None},
        )
