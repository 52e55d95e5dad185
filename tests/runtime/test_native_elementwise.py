"""Fused native elementwise kernels (RMSNorm, SiLU-and-multiply, rotary, greedy argmax) and the
batch-1 bf16 GEMV against eager PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import kernels
from kiln.layers.normalization import RmsNorm
from kiln.layers.rotary import RotaryEmbedding


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rmsnorm_matches_eager(dtype, rows):
    norm = RmsNorm(72, 1e-5, dtype=dtype)
    norm.weight = torch.nn.Parameter(_randn(72, dtype=dtype, seed=1), requires_grad=False)
    wide = _randn(rows, 100, dtype=dtype)
    x = wide[:, 10:82]  # strided rows, as a view into a wider tensor
    if dtype == torch.float32:
        expected = F.rms_norm(x, (72,), norm.weight, 1e-5)
    else:  # Hugging Face's bf16 rounding: normalise in fp32, round, then scale
        expected = F.rms_norm(x.float(), (72,), None, 1e-5).to(dtype) * norm.weight
    got = kernels.rmsnorm(x, norm.weight, 1e-5)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    torch.testing.assert_close(norm(x), expected, **TOL[dtype])  # the layer takes the native path


@pytest.mark.parametrize("rows,n", [(1, 49152), (3, 100), (20, 65), (2, 1)])
def test_argmax_rows_matches_torch(rows, n):
    x = _randn(rows, n, dtype=torch.float32, seed=rows)
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_takes_the_first_maximum_or_nan_as_torch_does():
    x = _randn(5, 300, dtype=torch.float32)
    x[0, 7] = x[0, 250] = 100.0  # a tie: the first
    x[1, 120] = float("nan")  # a NaN wins, the first of them
    x[1, 200] = float("nan")
    x[1, 5] = float("inf")
    x[2] = float("-inf")  # nothing above -inf: index 0
    x[3, 299] = float("inf")  # the last column
    x[4, 64] = 50.0  # the first of a 64-wide chunk
    assert kernels.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [7, 120, 0, 299, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 20])
def test_silu_mul_matches_eager(dtype, rows):
    both = _randn(rows, 2 * 48, dtype=dtype) * 3
    gate, up = both.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(both), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
@pytest.mark.parametrize("tokens", [1, 17])
def test_rotary_in_place_matches_eager(dtype, rotary_dim, tokens):
    rope = RotaryEmbedding(rotary_dim, 10000.0, 256)
    positions = torch.arange(5, 5 + tokens)
    cos, sin = rope.cos_sin(positions)
    qkv = _randn(tokens, 3 * 16 + 2 * 16, dtype=dtype)  # q: 3 heads, k: 1 head, v: 1 head of 16
    q = qkv[:, :48].view(tokens, 3, 16)
    k = qkv[:, 48:64].view(tokens, 1, 16)
    v_before = qkv[:, 64:].clone()
    q_expected = rope.apply(q.float(), cos, sin).to(dtype)
    k_expected = rope.apply(k.float(), cos, sin).to(dtype)
    assert kernels.rotary_(q, cos, sin, rotary_dim) is q
    kernels.rotary_(k, cos, sin, rotary_dim)
    torch.testing.assert_close(q, q_expected, **TOL[dtype])
    torch.testing.assert_close(k, k_expected, **TOL[dtype])
    assert torch.equal(qkv[:, 64:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_of_the_last_dims_of_each_head(dtype):
    """start: MLA's heads hold their rotary dims after the others (q_nope then q_pe)."""
    rope = RotaryEmbedding(8, 10000.0, 256)
    cos, sin = rope.cos_sin(torch.arange(3, 6))
    q = _randn(3, 2, 24, dtype=dtype)
    expected = torch.cat([q[..., :16], rope.apply(q[..., 16:].float(), cos, sin).to(dtype)], dim=-1)
    kernels.rotary_(q, cos, sin, 8, start=16)
    torch.testing.assert_close(q, expected, **TOL[dtype])
    with pytest.raises(ValueError, match="rotated dims"):
        kernels.rotary_(q, cos, sin, 8, start=17)


def test_rotary_rejects_non_contiguous_heads():
    x = _randn(4, 16, 2, dtype=torch.float32).transpose(1, 2)
    cos = sin = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="contiguous heads"):
        kernels.rotary_(x, cos, sin, 16)


