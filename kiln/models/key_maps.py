"""Hugging Face tensor-name pieces several families share (each family's ``hf_key_map`` maps
kiln's section names to its own; see ``kiln.checkpoint.loader``)."""
from __future__ import annotations

# The ``transformer.h.{i}`` layout GPT-2 started, which BLOOM, Falcon, GPT-J and Qwen kept.
GPT2_LAYOUT = {"transformer": "transformer", "layers": "h", "ln_f": "ln_f", "lm_head": "lm_head"}
# GPT-2's own names for the embedding, the first norm and the attention block (GPT-J and Qwen too).
GPT2_NAMES = {**GPT2_LAYOUT, "vocab_embedding": "wte", "input_layernorm": "ln_1", "attention": "attn"}
# One fused query_key_value and Megatron's MLP names (BLOOM, Falcon, GPT-NeoX).
MEGATRON_NAMES = {"qkv": "query_key_value", "dense": "dense", "fc": "dense_h_to_4h", "proj": "dense_4h_to_h"}
