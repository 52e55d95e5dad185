"""The native paged decode-attention kernel (kiln.kernels) against dense PyTorch attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.kernels import paged_decode_attention, supports_decode_attention
from kiln.runtime.attention import select_backend



def _paged_case(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """Random K/V scattered over shuffled blocks, plus the dense per-sequence copies."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g).to(dtype)
    tables, dense = [], []
    for n, nb in zip(seq_lens, blocks_needed):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        idx = torch.tensor(table)
        dense.append((k_cache[idx].reshape(-1, num_kv_heads, head_size)[:n],
                      v_cache[idx].reshape(-1, num_kv_heads, head_size)[:n]))
    max_blocks = max(blocks_needed)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    # Queries live at scattered rows of a larger token batch, as in a mixed step.
    num_tokens = len(seq_lens) * 2 + 1
    q = torch.randn(num_tokens, num_heads, head_size, generator=g).to(dtype)
    rows = torch.randperm(num_tokens, generator=g)[: len(seq_lens)].to(torch.int64)
    return q, k_cache, v_cache, rows, block_tables, torch.tensor(seq_lens, dtype=torch.int64), dense


def _reference(q, rows, dense, scale):
    outs = []
    for row, (k, v) in zip(rows.tolist(), dense):
        qh = q[row].float().unsqueeze(1)  # [heads, 1, head]
        kh, vh = k.float().transpose(0, 1), v.float().transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qh, kh, vh, scale=scale,
                                                   enable_gqa=qh.shape[0] != kh.shape[0]).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 4, 16), (9, 3, 64), (8, 1, 32), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_matches_dense_attention(dtype, num_heads, num_kv_heads, head_size, block_size):
    seq_lens = [1, block_size, block_size + 1, 37, 3 * block_size, 70]
    q, kc, vc, rows, tables, lens, dense = _paged_case(seq_lens, num_heads, num_kv_heads, head_size, block_size,
                                                       dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_size ** -0.5
    paged_decode_attention(q, kc, vc, rows, tables, lens, out, scale)
    expected = _reference(q, rows, dense, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[rows].float(), expected, atol=tol, rtol=tol)
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.isnan(out[untouched]).all()  # rows of other tokens are left alone


@pytest.mark.parametrize("num_seqs", [1, 3, 12])  # few sequences split their context; many do not
@pytest.mark.parametrize("threads", [1, 2])
def test_context_splits_merge_exactly(num_seqs, threads):
    lens = [17 + 23 * i for i in range(num_seqs)]
    q, kc, vc, rows, tables, sl, dense = _paged_case(lens, 9, 3, 64, 4, torch.float32, seed=num_seqs)
    out = torch.empty_like(q)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged_decode_attention(q, kc, vc, rows, tables, sl, out, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out[rows], _reference(q, rows, dense, 0.125), atol=1e-5, rtol=1e-5)


def test_reads_q_from_a_strided_qkv_view():
    q, kc, vc, rows, tables, lens, dense = _paged_case([9, 30], 6, 2, 16, 4, torch.float32, seed=2)
    qkv = torch.cat([q.reshape(q.shape[0], -1), torch.randn(q.shape[0], 64)], dim=1)  # [tokens, q | k | v]
    q_view = qkv[:, :96].view(q.shape[0], 6, 16)
    assert not q_view.is_contiguous()
    out = torch.empty_like(q)
    paged_decode_attention(q_view, kc, vc, rows, tables, lens, out, 0.25)
    torch.testing.assert_close(out[rows], _reference(q, rows, dense, 0.25), atol=1e-5, rtol=1e-5)


def test_large_logits_stay_finite():
    # Scores far apart in magnitude across blocks exercise the online-softmax rescaling.
    q, kc, vc, rows, tables, lens, dense = _paged_case([50, 9], 2, 1, 8, 4, torch.float32, seed=3)
    kc *= 40
    dense = [(k * 40, v) for k, v in dense]
    out = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, rows, tables, lens, out, 1.0)
    torch.testing.assert_close(out[rows], _reference(q, rows, dense, 1.0), atol=1e-4, rtol=1e-4)


def test_rejects_bad_arguments():
    q, kc, vc, rows, tables, lens, _ = _paged_case([5], 4, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(q, kc.to(torch.bfloat16), vc, rows, tables, lens, torch.empty_like(q), 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kc, vc, rows, tables.int(), lens, torch.empty_like(q), 1.0)
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention(q[:, :3].contiguous(), kc, vc, rows, tables, lens, torch.empty(q.shape[0], 3, 8), 1.0)


def test_loading_the_library_keeps_subnormal_floats():
    # -ffast-math at link time would add crtfastmath.o, flushing subnormals process-wide.
    from kiln.kernels import native_library

    assert native_library() is not None
    tiny = torch.tensor(1e-40, dtype=torch.float32)  # subnormal in float32
    assert (tiny * 1.0).item() != 0.0
    assert 2.2250738585072014e-308 / 2 > 0.0


def test_the_kernel_library_builds_here():
    # The test environment has a C compiler (make test runs where gcc is), so the native
    # paths are what the suite exercises; the fallback is covered below.
    assert supports_decode_attention(torch.float32) and supports_decode_attention(torch.bfloat16)


def test_without_native_kernels_every_path_falls_back_to_pytorch(monkeypatch):
    from kiln import kernels

    monkeypatch.setattr(kernels, "native_library", lambda: None)
    assert select_backend("auto", torch.float32) == "torch"
    with pytest.raises(ConfigError, match="unavailable"):
        select_backend("native", torch.float32)
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not kernels.elementwise_supported(x)
    assert not kernels.skinny_linear_supported(x, torch.zeros(4, 8, dtype=torch.bfloat16), None)
    from kiln.layers.normalization import RmsNorm

    norm = RmsNorm(8, 1e-6, dtype=torch.bfloat16)
    norm.weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16), requires_grad=False)
    y = torch.randn(3, 8).to(torch.bfloat16)
    expected = torch.nn.functional.rms_norm(y.float(), (8,), None, 1e-6).to(torch.bfloat16)
    assert torch.equal(norm(y), expected)  # the eager path, same rounding


def test_backend_selection():
    assert select_backend("auto", torch.float32) == "native"
    assert select_backend("auto", torch.float16) == "torch"  # no fp16 kernel: reference path
    assert select_backend("torch", torch.float32) == "torch"
    with pytest.raises(ConfigError, match="attention_backend"):
        select_backend("flash", torch.float32)
    with pytest.raises(ConfigError, match="attention_backend"):
        select_backend("native", torch.float16)

