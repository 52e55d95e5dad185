"""Every quantization algorithm kiln implements, in one table: what its tensors hold and how
it is made. The constants the converter, the layers and the builder use are derived from it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantAlgo:
    name: str
    weight_bits: int  # bits of a weight code
    calibrated: bool  # convert runs the float model on calibration texts first
    weight_only: bool = True  # integer codes in kiln.quantization.weight_only's layout (activations float)
    prequant: bool = False  # a prequant_scaling_factor (1/s) per linear: AWQ's codes hold W diag(s)
    activation_scale: bool = False  # a static activation_scaling_factor per linear (FP8 inputs)
    bf16_engine: bool = True  # its kernels compute in bf16, so its engines are bfloat16
    group_size: int = 64  # inputs per scale when the user gives none (4-bit modes)


ALGOS = {a.name: a for a in (
    QuantAlgo("W8A16", 8, calibrated=False),  # round to nearest, a scale per output channel
    QuantAlgo("W4A16", 4, calibrated=False),  # round to nearest, a scale (and zero) per group
    QuantAlgo("W4A16_AWQ", 4, calibrated=True, prequant=True),  # activation-aware scales
    QuantAlgo("W4A8_AWQ", 4, calibrated=True, prequant=True, activation_scale=True),  # + FP8 inputs
    QuantAlgo("W4A16_GPTQ", 4, calibrated=True),  # GPTQ rounding, or imported from a GPTQ checkpoint
    # importance-weighted scale/offset search; recorded as MIXED_PRECISION (kiln.quantization.imatrix)
    QuantAlgo("W4A16_IMATRIX", 4, calibrated=True, group_size=32),  # 32 measures far better than 64
    QuantAlgo("FP8", 8, calibrated=True, weight_only=False, activation_scale=True),  # e4m3, per tensor
    QuantAlgo("W8A8_SQ_PER_CHANNEL", 8, calibrated=True, weight_only=False, bf16_engine=False),  # SmoothQuant
)}
KV_CACHE_QUANT_ALGOS = ("FP8", "INT8")
# Each quantized linear in its own weight-only format (an imported GGUF file's mix of types), listed
# in QuantConfig.quantized_layers (TensorRT-LLM's name and shape for per-layer precision).
MIXED_PRECISION = "MIXED_PRECISION"
# The formats a layer of a MIXED_PRECISION checkpoint may have -> their code bits (W6A16: GGUF's Q6_K
# blocks as they are, an import only).
LAYER_ALGOS = {"W8A16": 8, "W6A16": 6, "W4A16": 4}
