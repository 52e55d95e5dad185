"""Fused native elementwise kernels (RMSNorm, SiLU-and-multiply, rotary) and the batch-1 bf16
GEMV against eager PyTorch."""
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


def test_rotary_rejects_non_contiguous_heads():
    x = _randn(4, 16, 2, dtype=torch.float32).transpose(1, 2)
    cos = sin = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="contiguous heads"):
        kernels.rotary_(x, cos, sin, 16)


@pytest.mark.parametrize("n,k", [(7, 5), (64, 576), (33, 100), (130, 64)])  # tails of 4 rows and 32 dims
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_linear(n, k, with_bias, dtype):
    x = _randn(1, k, dtype=dtype, seed=n)
    w = _randn(n, k, dtype=dtype, seed=k)
    bias = _randn(n, dtype=dtype, seed=3) if with_bias else None
    expected = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    got = kernels.gemv(x, w, bias)
    assert got.dtype == dtype and got.shape == (1, n)
    tol = dict(atol=2e-2 * k ** 0.5, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5 * k ** 0.5, rtol=1e-5)
    torch.testing.assert_close(got.double(), expected, **tol)


def test_gemv_is_used_for_one_row_only_and_rejects_the_rest():
    from kiln.layers.linear import ColumnLinear

    w = _randn(48, 40, dtype=torch.bfloat16)
    assert kernels.gemv_supported(_randn(1, 40, dtype=torch.bfloat16), w, None)
    assert not kernels.gemv_supported(_randn(2, 40, dtype=torch.bfloat16), w, None)
    assert not kernels.gemv_supported(_randn(1, 40, dtype=torch.float32), w, None)  # mixed dtypes
    with pytest.raises(ValueError, match="gemv"):
        kernels.gemv(_randn(2, 40, dtype=torch.bfloat16), w)
    layer = ColumnLinear(40, 48, bias=False, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    x = _randn(1, 40, dtype=torch.bfloat16, seed=9)
    torch.testing.assert_close(layer(x), kernels.gemv(x, w), atol=0, rtol=0)
