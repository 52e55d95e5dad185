"""GPT-J: attention and MLP in parallel off one shared LayerNorm (``ln_1``), rotary on the
first ``rotary_dim`` dims of each head with GPT-J's pairing (``rotate_every_two``: adjacent
dims), no attention biases, a biased gelu_new MLP and a biased lm_head.

kiln's rotary pairs dim i with dim i + rotary_dim / 2 (rotate-half). Reordering each q and k
head's rotary dims on conversion (even dims, then odd) makes it compute GPT-J's q.k exactly,
so the runtime and its native kernels need nothing of their own (``adjacent_rotary_dims``).
"""
from __future__ import annotations

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.layers.normalization import LayerNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.key_maps import GPT2_NAMES
from kiln.models.hf_config import hf_get, rope_decoder_config
from kiln.models.registry import register_model


@register_model("GPTJForCausalLM")
class GPTJForCausalLM(DecoderModelForCausalLM):
    norm_class = LayerNorm
    gated_mlp = False
    hf_key_map = {**GPT2_NAMES, "qkv": ["q_proj", "k_proj", "v_proj"], "dense": "out_proj", "fc": "fc_in",
                  "proj": "fc_out"}

    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__(config, engine_layout)
        for layer in self.transformer.layers.values():
            layer.attention.qkv.adjacent_rotary_dims = config.rotary_dim

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        hidden = hf_get(hf, "n_embd", "hidden_size")
        heads = hf_get(hf, "n_head", "num_attention_heads")
        head_size = hidden // heads
        rotary_dim = hf.get("rotary_dim") or head_size  # None: the whole head
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ConfigError(f"GPT-J rotary_dim {rotary_dim} must be even and at most the head size {head_size}")
        named = {**hf, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
                 "head_dim": head_size, "num_hidden_layers": hf_get(hf, "n_layer", "num_hidden_layers"),
                 "intermediate_size": hf.get("n_inner") or 4 * hidden,
                 "max_position_embeddings": hf_get(hf, "n_positions", "max_position_embeddings")}
        return rope_decoder_config(
            named, dtype, mapping, "GPTJForCausalLM",
            hidden_act=hf_get(hf, "activation_function", default="gelu_new"),
            norm_epsilon=float(hf_get(hf, "layer_norm_epsilon", default=1e-5)),
            extra={"rotary_dim": rotary_dim, "attn_bias": False, "dense_bias": False, "mlp_bias": True,
                   "lm_head_bias": True, "parallel_residual": True, "shared_layernorm": True})
