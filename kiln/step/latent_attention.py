"""Attention over a paged latent cache (multi-head latent attention: ``kiln.layers.mla``).

A latent layer's K cache is ``[num_blocks, 1, block_size, kv_lora_rank + rope]`` (each token's
normalised latent and rotated shared key) and its V cache is empty: block tables, prefix caching,
copy-on-write and sliding-window release address it as any other cache. A step writes its tokens'
rows through ``write_slots`` first, then:

* generation tokens (one query each: decode, and the rows of a speculative check) take the
  absorbed path: the query folded into latent space scores the cache rows as they are, its
  output over the latents goes through the value half of ``kv_b_proj`` after. With the native
  backend the rows are read in place by its decode kernel, as a one-KV-head cache whose V is
  the K rows themselves (the output's latent part is kept); with the reference backend each
  sequence's slots are gathered (exactly its own: padding repeats its first slot, masked);
* prompt chunks take the unabsorbed path: the chunk's context rows (its own, or read back from
  the cache for a chunk after the first) expanded into per-head K/V, then causal attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels import paged_decode_attention, supports_decode_attention
from kiln.step.kv_cache import read_slots, write_slots
from kiln.step.metadata import AttentionMetadata

_STATE = "latent_decode"  # the per-step decode indices in AttentionMetadata.backend_state


def latent_attention(attn, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_cache,
                     md: AttentionMetadata) -> torch.Tensor:
    """Attention outputs ``[tokens, heads, v_head]`` of the step's tokens for latent layer ``attn``
    (``q_nope`` ``[tokens, heads, nope]``, rotated ``q_pe`` ``[tokens, heads, rope]``, cache rows
    ``latent`` ``[tokens, kv_lora_rank + rope]``), after writing ``latent`` to the cache."""
    cache = kv_cache[0]
    if cache.dtype != latent.dtype:
        raise ValueError(f"a latent cache holds the model dtype ({latent.dtype}), got {cache.dtype}")
    write_slots(cache, md.slot_index, latent.unsqueeze(1))
    st = md.backend_state
    if _STATE not in st:
        st[_STATE] = _prepare_decode(md)
    decode = st[_STATE]
    if decode is not None and not st["chunks"] and len(decode["tokens"]) == q_nope.shape[0]:  # decode only
        q = attn.absorb_query(q_nope, q_pe)
        return attn.absorb_output(_decode(q, cache, decode, attn.scale, md)[..., :attn.kv_lora_rank])
    out = torch.empty(*q_nope.shape[:2], attn.v_head, dtype=q_nope.dtype)
    if decode is not None:
        rows = decode["tokens"]
        q = attn.absorb_query(q_nope[rows], q_pe[rows])  # [n, heads, kv_lora_rank + rope]
        out[rows] = attn.absorb_output(_decode(q, cache, decode, attn.scale, md)[..., :attn.kv_lora_rank])
    for start, end, slots, mask in st["chunks"]:  # the backend's prompt chunks (kiln.step.attention)
        rows = latent[start:end] if slots is None else read_slots(cache, slots)[:, 0]
        k, v = attn.expand(rows)
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1)
        # PyTorch's fused CPU attention wants values as wide as keys: zeros pad them (its math
        # path held the whole [heads, len, len] score matrix, 9.8 GB and 12 s a layer at 8K)
        v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, len, dim]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scale)
        out[start:end] = o[0, ..., :attn.v_head].transpose(0, 1)
    return out


def _prepare_decode(md: AttentionMetadata) -> dict | None:
    """The step's one-query sequences: their token rows, lengths, block tables (padded with block
    0, for the kernel) and each one's cache slots padded with its first (for the gather), or None."""
    decode = [i for i, q in enumerate(md.query_lens) if q == 1]
    if not decode:
        return None
    bs = md.block_size
    lens = [md.seq_lens[i] for i in decode]
    max_len, max_blocks = max(lens), -(-max(lens) // bs)
    tables = torch.tensor([(md.block_tables[i] + [0] * max_blocks)[:max_blocks] for i in decode], dtype=torch.int64)
    positions = torch.arange(max_len)
    valid = positions[None, :] < torch.tensor(lens)[:, None]  # [n, max_len]
    padded = torch.where(valid, positions[None, :], 0)
    blocks = tables.gather(1, padded // bs)
    return {"tokens": torch.tensor([md.query_start_loc[i] for i in decode], dtype=torch.int64),
            "lens": torch.tensor(lens, dtype=torch.int64), "tables": tables, "valid": valid,
            "slots": (blocks, padded % bs)}


def _decode(q: torch.Tensor, cache: torch.Tensor, decode: dict, scale: float, md: AttentionMetadata) -> torch.Tensor:
    """Absorbed attention ``[n, heads, kv_lora_rank + rope]`` of the latent queries ``q`` (one per
    decode sequence) over their cached rows, values being the rows themselves."""
    if getattr(md.backend, "name", None) == "native" and supports_decode_attention(q.dtype):
        q = q.contiguous()
        out = torch.empty_like(q)
        paged_decode_attention(q, cache, cache, torch.arange(q.shape[0]), decode["tables"], decode["lens"], out,
                               scale, check=False)
        return out
    blocks, offsets = decode["slots"]
    rows = cache[blocks, 0, offsets]  # [n, max_len, kv_lora_rank + rope]
    scores = torch.matmul(q.float(), rows.float().transpose(1, 2)) * scale  # [n, heads, max_len]
    scores = scores.masked_fill(~decode["valid"][:, None, :], float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(rows.dtype), rows)
