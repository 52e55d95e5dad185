"""The language model inside a LLaVA checkpoint (``LlavaForConditionalGeneration``).

A LLaVA directory holds a vision tower, a projector and a LLaMA-family language model; kiln
serves the language model, read through a customised key map (reference 000's LLaVA
example): the decoder under ``language_model.model`` and the head at
``language_model.lm_head``, or, as transformers 4.52-4.57 saved them, under
``model.language_model`` and ``lm_head``. The vision tower and projector are not read: the
engine takes token ids (image features cannot be fed in; see docs/models.md).
"""
from __future__ import annotations

import dataclasses

from kiln.config import PretrainedConfig
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.models.hf_config import hf_text_config
from kiln.models.key_maps import NestedLanguageModel
from kiln.models.llama import LlamaForCausalLM
from kiln.models.registry import register_model

# model_type of the text config -> the architecture kiln records for the language model
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@register_model("LlavaForConditionalGeneration")
class LlavaLanguageModel(NestedLanguageModel, LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
        text = hf_text_config(hf, tie_default=False)
        model_type = text.get("model_type", "llama")  # LLaVA's own default text model is LLaMA
        if model_type not in TEXT_ARCHITECTURES:
            raise ConfigError(f"LLaVA text_config.model_type {model_type!r}: kiln runs LLaVA language models of "
                              f"types {sorted(TEXT_ARCHITECTURES)}")
        architecture = TEXT_ARCHITECTURES[model_type]
        text = _with_defaults(model_type, text)
        text["architectures"] = [architecture]
        config = super().config_from_hf(text, dtype, mapping)
        # The checkpoint is an ordinary language model from here on; the source is recorded.
        return dataclasses.replace(config, architecture=architecture,
                                   extra={**config.extra, "source_architecture": "LlavaForConditionalGeneration"})


def _with_defaults(model_type: str, text: dict) -> dict:
    """The text config with every field: released LLaVA configs list only the fields that
    differ from the text model's defaults (llava-1.5's says vocab_size, not hidden_size)."""
    from transformers import CONFIG_MAPPING  # transformers takes seconds to import: only where it is used

    known = {k: v for k, v in text.items() if not k.startswith("_")}
    return {**CONFIG_MAPPING[model_type](**known).to_dict(), **known}
