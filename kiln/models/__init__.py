"""Model families, registered by the architecture names configs use."""
from kiln.models.registry import MODEL_REGISTRY, get_model_class, register_model
from kiln.models import bloom, gemma, gemma2, gpt2, gpt_neox, llama, phi3  # noqa: F401  (registers the families)

__all__ = ["MODEL_REGISTRY", "get_model_class", "register_model"]
