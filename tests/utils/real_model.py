"""Where the tests find the small real models they check kiln against."""
from kiln.examples import SMOLLM2_GGUF, smollm2_gguf_path

__all__ = ["SMOLLM2_GGUF", "smollm2_gguf_path"]
