"""Model families, registered by the architecture names configs use."""
from kiln.models.registry import MODEL_REGISTRY, get_model_class, register_model
from kiln.models import (  # noqa: F401  (registers the families)
    bloom, deepseek_v2, ernie4_5, exaone4, falcon, gemma, gemma2, gemma3, gemma4, glm4, gpt2, gpt_neox, gpt_oss, gptj,
    granite, granite_hybrid, lfm2, llama, llava, mixtral, nemotron_h, olmo2, opt, phi, phi3, qwen, qwen2_moe, qwen3_5,
    qwen3_moe, qwen3_next, seed_oss, smollm3)

__all__ = ["MODEL_REGISTRY", "get_model_class", "register_model"]