@pytest.mark.parametrize("n,k", [(7, 5), (64, 576), (33, 100), (130, 64)])  # tails of 4 rows and 32 dims
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 4, 9, 16])  # token tiles of 4, and their tails
def test_skinny_linear_matches_linear(n, k, with_bias, dtype, m):
    x = _randn(m, k, dtype=dtype, seed=n)
    w = _randn(n, k, dtype=dtype, seed=k)
    bias = _randn(n, dtype=dtype, seed=3) if with_bias else None
    expected = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    got = kernels.skinny_linear(x, w, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = dict(atol=2e-2 * k ** 0.5, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5 * k ** 0.5, rtol=1e-5)
    torch.testing.assert_close(got.double(), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("n,k", [(70, 24), (16, 130)])  # a row block of 64 and a tail; k tails
def test_head_linear_matches_per_head_matmul_on_strided_views(dtype, m, n, k):
    """Per head x[t, h] @ w[h]^T, x a head-split view of a wider row (as q_nope is of q), the
    result into a slice of a wider buffer (as the latent query's first part); the rest is kept."""
    heads = 3
    wide = _randn(m, heads, k + 8, dtype=dtype)
    x, w = wide[..., :k], _randn(heads, n, k, dtype=dtype)
    out = torch.full((m, heads, n + 5), 7.0, dtype=dtype)
    kernels.head_linear(x, w, out[..., :n])
    expected = torch.einsum("thk,hnk->thn", x.float(), w.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[..., :n].float(), expected, atol=tol * k ** 0.5, rtol=tol)
    assert (out[..., n:] == 7.0).all()


def test_skinny_linear_takes_few_rows_only_and_rejects_the_rest():
    from kiln.layers.linear import ColumnLinear

    w = _randn(48, 40, dtype=torch.bfloat16)
    assert kernels.skinny_linear_supported(_randn(1, 40, dtype=torch.bfloat16), w, None)
    assert kernels.skinny_linear_supported(_randn(kernels.SKINNY_MAX_ROWS, 40, dtype=torch.bfloat16), w, None)
    assert not kernels.skinny_linear_supported(_randn(kernels.SKINNY_MAX_ROWS + 1, 40, dtype=torch.bfloat16), w, None)
    assert not kernels.skinny_linear_supported(_randn(1, 40, dtype=torch.float32), w, None)  # mixed dtypes
    with pytest.raises(ValueError, match="skinny_linear"):
        kernels.skinny_linear(_randn(kernels.SKINNY_MAX_ROWS + 1, 40, dtype=torch.bfloat16), w)
    layer = ColumnLinear(40, 48, bias=False, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    x = _randn(1, 40, dtype=torch.bfloat16, seed=9)
    torch.testing.assert_close(layer(x), kernels.skinny_linear(x, w), atol=0, rtol=0)


@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (80, 96), (64, 576)])  # 1-5 output blocks: full and tail panels
@pytest.mark.parametrize("m", [1, 5, 12, 16, 17, 40])  # row blocks of 16 (AMX) and 12 (AVX512-BF16), tails
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("portable", [False, True])
def test_packed_linear_matches_linear(n, k, m, with_bias, portable):
    # This machine multiplies bf16 in hardware (AMX or AVX512-BF16); `portable` is the plain-C loop.
    assert kernels.packed_linear_available()
    x = _randn(m, k, dtype=torch.bfloat16, seed=m)
    w = _randn(n, k, dtype=torch.bfloat16, seed=n + k)
    bias = _randn(n, dtype=torch.bfloat16, seed=5) if with_bias else None
    expected = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    got = kernels.packed_linear(x, kernels.pack_bf16(w), bias, n, portable=portable)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), expected, atol=2e-2 * k ** 0.5, rtol=1e-2)


def test_pack_layout_and_rejections():
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)
    packed = kernels.pack_bf16(w).view(2, 2, 16, 16, 2)  # [n block][k block][k pair][column][pair element]
    assert packed[1, 1, 3, 5, 1] == w[16 + 5, 32 + 2 * 3 + 1]
    assert torch.equal(kernels.unpack_bf16(kernels.pack_bf16(w)), w)
    out = torch.empty(w.numel(), dtype=torch.bfloat16)
    got = kernels.pack_bf16(w, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, kernels.pack_bf16(w))
    assert not kernels.packed_supported(torch.zeros(24, 64, dtype=torch.bfloat16))  # n not a multiple of 16
    assert not kernels.packed_supported(torch.zeros(32, 40, dtype=torch.bfloat16))  # k not a multiple of 32
    assert not kernels.packed_supported(torch.zeros(32, 64, dtype=torch.float32))
    with pytest.raises(ValueError, match="pack_bf16"):
        kernels.pack_bf16(torch.zeros(24, 64, dtype=torch.bfloat16))


def test_kernels_write_into_a_given_output_and_check_it():
    x, w = _randn(3, 64, dtype=torch.bfloat16), _randn(32, 64, dtype=torch.bfloat16, seed=2)
    out = torch.empty(3, 32, dtype=torch.bfloat16)
    assert kernels.packed_linear(x, kernels.pack_bf16(w), None, 32, out=out) is out
    torch.testing.assert_close(out, kernels.packed_linear(x, kernels.pack_bf16(w), None, 32), atol=0, rtol=0)
    one = torch.empty(1, 32, dtype=torch.bfloat16)
    assert kernels.skinny_linear(x[:1], w, out=one) is one
    with pytest.raises(ValueError, match="out"):
        kernels.skinny_linear(x[:1], w, out=torch.empty(1, 31, dtype=torch.bfloat16))


def test_kernels_run_the_same_after_the_thread_pool_is_released_and_on_another_thread():
    import threading

    x, w = _randn(5, 64, dtype=torch.bfloat16), _randn(32, 64, dtype=torch.bfloat16, seed=4)
    expected = kernels.skinny_linear(x, w)
    kernels.release_thread_pool()
    results = []
    worker = threading.Thread(target=lambda: results.append(kernels.skinny_linear(x, w)))
    worker.start()
    worker.join()
    assert torch.equal(results[0], expected) and torch.equal(kernels.skinny_linear(x, w), expected)
