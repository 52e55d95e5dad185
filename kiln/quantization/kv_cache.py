"""KV cache calibration (INT8 and FP8): static per-tensor scales of each layer's K and V.

Reference 002 stores a quantized KV cache's scales as ``transformer.layers.N.attention.
kv_cache_scaling_factor``. kiln keeps one float32 ``[2]`` tensor per layer: the K scale, then
the V scale, each ``max|x|`` over the calibration prompts divided by the cache type's largest
code (127 for INT8, 448 for FP8's float8 e4m3), where K is what the cache holds (after q/k norm
and rotary) and V the value projection. The runtime writes ``x / scale`` clamped to that range
and rounded to the cache type (``kiln.step.attention.quantize_kv``) and reads ``code * scale``.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.quantization.calibration import run_prompts
from kiln.step.attention import TorchPagedAttention
from kiln.step.kv_cache import KV_CACHE_DTYPES, kv_code_max


class KVRangeObserver(TorchPagedAttention):
    """The reference backend, recording max|K| and max|V| of the layer it runs (``layer``, set
    by whoever runs the layers; None records nothing)."""

    def __init__(self, num_layers: int):
        self.layer: int | None = None
        self.absmax = torch.zeros(num_layers, 2)

    def forward(self, q, k, v, kv_cache, md, scale, **options):
        if self.layer is not None:
            row = self.absmax[self.layer]
            row[0] = torch.maximum(row[0], k.detach().abs().max().float())
            row[1] = torch.maximum(row[1], v.detach().abs().max().float())
        return super().forward(q, k, v, kv_cache, md, scale, **options)

    def scales(self, algo: str) -> torch.Tensor:
        """float32 ``[num_layers, 2]``: the ranges seen divided by the largest code of ``algo``'s
        cache type (INT8: 127, FP8: 448); a range never seen keeps a usable scale of 1 / code max."""
        return torch.where(self.absmax > 0, self.absmax, torch.ones(())) / kv_code_max(KV_CACHE_DTYPES[algo])


def calibrate_kv_cache_scales(model: nn.Module, token_lists: list[list[int]], algo: str,
                              progress: bool = False) -> torch.Tensor:
    """float32 ``[num_layers, 2]``: each layer's ``max|K|`` and ``max|V|`` over the prompts, run
    through ``model`` (its cache unquantized), divided by the largest code of ``algo``'s cache
    type (``KVRangeObserver.scales``)."""
    layers = list(model.transformer.layers.values())
    observer = KVRangeObserver(len(layers))
    handles = [layer.attention.register_forward_pre_hook(lambda m, args, i=i: setattr(observer, "layer", i))
               for i, layer in enumerate(layers)]
    try:
        run_prompts(model, token_lists, progress, backend=observer)
    finally:
        for handle in handles:
            handle.remove()
    return observer.scales(algo)


def set_kv_cache_scales(model: nn.Module, scales: torch.Tensor) -> None:
    """Give every attention layer its row of ``scales`` as ``kv_cache_scaling_factor``."""
    for layer, row in zip(model.transformer.layers.values(), scales):
        layer.attention.use_kv_cache_scales()
        layer.attention.kv_cache_scaling_factor.data.copy_(row)
