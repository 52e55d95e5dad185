"""Per-layer paged K/V tensors.

A layer's K (and V) cache is ``[num_blocks, num_kv_heads, block_size, head_size]``: within a
block each KV head's rows are contiguous, so decode attention, which walks one head's rows
token after token, reads long sequential runs the hardware prefetchers follow (token-major
blocks put a head's rows a whole token row apart: at 32 KV heads of 64, every row on its own
4 KB page, and decode attention read the cache at under half the machine's bandwidth). A token
slot is ``block * block_size + offset``; ``write_slots`` and ``read_slots`` address tokens by
their ``(blocks, offsets)`` (``slot_index``: a step computes it once for all its layers).

A layer may keep V rows of another size than its K rows (``cache_value_size``): multi-head
latent attention (DeepSeek-V2) keeps one "KV head" row per token holding the compressed latent
and the shared rotary key, and no V at all (size 0). Layers may differ in KV heads and head
size (Gemma 4's full layers), and a layer may read an earlier layer's cache instead of keeping
its own (``kv_source``: Gemma 4's KV-shared layers): ``allocate_layer_caches`` gives each layer
its own shape, and such a layer the same tensors as its source.
"""
from __future__ import annotations

import math

import torch

from kiln import host_memory
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError

# Cache element type of each supported ``quantization.kv_cache_quant_algo`` (reference 002).
KV_CACHE_DTYPES = {"FP8": torch.float8_e4m3fn, "INT8": torch.int8}


