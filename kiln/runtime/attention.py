"""Attention backends over the paged KV cache.

``TorchPagedAttention`` is the reference: plain PyTorch (scaled_dot_product_attention),
correct for any mix of prompt chunks and generation tokens. Generation tokens (one query
each) of all sequences are batched into one padded call; prompt chunks run one call each.
``NativePagedAttention`` runs the generation tokens through a C kernel that reads the
paged cache in place instead of gathering it (``kiln.kernels``).

KV cache of one layer: ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads,
head_size]``. For the reference backend, which reads whole blocks under a mask, blocks are
zeroed when allocated, so it never meets stale NaN/inf values past a sequence's end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.kernels import paged_decode_attention, supports_decode_attention
from kiln.runtime.metadata import AttentionMetadata


class TorchPagedAttention:
    name = "torch"
    reads_whole_blocks = True  # decode gathers whole blocks: their unwritten tails must be zeroed

    def prepare(self, md: AttentionMetadata) -> None:
        """Per-step index tensors shared by every layer."""
        decode = [i for i, q in enumerate(md.query_lens) if q == 1]
        chunks = [i for i, q in enumerate(md.query_lens) if q != 1]
        bs = md.block_size
        st = md.backend_state
        if decode:
            self._prepare_decode(md, decode)
        st["chunks"] = []
        for i in chunks:
            q_len, s_len = md.query_lens[i], md.seq_lens[i]
            start = md.query_start_loc[i]
            # Cached context before this chunk must be read back; a whole fresh prompt need not.
            slots = None if q_len == s_len else _seq_slots(md.block_tables[i], s_len, bs)
            mask = None
            if q_len != s_len:
                q_pos = torch.arange(s_len - q_len, s_len)[:, None]
                mask = torch.arange(s_len)[None, :] <= q_pos  # [q_len, s_len]
            st["chunks"].append((start, start + q_len, slots, mask))

    def _prepare_decode(self, md: AttentionMetadata, decode: list[int]) -> None:
        bs, st = md.block_size, md.backend_state
        # Whole blocks are gathered (contiguous copies, much cheaper than token slots);
        # padding repeats a row's first block and everything past seq_len is masked.
        max_blocks = max(-(-md.seq_lens[i] // bs) for i in decode)
        tables = torch.tensor([(md.block_tables[i][: -(-md.seq_lens[i] // bs)] + [md.block_tables[i][0]] * max_blocks)
                               [:max_blocks] for i in decode], dtype=torch.int64)
        lens = torch.tensor([md.seq_lens[i] for i in decode])
        st["decode_tokens"] = torch.tensor([md.query_start_loc[i] for i in decode])
        st["decode_blocks"] = tables  # [num_decode, max_blocks]
        st["decode_mask"] = (torch.arange(max_blocks * bs)[None, :] < lens[:, None])[:, None, None, :]

    def _decode(self, q: torch.Tensor, kv_cache, st: dict, out: torch.Tensor, scale: float) -> None:
        k_cache, v_cache = kv_cache
        num_kv_heads, head = k_cache.shape[2], k_cache.shape[3]
        idx, tables = st["decode_tokens"], st["decode_blocks"]
        n = tables.shape[0]
        kd = k_cache[tables].view(n, -1, num_kv_heads, head).transpose(1, 2)  # [n, kv_heads, max_len, head]
        vd = v_cache[tables].view(n, -1, num_kv_heads, head).transpose(1, 2)
        qd = q[idx].unsqueeze(2)  # [n, heads, 1, head]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=st["decode_mask"], scale=scale,
                                           enable_gqa=q.shape[1] != num_kv_heads)
        out[idx] = o.squeeze(2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, md: AttentionMetadata,
                scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head]; k, v: [num_tokens, num_kv_heads, head]
        k_cache, v_cache = kv_cache
        num_kv_heads, head = k.shape[1], k.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head)
        flat_v = v_cache.view(-1, num_kv_heads, head)
        flat_k.index_copy_(0, md.slot_mapping, k)
        flat_v.index_copy_(0, md.slot_mapping, v)
        out = torch.empty(q.shape, dtype=q.dtype)
        st = md.backend_state
        if "decode_tokens" in st:
            self._decode(q, kv_cache, st, out, scale)
        group = q.shape[1] // num_kv_heads
        for start, end, slots, mask in st["chunks"]:
            kc, vc = (k[start:end], v[start:end]) if slots is None else (flat_k[slots], flat_v[slots])
            if group > 1:
                # PyTorch's CPU flash-attention kernel takes neither enable_gqa nor 3-D inputs (both
                # fall back to the math path, 4-15x slower): expand KV heads and add a batch dim.
                kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
            qc, kc, vc = (t.transpose(0, 1).unsqueeze(0) for t in (q[start:end], kc, vc))  # [1, heads, len, head]
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, is_causal=mask is None, scale=scale)
            out[start:end] = o[0].transpose(0, 1)
        return out


def _seq_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """Cache slots of a sequence's first ``length`` tokens."""
    blocks = torch.tensor(block_table[: (length + block_size - 1) // block_size], dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)
    return slots[:length]


class NativePagedAttention(TorchPagedAttention):
    """Generation tokens read K/V in place through the native kernel (``kiln.kernels``);
    prompt chunks, which are matmul-bound, keep the PyTorch path."""
    name = "native"
    reads_whole_blocks = False  # the kernel stops at each sequence's length; chunks read their slots

    def _prepare_decode(self, md: AttentionMetadata, decode: list[int]) -> None:
        st = md.backend_state
        max_blocks = max(-(-md.seq_lens[i] // md.block_size) for i in decode)
        # Rows are padded with block 0; the kernel never reads past a sequence's length.
        st["decode_blocks"] = torch.tensor([(md.block_tables[i] + [0] * max_blocks)[:max_blocks] for i in decode],
                                           dtype=torch.int64)
        st["decode_tokens"] = torch.tensor([md.query_start_loc[i] for i in decode], dtype=torch.int64)
        st["decode_lens"] = torch.tensor([md.seq_lens[i] for i in decode], dtype=torch.int64)

    def _decode(self, q: torch.Tensor, kv_cache, st: dict, out: torch.Tensor, scale: float) -> None:
        k_cache, v_cache = kv_cache
        paged_decode_attention(q, k_cache, v_cache, st["decode_tokens"], st["decode_blocks"],
                               st["decode_lens"], out, scale, check=False)


BACKENDS = {TorchPagedAttention.name: TorchPagedAttention, NativePagedAttention.name: NativePagedAttention}


def select_backend(name: str, dtype: torch.dtype) -> str:
    """Resolve ``auto``: the native backend where its kernel builds and supports ``dtype``."""
    if name == "auto":
        return NativePagedAttention.name if supports_decode_attention(dtype) else TorchPagedAttention.name
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend: unknown backend {name!r}; choose auto, {', '.join(BACKENDS)}")
    if name == NativePagedAttention.name and not supports_decode_attention(dtype):
        raise ConfigError(f"attention_backend: the native kernel is unavailable for {dtype} on this machine")
    return name
