"""The LLaMA family: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2 (RMSNorm, RoPE, GQA, SwiGLU;
Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm; Mistral's sliding window on every layer,
Qwen's on the layers its config says)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, hf_sliding_window, rope_decoder_config
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
        if hf.get("model_type") == "mistral" or architecture == "MistralForCausalLM":
            window = {"sliding_window": hf.get("sliding_window"), "layer_types": None}  # every layer
        elif (qwen2 or qwen3) and hf.get("use_sliding_window", False):
            # Qwen: the window applies from layer max_window_layers on (unless layer_types says).
            first = hf.get("max_window_layers", 28)
            layers = hf_get(hf, "num_hidden_layers")
            window = hf_sliding_window(hf, default_types=[
                "sliding_attention" if i >= first else "full_attention" for i in range(layers)])
        else:
            window = {"sliding_window": None, "layer_types": None}
        return rope_decoder_config(hf, dtype, mapping, architecture, extra={
            "attn_bias": bool(hf.get("attention_bias", qwen2)),
            "dense_bias": False if qwen2 else bool(hf.get("attention_bias", False)),
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "qk_norm": qwen3,
            **window,
        })
