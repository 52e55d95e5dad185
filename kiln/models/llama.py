"""The LLaMA family: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2 (RMSNorm, RoPE, GQA, SwiGLU;
Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import rope_decoder_config
from kiln.models.registry import register_model


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # the loader's default map is LLaMA's

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        qwen2 = hf.get("model_type") == "qwen2" or architecture == "Qwen2ForCausalLM"
        qwen3 = hf.get("model_type") == "qwen3" or architecture == "Qwen3ForCausalLM"
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        return rope_decoder_config(hf, dtype, mapping, architecture, extra={
            "attn_bias": bool(hf.get("attention_bias", qwen2)),
            "dense_bias": False if qwen2 else bool(hf.get("attention_bias", False)),
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "qk_norm": qwen3,
            "sliding_window": window if hf.get("model_type") in ("mistral", "qwen2", "qwen3") else None,
        })
