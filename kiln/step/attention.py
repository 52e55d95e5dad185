"""Attention backends over the paged KV cache.

``TorchPagedAttention`` is the reference: plain PyTorch (scaled_dot_product_attention),
correct for any mix of prompt chunks and generation tokens. Generation tokens (one query
each) of all sequences are batched into one padded call; prompt chunks run one call each.
``NativePagedAttention`` runs the generation tokens through a C kernel that reads the
paged cache in place instead of gathering it (``kiln.kernels``).

A layer may ask for more than plain causal attention (``forward``'s keywords): a sliding
window (a query attends to the last ``window`` positions, itself included, as Hugging Face's
``kv_idx > q_idx - window``), attention logit soft-capping (``softcap * tanh(score / softcap)``
after scaling), ALiBi (``slope * (key position - query position)`` added per head) and
attention sinks (gpt-oss: a learned logit per head that joins each softmax's denominator and
takes part of the weight, attending to nothing). Plain
layers keep the fast paths; these go through a masked path (a float mask, or explicit scores
when soft-capped, which scaled_dot_product_attention cannot do).

KV cache of one layer: ``(k_cache, v_cache)``, each ``[num_blocks, num_kv_heads, block_size,
head_size]`` (``kiln.step.kv_cache``). A quantized KV cache (INT8: int8 codes, FP8: float8 e4m3
codes) holds ``x / scale`` rounded to the cache type with the layer's static K and V scales
(``kv_scales``): written quantized, read back dequantized (the native kernel reads the codes and
scales on the fly); a fresh prompt attends to its own unquantized K/V, as the reference's context
phase. For the reference backend, which reads whole blocks under a mask, blocks are zeroed when
allocated, so it never meets stale NaN/inf values past a sequence's end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.kernels import paged_decode_attention, supports_decode_attention
from kiln.step.kv_cache import kv_code_max, read_slots, slot_index, write_slots
from kiln.step.metadata import AttentionMetadata


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
            slots = None if q_len == s_len else slot_index(_seq_slots(md.block_tables[i], s_len, bs), bs)
            mask = None
            if q_len != s_len:
                q_pos = torch.arange(s_len - q_len, s_len)[:, None]
                mask = torch.arange(s_len)[None, :] <= q_pos  # [q_len, s_len]
            st["chunks"].append((start, start + q_len, slots, mask))
        st["relative"] = {}  # chunk or "decode" -> key position - query position (built when needed)

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
        st["decode_lens"] = lens
        st["decode_mask"] = (torch.arange(max_blocks * bs)[None, :] < lens[:, None])[:, None, None, :]

    def _decode(self, q: torch.Tensor, kv_cache, st: dict, out: torch.Tensor, scale: float,
                options: "AttentionOptions", kv_scales: torch.Tensor | None) -> None:
        k_cache, v_cache = kv_cache
        num_kv_heads, head = k_cache.shape[1], k_cache.shape[3]
        idx, tables = st["decode_tokens"], st["decode_blocks"]
        n = tables.shape[0]
        kd, vd = k_cache[tables], v_cache[tables]  # [n, max_blocks, kv_heads, block_size, head]
        if kv_scales is not None:
            kd, vd = dequantize_kv(kd, kv_scales[0], q.dtype), dequantize_kv(vd, kv_scales[1], q.dtype)
        kd = kd.transpose(1, 2).reshape(n, num_kv_heads, -1, head)  # [n, kv_heads, max_len, head]
        vd = vd.transpose(1, 2).reshape(n, num_kv_heads, -1, head)
        qd = q[idx].unsqueeze(2)  # [n, heads, 1, head]
        if options.plain:
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=st["decode_mask"], scale=scale,
                                               enable_gqa=q.shape[1] != num_kv_heads)
        else:
            relative = st["relative"].get("decode")
            if relative is None:  # [n, 1, 1, max_len]: the query is each sequence's last token
                relative = torch.arange(kd.shape[2])[None, :] - (st["decode_lens"] - 1)[:, None]
                relative = st["relative"]["decode"] = relative[:, None, None, :]
            o = _attend(qd, kd, vd, relative, scale, options)
        out[idx] = o.squeeze(2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, md: AttentionMetadata,
                scale: float, *, window: int | None = None, alibi_slopes: torch.Tensor | None = None,
                softcap: float | None = None, kv_scales: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's tokens (after writing their K/V to the cache).

        ``window``: attend to the last ``window`` positions only; ``alibi_slopes``: float32
        ``[num_heads]`` ALiBi slopes of this rank's heads; ``softcap``: attention logit soft-cap;
        ``kv_scales``: float32 ``[2]``, the K and V scales of a quantized (int8 or float8) cache
        (None: a cache of the compute dtype); ``sinks``: float32 ``[num_heads]`` attention sink
        logits of this rank's heads.
        """
        # q: [num_tokens, num_heads, head]; k, v: [num_tokens, num_kv_heads, head]
        options = AttentionOptions(window, alibi_slopes, softcap, sinks)
        k_cache, v_cache = kv_cache
        num_kv_heads = k.shape[1]
        if kv_scales is None:
            write_slots(k_cache, md.slot_index, k)
            write_slots(v_cache, md.slot_index, v)
        else:
            write_slots(k_cache, md.slot_index, quantize_kv(k, kv_scales[0], k_cache.dtype))
            write_slots(v_cache, md.slot_index, quantize_kv(v, kv_scales[1], v_cache.dtype))
        out = torch.empty(q.shape, dtype=q.dtype)
        st = md.backend_state
        if "decode_tokens" in st:
            self._decode(q, kv_cache, st, out, scale, options, kv_scales)
        group = q.shape[1] // num_kv_heads
        for chunk, (start, end, slots, mask) in enumerate(st["chunks"]):
            if slots is None:  # a whole fresh prompt attends to its own unquantized K/V (as the reference's context phase)
                kc, vc = k[start:end], v[start:end]
            elif kv_scales is None:
                kc, vc = read_slots(k_cache, slots), read_slots(v_cache, slots)
            else:  # cached context comes back from the quantized cache
                kc = dequantize_kv(read_slots(k_cache, slots), kv_scales[0], q.dtype)
                vc = dequantize_kv(read_slots(v_cache, slots), kv_scales[1], q.dtype)
            if group > 1:
                # PyTorch's CPU flash-attention kernel takes neither enable_gqa nor 3-D inputs (both
                # fall back to the math path, 4-15x slower): expand KV heads and add a batch dim.
                kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
            qc, kc, vc = (t.transpose(0, 1).unsqueeze(0) for t in (q[start:end], kc, vc))  # [1, heads, len, head]
            if options.plain or options.only_window_beyond(kc.shape[2]):
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, is_causal=mask is None, scale=scale)
            else:
                relative = st["relative"].get(chunk)
                if relative is None:  # [q_len, s_len]: the chunk's queries are the sequence's last tokens
                    q_len, s_len = end - start, kc.shape[2]
                    relative = torch.arange(s_len)[None, :] - torch.arange(s_len - q_len, s_len)[:, None]
                    st["relative"][chunk] = relative
                o = _attend(qc, kc, vc, relative, scale, options)
            out[start:end] = o[0].transpose(0, 1)
        return out


