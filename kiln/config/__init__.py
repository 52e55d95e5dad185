"""Configs: the checkpoint's model config, its quantization part, and the build limits."""
from kiln.config.build import BuildConfig
from kiln.config.pretrained import LayerQuant, PretrainedConfig, QuantConfig

__all__ = ["BuildConfig", "LayerQuant", "PretrainedConfig", "QuantConfig"]
