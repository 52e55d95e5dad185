"""The native paged decode-attention kernel (kiln.kernels) against dense PyTorch attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.kernels import fp8_to_float, kv_quantize, paged_decode_attention, supports_decode_attention
from kiln.step.attention import (NativePagedAttention, TorchPagedAttention, dequantize_kv, quantize_kv,
                                    select_backend)
from kiln.step.metadata import AttentionMetadata



def _tokens(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` token rows ``[n, kv_heads, head_size]`` held in ``blocks`` of a paged cache."""
    return cache[blocks].transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:n]


def _paged_case(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """Random K/V scattered over shuffled blocks, plus the dense per-sequence copies."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=g).to(dtype)
    tables, dense = [], []
    for n, nb in zip(seq_lens, blocks_needed):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        idx = torch.tensor(table)
        dense.append((_tokens(k_cache, idx, n), _tokens(v_cache, idx, n)))
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (4, 4, 16), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_rows_of_one_sequence_read_its_cache_together(dtype, num_heads, num_kv_heads, head_size, block_size):
    """Rows at consecutive positions of one sequence (a step verifying proposed tokens) form a
    run whose queries share each K/V block; each row still sees only the tokens up to its own
    position: a run of 7 crossing block boundaries, a single row, a run of 3, a run of 17."""
    longest = [block_size * 5 + 2, 9, 3 * block_size, 40]
    q, kc, vc, _, base_tables, _, dense = _paged_case(longest, num_heads, num_kv_heads, head_size, block_size,
                                                      dtype, seed=5)
    runs = [7, 1, 3, 17]
    lens = [n - run + 1 + i for n, run in zip(longest, runs) for i in range(run)]
    seq = [j for j, run in enumerate(runs) for _ in range(run)]
    tables = base_tables[seq].contiguous()
    q = torch.randn(len(lens) + 2, num_heads, head_size).to(dtype)
    rows = torch.randperm(len(lens) + 2)[: len(lens)]
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kc, vc, rows, tables, torch.tensor(lens), out, head_size ** -0.5)
    own = [(dense[j][0][:n], dense[j][1][:n]) for j, n in zip(seq, lens)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[rows].float(), _reference(q, rows, own, head_size ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_row_in_a_run_computes_what_it_computes_alone(dtype, num_heads, num_kv_heads, head_size, block_size):
    """Bit for bit: a step verifying proposals must compute what plain decode steps would, or
    greedy speculation could pick other tokens at near-ties. Lengths 253..259 straddle the end of
    the first 256-token range of context the kernel splits off (RANGE_TOKENS). Head sizes the
    vector kernels take (multiples of 16; a compiler-vectorized loop serves others)."""
    q, kc, vc, _, tables, _, _ = _paged_case([259], num_heads, num_kv_heads, head_size, block_size, dtype, seed=6)
    lens = torch.arange(253, 260)
    q = torch.randn(len(lens), num_heads, head_size, generator=torch.Generator().manual_seed(6)).to(dtype)
    rows, tables = torch.arange(len(lens)), tables.expand(len(lens), -1).contiguous()
    together, alone = torch.empty_like(q), torch.empty_like(q)
    paged_decode_attention(q, kc, vc, rows, tables, lens, together, 0.125)
    for i in range(len(lens)):
        paged_decode_attention(q, kc, vc, rows[i:i + 1], tables[i:i + 1], lens[i:i + 1], alone, 0.125)
    assert torch.equal(together, alone)


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



# -- quantized caches (INT8: int8 codes, FP8: float8 e4m3 codes) -------------------------------

CODE_MAX = {torch.int8: 127, torch.float8_e4m3fn: 448}


def _fp8_finite_codes() -> torch.Tensor:
    """Every float8 e4m3 byte but the two NaNs (0x7F, 0xFF), in byte order."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)


def test_fp8_codes_read_exactly():
    """The kernels' float8 e4m3 reader (16 at a time as K is scored, one by one as V is summed)
    gives PyTorch's value for each of the 254 finite bytes, bit for bit: signed zeros, the 7
    subnormals, 448; and still does with denormals-are-zero set (no step passes through an fp32
    subnormal, which that mode would read as 0)."""
    codes = _fp8_finite_codes()
    expected = codes.float().view(torch.int32)
    assert codes.float().abs().max() == 448 and (expected == torch.tensor(-0.0).view(torch.int32)).any()

    def read_all() -> None:
        # Every byte through the vector loads (runs of 16) and through the scalar reader (short runs).
        assert torch.equal(fp8_to_float(codes).view(torch.int32)[:240], expected[:240])
        for start in range(0, len(codes), 15):
            assert torch.equal(fp8_to_float(codes[start:start + 15]).view(torch.int32), expected[start:start + 15])

    read_all()
    torch.set_flush_denormal(True)  # this thread's MXCSR, which the single-threaded reader runs on
    try:
        read_all()
    finally:
        torch.set_flush_denormal(False)


def _midpoints(dtype: torch.dtype) -> torch.Tensor:
    """The values half way between neighbouring codes of ``dtype`` (exact in float32)."""
    if dtype == torch.int8:
        values = torch.arange(-127, 128, dtype=torch.float64)
    else:
        values = _fp8_finite_codes().double().unique()
    return ((values[:-1] + values[1:]) / 2).float()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_native_codes_equal_quantize_kv(dtype):
    """The codes the native decode step writes (dtypes.h) are quantize_kv's, bit for bit: K/V-like
    values of every size with an awkward scale, ties between codes, values past the range."""
    g = torch.Generator().manual_seed(1)
    values = torch.randn(20000, generator=g) * torch.logspace(-6, 1, 20000)
    top = CODE_MAX[dtype]
    cases = [(values, 0.0173), (values.bfloat16().float(), 0.0173), (_midpoints(dtype), 1.0),
             (torch.tensor([top + 0.4, top * 3.0, 1e30, -top - 0.4, -1e30, 0.0, -0.0, 1e-30]), 1.0)]
    for x, scale in cases:
        ours = kv_quantize(x, scale, dtype)
        ref = quantize_kv(x, torch.tensor(scale), dtype)
        assert ours.dtype == ref.dtype == dtype
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


def _quantized_case(cache_dtype, q_dtype, seq_lens, block_size=16, heads=(9, 3, 64)):
    """A paged case whose caches hold codes (scales from the values' max), with the dense
    dequantized K/V each sequence attends to."""
    num_heads, num_kv_heads, head_size = heads
    q, kc, vc, rows, tables, lens, _ = _paged_case(seq_lens, num_heads, num_kv_heads, head_size, block_size,
                                                   torch.float32, seed=4)
    scales = torch.stack([kc.abs().max(), vc.abs().max()]) / CODE_MAX[cache_dtype]
    kq, vq = quantize_kv(kc, scales[0], cache_dtype), quantize_kv(vc, scales[1], cache_dtype)
    kd, vd = dequantize_kv(kq, scales[0], torch.float32), dequantize_kv(vq, scales[1], torch.float32)
    dense = []
    for table, n in zip(tables.tolist(), seq_lens):
        idx = torch.tensor(table[: -(-n // block_size)])
        dense.append((_tokens(kd, idx, n), _tokens(vd, idx, n)))
    return q.to(q_dtype), kq, vq, rows, tables, lens, scales, dense


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 24)])
def test_quantized_cache_matches_dense_attention(cache_dtype, dtype, heads):
    """The _i8 / _f8 kernels read the codes from the cache (a block at a time, per KV head) and
    equal attention over the dequantized K/V: SmolLM2's head shapes (vector conversion, bf16 dot
    products), and heads of 24 (16 dims converted by vector, 8 one by one; scalar loops)."""
    seq_lens = [1, 16, 17, 37, 48, 70]
    q, kq, vq, rows, tables, lens, scales, dense = _quantized_case(cache_dtype, dtype, seq_lens, heads=heads)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kq, vq, rows, tables, lens, out, 0.125, kv_scales=scales.tolist())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[rows].float(), _reference(q, rows, dense, 0.125), atol=tol, rtol=tol)
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.isnan(out[untouched]).all()
    with pytest.raises(ValueError, match="k_cache"):  # scales with a cache that holds no codes
        paged_decode_attention(q, kq.float(), vq.float(), rows, tables, lens, out, 0.125, kv_scales=scales.tolist())


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_native_backend_equals_reference_backend_on_quantized_caches(cache_dtype):
    """One decode step of four sequences through both backends: the same codes written, and the
    native kernel's attention equals the reference backend's dequantize-then-attend."""
    seq_lens, block_size = [3, 16, 29, 40], 16
    _, kq, vq, _, tables, _, scales, _ = _quantized_case(cache_dtype, torch.float32, seq_lens, block_size)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, heads, 64, generator=g) for heads in (9, 3, 3))
    outputs, caches = [], []
    for backend in (TorchPagedAttention(), NativePagedAttention()):
        cache = (kq.clone(), vq.clone())
        md = AttentionMetadata.build(backend, [1] * 4, seq_lens, tables.tolist(), block_size)
        backend.prepare(md)
        outputs.append(backend.forward(q, k, v, cache, md, 0.125, kv_scales=scales))
        caches.append(cache)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*caches))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
