"""Hugging Face tensor-name pieces several families share (each family's ``hf_key_map`` maps
kiln's section names to its own; see ``kiln.checkpoint.loader``)."""
from __future__ import annotations

# The ``transformer.h.{i}`` layout GPT-2 started, which BLOOM, Falcon, GPT-J and Qwen kept.
GPT2_LAYOUT = {"transformer": "transformer", "layers": "h", "ln_f": "ln_f", "lm_head": "lm_head"}
# GPT-2's own names for the embedding, the first norm and the attention block (GPT-J and Qwen too).
GPT2_NAMES = {**GPT2_LAYOUT, "vocab_embedding": "wte", "input_layernorm": "ln_1", "attention": "attn"}
# One fused query_key_value and Megatron's MLP names (BLOOM, Falcon, GPT-NeoX).
MEGATRON_NAMES = {"qkv": "query_key_value", "dense": "dense", "fc": "dense_h_to_4h", "proj": "dense_4h_to_h"}

# A multimodal checkpoint's language model (LLaVA, Gemma 3): as released and as transformers
# 5 saves it, under ``language_model.model`` with ``language_model.lm_head``; transformers
# 4.50-4.57 saved it under ``model.language_model`` with ``lm_head``.
NESTED_LANGUAGE_MODEL = {"transformer": "language_model.model", "lm_head": "language_model.lm_head"}
NESTED_LANGUAGE_MODEL_LATER = {"transformer": "model.language_model", "lm_head": "lm_head"}


class NestedLanguageModel:
    """Mixin (listed before the family's class) for the language model of a multimodal
    checkpoint: its key map is whichever of the two nested layouts the checkpoint holds."""

    hf_key_map = NESTED_LANGUAGE_MODEL

    @classmethod
    def key_map_for(cls, external_keys: set[str]) -> dict:
        """The family's own key map (the first class after this mixin that declares one) under
        whichever nested layout the checkpoint holds."""
        after = cls.__mro__[cls.__mro__.index(NestedLanguageModel) + 1:]
        family = next((c.__dict__["hf_key_map"] for c in after if "hf_key_map" in c.__dict__), {})
        if any(k.startswith("model.language_model.") for k in external_keys):
            return {**family, **NESTED_LANGUAGE_MODEL_LATER}
        return {**family, **NESTED_LANGUAGE_MODEL}
