"""OPT: learned positions stored two rows down, LayerNorm before (125m, 1.3b...) or after
(350m: ``do_layer_norm_before`` false, then no final norm) each residual add, ReLU, biases,
and, where ``word_embed_proj_dim`` is narrower than the layers, ``project_in`` /
``project_out`` around them (the tied lm_head works at the narrow width)."""
from __future__ import annotations

import torch

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.layers.embedding import Embedding
from kiln.layers.normalization import LayerNorm
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_dtype, hf_get
from kiln.models.registry import register_model

# Hugging Face's OPTLearnedPositionalEmbedding looks position p up in row p + 2 (a fairseq
# leftover): rows 0 and 1 are never read.
POSITION_OFFSET = 2


class OPTPositionEmbedding(Embedding):
    """The learned position table, kept in kiln as position p in row p: the external table's
    first ``POSITION_OFFSET`` rows are dropped on conversion."""

    def postprocess(self, key: str, weights: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        return super().postprocess(key, [weights[0][POSITION_OFFSET:]], **kwargs)


@register_model("OPTForCausalLM")
class OPTForCausalLM(DecoderModelForCausalLM):
    norm_class = LayerNorm
    gated_mlp = False
    hf_key_map = {
        "transformer": "model.decoder",
        "position_embedding": "embed_positions",
        "attention": "self_attn",
        "qkv": ["q_proj", "k_proj", "v_proj"],
        "dense": "out_proj",
        "input_layernorm": "self_attn_layer_norm",
        "post_layernorm": "final_layer_norm",
        "mlp": "",  # fc1 / fc2 sit directly in the layer
        "fc": "fc1",
        "proj": "fc2",
        "ln_f": "final_layer_norm",
    }

    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__(config, engine_layout)
        table = getattr(self.transformer, "position_embedding", None)
        if table is not None:
            self.transformer.position_embedding = OPTPositionEmbedding(
                table.num_embeddings, table.embedding_dim, dtype=table.weight.dtype)

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        if hf.get("layer_norm_elementwise_affine") is False:
            raise ConfigError("OPT with layer_norm_elementwise_affine=false (norms without weights) is not supported")
        hidden = hf_get(hf, "hidden_size")
        pre_norm = bool(hf.get("do_layer_norm_before", True))
        bias = bool(hf.get("enable_bias", True))
        tied = bool(hf.get("tie_word_embeddings", True))
        return PretrainedConfig(
            architecture="OPTForCausalLM",
            dtype=hf_dtype(hf, dtype),
            vocab_size=hf_get(hf, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=hf_get(hf, "num_hidden_layers"),
            num_attention_heads=hf_get(hf, "num_attention_heads"),
            hidden_act=hf_get(hf, "activation_function", default="relu"),
            intermediate_size=hf_get(hf, "ffn_dim", default=4 * hidden),
            norm_epsilon=1e-5,  # torch.nn.LayerNorm's default: OPT configs have no eps field
            max_position_embeddings=hf_get(hf, "max_position_embeddings"),
            position_embedding_type="learned_absolute",
            mapping=mapping,
            share_embedding_table=tied,
            extra={"attn_bias": bias, "dense_bias": bias, "mlp_bias": bias, "tie_word_embeddings": tied,
                   "norm_after_residual": not pre_norm,
                   # Only pre-norm OPT has a final norm (and _remove_final_layer_norm drops even that).
                   "final_norm": pre_norm and not hf.get("_remove_final_layer_norm", False),
                   "embedding_dim": hf.get("word_embed_proj_dim") or hidden},
        )
