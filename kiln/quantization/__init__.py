"""Quantization: algorithms that turn float weights into quantized ones, and the model-level
switch of linear layers to their quantized parameters."""
from kiln.layers.quantized_matmul import dequantize
from kiln.quantization.weight_only import (ROUND_TO_NEAREST_ALGOS, SMOOTHQUANT_ALGO, WEIGHT_ONLY_ALGOS, quantize_weight, quantized_modules,
                                           use_weight_only_layout, quantize_model)

__all__ = ["ROUND_TO_NEAREST_ALGOS", "SMOOTHQUANT_ALGO", "WEIGHT_ONLY_ALGOS", "dequantize", "quantize_model", "quantize_weight", "quantized_modules",
           "use_weight_only_layout"]