class AttentionOptions:
    """One layer's attention beyond plain causal: sliding window, ALiBi slopes, logit soft-cap,
    attention sinks."""

    __slots__ = ("window", "alibi_slopes", "softcap", "sinks", "plain")

    def __init__(self, window: int | None, alibi_slopes: torch.Tensor | None, softcap: float | None,
                 sinks: torch.Tensor | None = None):
        self.window, self.alibi_slopes, self.softcap, self.sinks = window, alibi_slopes, softcap, sinks
        self.plain = window is None and alibi_slopes is None and softcap is None and sinks is None

    def only_window_beyond(self, length: int) -> bool:
        """Whether the only option is a window no shorter than ``length`` keys (so it changes nothing)."""
        return (self.alibi_slopes is None and self.softcap is None and self.sinks is None
                and self.window is not None and self.window >= length)


_SCORE_FLOATS = 1 << 24  # float32 scores _attend computes at once (64 MB)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, relative: torch.Tensor, scale: float,
            options: AttentionOptions) -> torch.Tensor:
    """Attention of ``q`` ``[b, heads, q_len, head]`` over ``k``/``v`` ``[b, kv_heads, kv_len, head]``
    where ``relative`` (broadcasting to ``[b, 1, q_len, kv_len]``) is each key's position minus its
    query's: causal, windowed, ALiBi-biased and soft-capped as ``options`` say."""
    allowed = relative <= 0
    if options.window is not None:
        allowed = allowed & (relative > -options.window)  # Hugging Face: kv_idx > q_idx - window
    bias = None
    if options.alibi_slopes is not None:
        bias = options.alibi_slopes.view(-1, 1, 1) * relative.to(torch.float32)  # [b, heads, q_len, kv_len]
    if options.softcap is None and options.sinks is None and (bias is None or q.dtype == torch.float32):
        # (A bf16 float mask would round the ALiBi bias; those scores are computed below in fp32.)
        mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if options.sinks is not None and options.softcap is None and bias is None and _FUSED_WITH_LSE is not None:
        return _attend_with_sinks(q, k, v, allowed, scale, options.sinks)
    # Explicit float32 scores for a few query rows at a time: a whole 2K-token prompt's
    # [heads, q_len, kv_len] scores (and their softmax copies) would take gigabytes.
    rows = max(1, _SCORE_FLOATS // (q.shape[0] * q.shape[1] * k.shape[2]))
    if q.shape[2] <= rows:
        return _attend_explicit(q, k, v, allowed, bias, scale, options)
    def query_rows(t: torch.Tensor | None, i: int) -> torch.Tensor | None:  # (a broadcast row stays whole)
        return t if t is None or t.shape[-2] == 1 else t[..., i:i + rows, :]

    return torch.cat([_attend_explicit(q[:, :, i:i + rows], k, v, query_rows(allowed, i), query_rows(bias, i), scale,
                                       options) for i in range(0, q.shape[2], rows)], dim=2)


# PyTorch's fused CPU attention returning each row's log-sum-exp of scores as well.
_FUSED_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                       sinks: torch.Tensor) -> torch.Tensor:
    """``_attend`` with attention sinks through the fused kernel: a sink is one more logit in each
    head's softmax, so the plain softmax's output is scaled by ``exp(lse) / (exp(lse) + exp(sink))``
    = ``sigmoid(lse - sink)`` (``lse`` the row's log-sum-exp of scores, float32). The explicit
    path's float32 scores over a whole 8K context took minutes a layer."""
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    out, lse = _FUSED_WITH_LSE(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    keep = torch.sigmoid(lse - sinks.float().view(1, -1, 1))  # [b, heads, q_len]
    return (out.float() * keep[..., None]).to(q.dtype)


def _attend_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     bias: torch.Tensor | None, scale: float, options: AttentionOptions) -> torch.Tensor:
    """``_attend``'s float32 path, K/V heads already expanded to ``q``'s."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if options.softcap is not None:
        scores = options.softcap * torch.tanh(scores / options.softcap)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    if options.sinks is None:
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
    # The sink is one more logit in each head's softmax; its share of the weight is dropped.
    sink = options.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes of cache type ``dtype`` for K or V ``x`` with its static ``scale``: ``x / scale``
    clamped to the type's range (+-127 int8, +-448 float8 e4m3) and rounded to the nearest code,
    ties to even (int8: ``torch.round``; float8: PyTorch's cast, which rounds to nearest even;
    2.13's cast also saturates, but no version is relied on: the clamp comes first).

    ``x / scale`` is computed as ``x * (1 / scale)`` in float32, the product the native decode
    step computes too (a -ffast-math build turns its division into that anyway), so both paths
    write the same codes; it is within an fp32 rounding of the quotient."""
    limit = kv_code_max(dtype)
    scaled = x.float() * scale.reciprocal()
    if dtype.is_floating_point:
        return scaled.clamp_(-limit, limit).to(dtype)
    return torch.round(scaled).clamp_(-limit, limit).to(dtype)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` in ``dtype`` (int8 or float8 codes, exact in float32; one rounding)."""
    return (codes.float() * scale).to(dtype)


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

    def _decode(self, q: torch.Tensor, kv_cache, st: dict, out: torch.Tensor, scale: float,
                options: AttentionOptions, kv_scales: torch.Tensor | None) -> None:
        k_cache, v_cache = kv_cache
        paged_decode_attention(q, k_cache, v_cache, st["decode_tokens"], st["decode_blocks"],
                               st["decode_lens"], out, scale, window=options.window,
                               alibi_slopes=options.alibi_slopes, softcap=options.softcap, sinks=options.sinks,
                               kv_scales=None if kv_scales is None else kv_scales.tolist(), check=False)


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
