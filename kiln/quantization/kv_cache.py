"""INT8 KV cache calibration: static per-tensor scales of each layer's K and V.

Reference 002 stores an INT8 KV cache's scales as ``transformer.layers.N.attention.
kv_cache_scaling_factor``. kiln keeps one float32 ``[2]`` tensor per layer: the K scale, then
the V scale, each ``max|x| / 127`` over the calibration prompts, where K is what the cache
holds (after q/k norm and rotary) and V the value projection. The runtime writes
``round(x / scale)`` clamped to +-127 and reads ``code * scale``.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.quantization.calibration import run_prompts
from kiln.runtime.attention import TorchPagedAttention

INT8_MAX = 127.0


class _KVRangeObserver(TorchPagedAttention):
    """The reference backend, recording max|K| and max|V| of each layer it runs (the layer
    announced by a pre-hook on its attention module)."""

    def __init__(self, num_layers: int):
        self.layer = 0
        self.absmax = torch.zeros(num_layers, 2)

    def forward(self, q, k, v, kv_cache, md, scale, **options):
        row = self.absmax[self.layer]
        row[0] = torch.maximum(row[0], k.detach().abs().max().float())
        row[1] = torch.maximum(row[1], v.detach().abs().max().float())
        return super().forward(q, k, v, kv_cache, md, scale, **options)


def calibrate_kv_cache_scales(model: nn.Module, token_lists: list[list[int]], progress: bool = False) -> torch.Tensor:
    """float32 ``[num_layers, 2]``: each layer's ``max|K| / 127`` and ``max|V| / 127`` over the
    prompts, run through the float model (its cache unquantized)."""
    layers = list(model.transformer.layers.values())
    observer = _KVRangeObserver(len(layers))
    handles = [layer.attention.register_forward_pre_hook(lambda m, args, i=i: setattr(observer, "layer", i))
               for i, layer in enumerate(layers)]
    try:
        run_prompts(model, token_lists, progress, backend=observer)
    finally:
        for handle in handles:
            handle.remove()
    # An all-zero range (never seen) keeps a usable scale rather than dividing by zero.
    return torch.where(observer.absmax > 0, observer.absmax, torch.ones(())) / INT8_MAX


def set_kv_cache_scales(model: nn.Module, scales: torch.Tensor) -> None:
    """Give every attention layer its row of ``scales`` as ``kv_cache_scaling_factor``."""
    for layer, row in zip(model.transformer.layers.values(), scales):
        layer.attention.use_kv_cache_scales()
        layer.attention.kv_cache_scaling_factor.data.copy_(row)
