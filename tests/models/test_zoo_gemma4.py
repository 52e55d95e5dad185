"""Gemma 4 (text) against Hugging Face on tiny random models shaped like the small releases
(E2B/E4B): sliding and full layers with their own head sizes, KV heads and rotary (proportional
on full layers), K reused as V on full layers, the last layers reading earlier layers' KV cache
(with double-wide MLPs), per-layer input embeddings, random layer scalars, final soft-capping."""
from __future__ import annotations

from typing import Callable

import torch

from kiln.runtime.engine import Engine
from tests.models.zoo import built_fixture, hf_reference_fixture, parity_tests
from tests.utils import tiny_family_models as tiny

# name -> (maker, maker kwargs, build options)
CASES: dict[str, tuple[Callable, dict, dict]] = {
    "gemma4-e2b-like": (tiny.make_gemma4, {}, {}),
    # 31B-like: no per-layer inputs, no KV sharing, separate v_proj on full layers.
    "gemma4-dense": (tiny.make_gemma4, dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                                            attention_k_eq_v=False, num_global_key_value_heads=None,
                                            use_double_wide_mlp=False, final_logit_softcapping=None), {}),
    # 26B-A4B-like: experts beside each layer's dense MLP (transformers' fused expert tensors).
    "gemma4-moe": (tiny.make_gemma4, dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                                          use_double_wide_mlp=False, enable_moe_block=True, num_experts=4,
                                          top_k_experts=2, moe_intermediate_size=32), {}),
}

built = built_fixture(CASES)
hf_reference = hf_reference_fixture()

test_prompt_logits_match_hf, test_batched_greedy_matches_hf = parity_tests(CASES)


def test_layers_follow_the_config(built) -> None:
    """Per-layer head sizes, KV heads, rotary and KV sources reach the layers, and the KV-shared
    layers hold their source's cache tensors instead of their own."""
    from kiln.step.kv_cache import allocate_layer_caches, layer_cache_bytes_per_token

    layers = list(Engine(built("gemma4-e2b-like").engine_dir).model.transformer.layers.values())
    attns = [layer.attention for layer in layers]
    assert [(a.head_size, a.num_kv_heads, a.kv_source) for a in attns] == [
        (16, 2, None), (16, 2, None), (32, 1, None), (16, 2, 1), (32, 1, 2)]
    assert [a.rotary.rope_type for a in attns] == ["default", "default", "proportional", "default", "proportional"]
    assert attns[2].value_from_key and not attns[0].value_from_key
    assert [layer.mlp.proj.in_features for layer in layers] == [96, 96, 96, 192, 192]
    caches = allocate_layer_caches(attns, num_blocks=3, block_size=4, dtype=layers[0].layer_scalar.dtype)
    assert caches[3] is caches[1] and caches[4] is caches[2]
    assert tuple(caches[2][0].shape) == (3, 1, 4, 32)
    assert layer_cache_bytes_per_token(attns, caches[0][0].dtype) == (2 * 2 * 16 * 2 + 2 * 32) * 4


def test_refused_config_fields_are_named() -> None:
    """What kiln cannot run is refused with the config field's name: bidirectional attention, and a
    quantized KV cache with KV-shared layers (they would rewrite their source's cache with their own
    scales)."""
    import dataclasses

    import pytest

    from kiln.config import QuantConfig
    from kiln.errors import ConfigError
    from kiln.mapping import Mapping
    from kiln.models.gemma4 import Gemma4ForCausalLM

    hf = {**tiny.GEMMA4_TEXT, "per_layer_config": None}
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        Gemma4ForCausalLM.config_from_hf({**hf, "use_bidirectional_attention": "all"}, "float32", Mapping())
    with pytest.raises(ConfigError, match="num_kv_shared_layers"):
        Gemma4ForCausalLM.config_from_hf({**hf, "num_kv_shared_layers": 4}, "float32", Mapping())
    config = Gemma4ForCausalLM.config_from_hf(hf, "float32", Mapping())
    config = dataclasses.replace(config, quantization=QuantConfig(kv_cache_quant_algo="INT8"))
    with pytest.raises(ConfigError, match="kv_cache_quant_algo"):
        with torch.device("meta"):
            Gemma4ForCausalLM(config)
