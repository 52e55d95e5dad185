"""GPT-NeoX / Pythia: LayerNorm, partial rotary, biases everywhere, a GELU MLP, attention and
MLP in parallel off the layer's input (``use_parallel_residual``), and a fused
``query_key_value`` whose rows are ordered per head (q, k, v of head 0, then of head 1...)."""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.layers.normalization import LayerNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.key_maps import MEGATRON_NAMES
from kiln.models.hf_config import hf_get, hf_partial_rotary, rope_decoder_config
from kiln.models.registry import register_model


@register_model("GPTNeoXForCausalLM")
class GPTNeoXForCausalLM(DecoderModelForCausalLM):
    norm_class = LayerNorm
    gated_mlp = False
    hf_key_map = {**MEGATRON_NAMES, "transformer": "gpt_neox", "vocab_embedding": "embed_in", "attention": "attention",
                  "ln_f": "final_layer_norm", "lm_head": "embed_out"}

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        extra = {"rotary_pct": hf_partial_rotary(hf), "attn_bias": bool(hf.get("attention_bias", True)),
                 "dense_bias": True, "mlp_bias": True, "parallel_residual": bool(hf.get("use_parallel_residual", True)),
                 "qkv_per_head": True}
        if hf.get("rotary_emb_base"):  # older configs name the rotary base so
            extra["rotary_base"] = float(hf["rotary_emb_base"])
        return rope_decoder_config(hf, dtype, mapping, "GPTNeoXForCausalLM",
                                   hidden_act=hf_get(hf, "hidden_act", default="gelu"),
                                   norm_epsilon=float(hf_get(hf, "layer_norm_eps", default=1e-5)), extra=extra)