def kv_cache_dtype(config) -> torch.dtype:
    """The paged cache's element type for a model config: the compute dtype, int8 for an INT8
    KV cache or float8 e4m3 for an FP8 one (K and V stored as ``x / scale`` rounded to the
    cache type, with the layer's static scales)."""
    algo = config.quantization.kv_cache_quant_algo
    if algo is None:
        return torch_dtype(config.dtype)
    if algo not in KV_CACHE_DTYPES:
        raise ConfigError(f"quantization.kv_cache_quant_algo {algo!r} is not implemented; kiln runs "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[algo]


def kv_code_max(dtype: torch.dtype) -> float:
    """The largest code magnitude of a quantized cache type: 127 for int8, 448 for float8 e4m3
    (its largest finite value). A layer's scale maps its calibrated max|x| onto it."""
    return float(torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max)


def indexable(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` itself, or for a float8 cache its bytes as uint8: PyTorch's CPU index_copy_ and
    index_fill_ have no float8 kernels, and moving bytes is all they do here."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, int, int, int]:
    """The shape of one layer's K (or V) cache."""
    return num_blocks, num_kv_heads, block_size, head_size


SlotIndex = tuple[torch.Tensor, torch.Tensor]  # tokens' blocks [n] and offsets within them [n], int64


def slot_index(slots: torch.Tensor, block_size: int) -> SlotIndex:
    """The ``(blocks, offsets)`` of token ``slots`` ``[n]``."""
    return slots // block_size, slots % block_size


def write_slots(cache: torch.Tensor, index: SlotIndex, values: torch.Tensor) -> None:
    """Store ``values`` ``[n, num_kv_heads, head_size]`` (already in the cache's type) at the
    tokens ``index`` addresses."""
    cache[index[0], :, index[1]] = values


def read_slots(cache: torch.Tensor, index: SlotIndex) -> torch.Tensor:
    """The ``[n, num_kv_heads, head_size]`` rows of the tokens ``index`` addresses (a copy)."""
    return cache[index[0], :, index[1]]


def cache_value_size(attention) -> int:
    """The V row size of an attention layer's cache: its head size, or the size the layer declares
    (``cache_value_size``: 0 for multi-head latent attention, which keeps no V)."""
    return getattr(attention, "cache_value_size", attention.head_size)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu",
                      value_size: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` pairs of ``[num_blocks, num_kv_heads, block_size, head_size]`` tensors (the V
    tensors ``value_size`` wide instead, where given: 0 for a latent cache).

    Left uninitialised, so the OS commits memory only as blocks are first written; the
    runner zeroes each block when the scheduler hands it out if the attention backend reads
    whole blocks (``ModelRunner.clear_blocks``).
    On the CPU the tensors are views of one huge-page allocation (see ``host_memory``).
    """
    shape = cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    if value_size is None or value_size == head_size:
        whole = host_memory.empty((num_layers, 2, *shape), dtype, device)
        return [(whole[i, 0], whole[i, 1]) for i in range(num_layers)]
    v_shape = cache_shape(num_blocks, block_size, num_kv_heads, value_size)
    k_numel = math.prod(shape)
    whole = host_memory.empty((num_layers, k_numel + math.prod(v_shape)), dtype, device)
    return [(whole[i, :k_numel].view(shape), whole[i, k_numel:].view(v_shape)) for i in range(num_layers)]


def available_memory_bytes() -> int:
    """Memory the OS reports as available (MemAvailable), or 8 GiB if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                       value_size: int | None = None) -> int:
    """Cache bytes one token takes over all layers (K and V), for cache elements of ``dtype``
    (V rows ``value_size`` wide where given, as ``allocate_kv_cache``)."""
    row = head_size + (head_size if value_size is None else value_size)
    return num_layers * num_kv_heads * row * torch.empty((), dtype=dtype).element_size()


def layer_cache_layout(attentions: list) -> list[tuple[int, int, int] | int]:
    """Per layer (``attentions``: the layers' attention modules, in order): its cache's
    ``(num_kv_heads, head_size, value_size)``, or, for a layer reading another's cache
    (``kv_source``), that layer's position in the list."""
    position = {attn.layer_idx: i for i, attn in enumerate(attentions)}
    layout: list[tuple[int, int, int] | int] = []
    for attn in attentions:
        source = getattr(attn, "kv_source", None)
        if source is not None:
            if source not in position:
                raise ConfigError(f"layer {attn.layer_idx} reads layer {source}'s KV cache, which this rank lacks")
            layout.append(position[source])
        else:
            layout.append((attn.num_kv_heads, attn.head_size, cache_value_size(attn)))
    return layout


def allocate_layer_caches(attentions: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer of ``attentions``, each of the layer's own shape; a layer reading
    another's cache gets that layer's tensors. Layers all alike take ``allocate_kv_cache``'s
    layout (one ``[layers, 2, ...]`` allocation: the native decode step reads it so); otherwise
    the tensors are views of one allocation too, laid end to end."""
    layout = layer_cache_layout(attentions)
    own = [entry for entry in layout if not isinstance(entry, int)]
    if len(own) == len(layout) and len(set(own)) == 1:
        heads, head_size, value_size = own[0]
        return allocate_kv_cache(len(layout), num_blocks, block_size, heads, head_size, dtype, device, value_size)
    shapes = [(cache_shape(num_blocks, block_size, heads, head_size), cache_shape(num_blocks, block_size, heads, value))
              for heads, head_size, value in own]
    whole = host_memory.empty((sum(math.prod(k) + math.prod(v) for k, v in shapes),), dtype, device)
    caches, offset, made = [], 0, iter(shapes)
    for entry in layout:
        if isinstance(entry, int):
            caches.append(caches[entry])
            continue
        k_shape, v_shape = next(made)
        k_end = offset + math.prod(k_shape)
        v_end = k_end + math.prod(v_shape)
        caches.append((whole[offset:k_end].view(k_shape), whole[k_end:v_end].view(v_shape)))
        offset = v_end
    return caches


def layer_cache_bytes_per_token(attentions: list, dtype: torch.dtype) -> int:
    """Cache bytes one token takes over the layers of ``attentions`` (K and V; a layer reading
    another's cache adds nothing), as ``allocate_layer_caches`` lays them out."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(heads * (head_size + value) * size
               for heads, head_size, value in (e for e in layer_cache_layout(attentions) if not isinstance(e, int)))
