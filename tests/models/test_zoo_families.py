"""The dense families of 2025-26 against Hugging Face on tiny random models, each with the
quirks its config can switch on: SmolLM3's NoPE layers, OLMo 2/3's output norms and
whole-projection q/k norms (OLMo 3: sliding layers, YaRN on full ones), EXAONE 4's NoPE
global layers, Granite's multipliers, Seed-OSS's biases, ERNIE 4.5's and GLM-4's adjacent
rotary pairs (GLM-4: sandwich norms, half-head rotary, fused gate_up_proj), Gemma 3's
per-layer-type rotary and q/k norms (also from a multimodal checkpoint), Phi-4-mini's
partial LongRoPE."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from kiln.models.decoder import layer_rotaries
from kiln.runtime.engine import Engine
from tests.models.zoo import LOGIT_PROMPT_LENS, built_fixture, check_prompt_logits, hf_reference_fixture, parity_tests
from tests.utils import tiny_family_models as tiny

# name -> (maker, maker kwargs, build options)
CASES: dict[str, tuple[Callable, dict, dict]] = {
    "smollm3": (tiny.make_smollm3, {}, {}),
    "olmo2": (tiny.make_olmo2, {}, {}),
    "olmo3": (tiny.make_olmo3, {}, {}),
    "exaone4": (tiny.make_exaone4, {}, {}),
    "granite": (tiny.make_granite, {}, {}),
    "seed-oss": (tiny.make_seed_oss, {}, {}),
    "ernie4.5": (tiny.make_ernie4_5, {}, {}),
    "glm4": (tiny.make_glm4, {}, {}),
    "gemma3": (tiny.make_gemma3, {}, {}),
    "phi4-mini": (tiny.make_phi4_mini, {}, {}),
}

built = built_fixture(CASES)
hf_reference = hf_reference_fixture()

test_prompt_logits_match_hf, test_batched_greedy_matches_hf = parity_tests(CASES)


def _rotary_kinds(case) -> list[tuple | None]:
    """Each layer's rotary as (rotary_dim, base, rope type), None for a NoPE layer."""
    model = Engine(case.engine_dir).model
    return [None if layer.attention.rotary is None else
            (layer.attention.rotary.rotary_dim, layer.attention.rotary.base, layer.attention.rotary.rope_type)
            for layer in model.transformer.layers.values()]


def test_per_layer_rotary_and_windows_follow_the_config(built) -> None:
    """The configs' per-layer settings reach the layers: SmolLM3's NoPE layers (which also slide),
    EXAONE 4's NoPE global layer, Gemma 3's and OLMo 3's rotary per layer type."""
    assert _rotary_kinds(built("smollm3")) == [(16, 2e6, "default"), None] * 2  # SmolLM3's default base
    smollm3 = Engine(built("smollm3").engine_dir).model.transformer.layers
    assert [layer.attention.window for layer in smollm3.values()] == [None, tiny.WINDOW] * 2
    assert _rotary_kinds(built("exaone4")) == [(16, 10000.0, "default")] * 3 + [None]
    assert _rotary_kinds(built("gemma3")) == [(16, 10000.0, "default")] * 3 + [(16, 1e6, "linear")]
    assert _rotary_kinds(built("olmo3")) == [(16, 10000.0, "default")] * 3 + [(16, 50000.0, "yarn")]
    assert _rotary_kinds(built("phi4-mini")) == [(12, 10000.0, "longrope")] * 2


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, build_from_hf) -> None:
    """A ``Gemma3ForConditionalGeneration`` directory (vision tower beside the language model)
    converts to its language model, whose logits equal the multimodal model's on text."""
    hf = tiny.make_gemma3_multimodal(tmp_path / "hf")
    engine = build_from_hf(tmp_path / "hf", tmp_path / "kiln", {})
    case = type("Case", (), {"hf": hf, "engine_dir": engine})
    check_prompt_logits(case, LOGIT_PROMPT_LENS, hf_logits=lambda ids: hf(input_ids=ids).logits)


def test_layer_rotaries_refuse_bad_fields() -> None:
    from kiln.config import PretrainedConfig
    from kiln.errors import ConfigError
    from kiln.mapping import Mapping

    def config(**extra):
        return PretrainedConfig(architecture="LlamaForCausalLM", dtype="float32", vocab_size=8, hidden_size=8,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_size=4,
                                hidden_act="silu", intermediate_size=8, norm_epsilon=1e-6,
                                max_position_embeddings=16, position_embedding_type="rope_gpt_neox",
                                mapping=Mapping(), extra=extra)

    assert [r is None for r in layer_rotaries(config(nope_layers=[1]))] == [False, True, False]
    with pytest.raises(ConfigError, match="nope_layers"):
        layer_rotaries(config(nope_layers=[2]))
    with pytest.raises(ConfigError, match="layer_rotary"):
        layer_rotaries(config(layer_rotary={"global": {}}))
    with pytest.raises(ConfigError, match="longrope"):
        layer_rotaries(config(rotary_scaling={"rope_type": "longrope", "original_max_position_embeddings": 8,
                                              "short_factor": [1.0], "long_factor": [1.0]}))
