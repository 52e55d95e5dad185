"""The runtime: engines, the packed step over a paged KV cache, and the APIs that drive it."""
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import GenerationInput, GenerationOutput, GenerationSession, SamplingConfig

__all__ = ["Engine", "EngineCore", "GenerationInput", "GenerationOutput", "GenerationSession",
           "SamplingConfig", "SamplingParams"]
