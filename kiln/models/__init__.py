"""Model families, registered by the architecture names configs use."""
from kiln.models.registry import MODEL_REGISTRY, get_model_class, register_model
from kiln.models import (  # noqa: F401  (registers the families)
    bloom, falcon, gemma, gemma2, gpt2, gpt_neox, gptj, llama, llava, mixtral, opt, phi, phi3, qwen, qwen2_moe)

__all__ = ["MODEL_REGISTRY", "get_model_class", "register_model"]
