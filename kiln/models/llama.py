"""The LLaMA family: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2 (RMSNorm, RoPE, GQA, SwiGLU;
Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_dtype, hf_get, hf_rope
from kiln.models.registry import register_model


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # the loader's default map is LLaMA's

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        heads = hf_get(hf, "num_attention_heads")
        hidden = hf_get(hf, "hidden_size")
        theta, scaling = hf_rope(hf)
        architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        qwen2 = hf.get("model_type") == "qwen2" or architecture == "Qwen2ForCausalLM"
        qwen3 = hf.get("model_type") == "qwen3" or architecture == "Qwen3ForCausalLM"
        tied = bool(hf.get("tie_word_embeddings", False))
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        return PretrainedConfig(
            architecture=architecture,
            dtype=hf_dtype(hf, dtype),
            vocab_size=hf_get(hf, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=hf_get(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=hf_get(hf, "num_key_value_heads", default=heads),
            head_size=hf_get(hf, "head_dim", default=hidden // heads),
            hidden_act=hf_get(hf, "hidden_act", default="silu"),
            intermediate_size=hf_get(hf, "intermediate_size"),
            norm_epsilon=float(hf_get(hf, "rms_norm_eps", default=1e-6)),
            max_position_embeddings=hf_get(hf, "max_position_embeddings", default=None),
            position_embedding_type="rope_gpt_neox",
            mapping=mapping,
            share_embedding_table=tied,
            extra={
                "rotary_base": theta,
                "rotary_scaling": scaling,
                "attn_bias": bool(hf.get("attention_bias", qwen2)),
                "dense_bias": False if qwen2 else bool(hf.get("attention_bias", False)),
                "mlp_bias": bool(hf.get("mlp_bias", False)),
                "tie_word_embeddings": tied,
                "qk_norm": qwen3,
                "sliding_window": window if hf.get("model_type") in ("mistral", "qwen2", "qwen3") else None,
            },
        )
