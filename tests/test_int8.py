"""eval/int8.py: the one weight-only int8 linear. Its quantisation is the kernel's own (`pack_i8`) bit for
bit, its matmul is the dequantized weight's up to one bf16 rounding, and past the kernel's row limit it
falls back to the exact weight when given one (the Medusa proposer's copies), else to ATen's int8
matmul (the int8 draft)."""

import pytest
import torch

from eval.int8 import I8_MAX_ROWS, Int8Linear, quantize
from eval.cpu import packed_linear



@pytest.fixture
def ext(kernel_path):
    return kernel_path.kernels

SHAPES = [(8192, 576, False), (1728, 1152, True), (37, 64, True)]  # 37: a partial block of 16


def _case(n_out, k, bias):
    g = torch.Generator().manual_seed(n_out)
    w = (torch.randn(n_out, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n_out, generator=g).bfloat16() if bias else None
    return w, b, g


def _dequantized(w):
    q, s = quantize(w)
    return q.float() * s[:, None]  # [N, K]


@pytest.mark.parametrize("n_out,k,bias", SHAPES)
def test_quantize_is_per_row_symmetric_within_half_a_step(n_out, k, bias):
    w, _, _ = _case(n_out, k, bias)
    q, s = quantize(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (n_out,)
    assert int(q.abs().max()) == 127 and bool((q.abs().amax(1) == 127).all())  # each row's max maps to 127
    step = w.float().abs().amax(1, keepdim=True) / 127
    assert bool(((_dequantized(w) - w.float()).abs() <= step / 2 + 1e-7).all())
    assert not quantize(torch.zeros(3, 8))[0].any()  # an all-zero row: zeros, no division by zero


@pytest.mark.parametrize("n_out,k,bias", SHAPES)
def test_quantize_is_the_kernels_own(n_out, k, bias, ext):
    """The Medusa proposer's int8 copies were the kernel's `pack_i8`: the same int8 weights and scales."""
    w, b, _ = _case(n_out, k, bias)
    q_k, s_k = ext.pack_i8(w)
    lin = Int8Linear.quantize(w, b)
    q_p, s_p, _, n = lin.packed
    assert n == n_out and torch.equal(q_p, q_k) and torch.equal(s_p[:n_out], s_k[:n_out])


@pytest.mark.parametrize("n_out,k,bias", SHAPES)
def test_kernel_is_the_dequantized_matmul_and_falls_back_to_the_exact_weight(n_out, k, bias, ext):
    w, b, g = _case(n_out, k, bias)
    exact = packed_linear(w, b)
    f = Int8Linear.quantize(w, b, exact=exact)
    deq = _dequantized(w)
    for rows in (1, 2, I8_MAX_ROWS):
        x = torch.randn(1, rows, k, generator=g).bfloat16()
        want = x.float() @ deq.T + (b.float() if bias else 0)
        torch.testing.assert_close(f(x).float(), want, rtol=2 ** -7, atol=1e-4)  # one bf16 rounding
    x = torch.randn(I8_MAX_ROWS + 1, k, generator=g).bfloat16()  # past the limit: the exact bf16 weights
    assert torch.equal(f(x), exact(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_an_exact_weight_every_row_count_is_the_int8_matmul(dtype):
    """The int8 draft's layers have no bf16 weight to fall back to: every row count (a prefill's too)
    computes the dequantized matmul, up to the activations' rounding."""
    w, b, g = _case(37, 64, True)
    f = Int8Linear.quantize(w.float(), b.float(), dtype)
    deq = _dequantized(w.float())
    for rows in (1, I8_MAX_ROWS, I8_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        want = x.float() @ deq.T + b.float()
        got = f(x)
        assert got.dtype == dtype and got.shape == (rows, 37)
        tol = dict(rtol=2 ** -7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.float(), want, **tol)


def test_cat_and_rows_keep_the_fused_layout():
    """q|k|v as one int8 linear, with q, k, v as views of its rows (no copy)."""
    parts = [Int8Linear.quantize(torch.randn(n, 16), None, pack=False) for n in (8, 4, 4)]
    qkv = Int8Linear.cat(parts)
    assert qkv.weight.shape == (16, 16)
    k = qkv.rows(8, 12)
    assert k.weight.data_ptr() == qkv.weight[8:12].data_ptr() and k.packed is None
    x = torch.randn(2, 16)
    torch.testing.assert_close(k(x), parts[1](x), rtol=0, atol=0)
