"""The runtime: engines, the packed step over a paged KV cache, and the APIs that drive it."""
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.executor_types import Request
from kiln.runtime.lora_cache import LoraCacheConfig, LoraConfig
from kiln.runtime.prompt_tuning import PromptTuningConfig
from kiln.runtime.sampling import SamplingConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import GenerationInput, GenerationOutput, GenerationSession
from kiln.runtime.words import decode_words, encode_words

__all__ = ["Engine", "EngineCore", "GenerationInput", "GenerationOutput", "GenerationSession", "LoraCacheConfig",
           "LoraConfig", "PromptTuningConfig", "Request",
           "SamplingConfig", "SamplingParams", "decode_words", "encode_words"]
