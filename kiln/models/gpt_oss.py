"""gpt-oss (20b, 120b): sliding (128-token) and full attention layers alternating, every
projection biased, attention sinks (a learned logit per head in each softmax's denominator),
YaRN rotary, and a mixture of ``num_local_experts`` experts, ``num_experts_per_tok`` per token
(softmax over the chosen router logits; biased router), each expert a clamped SwiGLU with
biases (kiln/layers/activation.py ``ClampedSwiGLU``).

Hugging Face's stacked expert tensors are ``mlp.experts.gate_up_proj`` ``[E, hidden, 2I]``
(inputs first; gate and up outputs alternating) and ``down_proj`` ``[E, I, hidden]``, with
``*_bias`` beside them; kiln reads them into its ``[E, out, in]`` experts (``ExpertLinear``'s
``source_transposed`` / ``interleaved_part``). Released checkpoints store the expert weights as
MXFP4 (``*_blocks`` + ``*_scales``, ``[E, out, in]`` order), which load decoded exactly.
"""
from __future__ import annotations

from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.layers.activation import ClampedSwiGLU
from kiln.layers.moe import ExpertNames, MixtureOfExperts, check_expert_config, external_layout
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.hf_config import hf_get, hf_sliding_window, rope_decoder_config
from kiln.models.registry import register_model


class GptOssExperts(MixtureOfExperts):
    """The MoE block read from gpt-oss's stacked, transposed, interleaved expert tensors."""

    def use_external_layout(self, layout: str) -> None:
        """``transposed`` (Hugging Face float tensors), ``mxfp4`` (as released: blocks and scales)
        or the generic ``per_projection`` (GGUF files)."""
        for module in () if self.fused else (self.fc, self.gate, self.proj):
            module.source_transposed, module.interleaved_part, module.mxfp4_source = False, None, False
        if layout not in ("transposed", "mxfp4"):
            super().use_external_layout(layout)
            return
        self.router.external_key_map = {"router": self.names.router}
        if self.fused:  # an engine loads kiln's own names only
            return
        mxfp4 = layout == "mxfp4"
        for module, part in ((self.fc, (0, 2)), (self.gate, (1, 2)), (self.proj, None)):
            tensor = "down_proj" if part is None else "gate_up_proj"
            name = "proj" if part is None else "fc" if part[0] == 0 else "gate"
            weight = [f"{tensor}_blocks", f"{tensor}_scales"] if mxfp4 else tensor
            module.external_key_map = {name: "experts", "weight": weight, "bias": f"{tensor}_bias"}
            module.stacked_source, module.interleaved_part, module.fused_part = True, part, None
            module.source_transposed, module.mxfp4_source = not mxfp4, mxfp4

    def match_external_keys(self, external: set[str]) -> None:
        if any(k.endswith(".gate_up_proj_blocks") for k in external):
            self.use_external_layout("mxfp4")
        elif external_layout(external, self.names) == "per_projection":
            self.use_external_layout("per_projection")
        else:
            self.use_external_layout("transposed")


@register_model("GptOssForCausalLM")
class GptOssForCausalLM(DecoderModelForCausalLM):
    gated_mlp = True
    hf_key_map = {}  # LLaMA's names outside the experts; sinks keep theirs
    expert_names = ExpertNames(router="router")

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, engine_layout: bool) -> nn.Module:
        tp = config.mapping
        return GptOssExperts(config.hidden_size, config.intermediate_size, config.num_experts,
                             config.num_experts_per_tok, "silu", normalize_top_k=True, names=cls.expert_names,
                             dtype=torch_dtype(config.dtype), tp_size=tp.tp_size, tp_rank=tp.tp_rank,
                             fused=engine_layout, router_bias=True, expert_bias=True,
                             gated_act=ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit))

    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        experts, top_k = hf_get(hf, "num_local_experts", "num_experts"), hf_get(hf, "num_experts_per_tok")
        check_expert_config(experts, top_k, hf_get(hf, "intermediate_size"), mapping.tp_size,
                            experts_field="num_local_experts", top_k_field="num_experts_per_tok",
                            intermediate_field="intermediate_size")
        layers = hf_get(hf, "num_hidden_layers")
        bias = bool(hf.get("attention_bias", True))
        return rope_decoder_config(hf, dtype, mapping, "GptOssForCausalLM", extra={
            "attn_bias": bias, "dense_bias": bias, "attention_sinks": True, "num_experts": experts,
            "num_experts_per_tok": top_k, "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            # Configs without layer_types: the even layers slide (0, 2, ...), as gpt-oss always did.
            **hf_sliding_window(hf, default_types=[
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)])})
