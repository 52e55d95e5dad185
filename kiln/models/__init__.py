"""Model families, registered by the architecture names configs use."""
from kiln.models.registry import MODEL_REGISTRY, get_model_class, register_model
from kiln.models import gemma, gpt2, gpt_neox, llama, mixtral, phi3, qwen2_moe  # noqa: F401  (registers the families)

__all__ = ["MODEL_REGISTRY", "get_model_class", "register_model"]
