"""kiln: an LLM inference engine on PyTorch.

Convert external checkpoints (Hugging Face, GGUF) into one checkpoint format, build
engines, and run them: ``LLM`` for most users, ``kiln.runtime`` for the lower layers.
"""
from kiln.errors import KilnError
from kiln.llm import LLM
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.runtime.lora_cache import LoraConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "KilnError",
           "LoraConfig", "__version__"]
