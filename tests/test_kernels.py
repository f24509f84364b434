"""eval/kernels.py: the small-M bf16 CPU matmul. Its sums must equal an fp32 reference rounded once
to bf16 up to summation order, a row's result must not depend on the other rows in the call (so a
verify forward's matmuls round like one-token steps), and a machine where it cannot build must fall
back to oneDNN with a warning instead of failing."""

import pytest
import torch
import torch.nn.functional as F

import eval.kernels as kernels
from eval.target import _linear

ext = kernels.small_gemm()
needs_kernel = pytest.mark.skipif(ext is None, reason="no avx512_bf16 or no compiler here: oneDNN is used")


def test_builds_where_the_cpu_can_run_it():
    # On a CPU with avx512_bf16 (this project's machines) a silent fallback would hide a broken build.
    if kernels.cpu_has_avx512_bf16() and kernels.os.environ.get("DRAFTSMITH_KERNELS", "1") != "0":
        assert ext is not None


def _case(rows, n_out, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_out, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n_out, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(2, rows, k, generator=g).to(torch.bfloat16)[:1]  # leading dims, as a forward calls it
    return w, b, x


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 12, 13, 16])
@pytest.mark.parametrize("n_out,bias", [(96, False), (37, True), (200, False)])  # 37, 200: a partial block of 16
def test_matches_fp32_reference_up_to_summation_order(rows, n_out, bias):
    w, b, x = _case(rows, n_out, 64, bias, rows * 1000 + n_out)
    got = _linear(w, b)(x)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # exact products, fp32 sums
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, n_out)
    # One bf16 rounding of an fp32 sum: within half a bf16 ulp of the reference plus fp32 reordering.
    assert torch.allclose(got.float(), ref, rtol=2 ** -8, atol=1e-4)
    assert (got == ref.to(torch.bfloat16)).float().mean() > 0.97


@needs_kernel
def test_a_row_rounds_the_same_whatever_the_other_rows():
    w, _, x = _case(9, 3072 // 16, 576, False, 0)
    lin = _linear(w)
    whole = lin(x)  # [1, 9, N]: a verify forward's rows
    alone = torch.cat([lin(x[:, i:i + 1]) for i in range(9)], 1)  # one-token steps
    assert torch.equal(whole, alone)
    assert not torch.equal(lin(x[:, :1]), lin(x[:, 1:2]))  # and it does compute something per row


@needs_kernel
def test_more_rows_than_the_kernel_takes_go_to_onednn():
    w, _, x = _case(kernels.MAX_ROWS + 4, 96, 64, False, 1)
    got = _linear(w)(x)
    assert torch.equal(got, F.linear(x, w))  # oneDNN's packed weight is bit-identical to F.linear


def test_disabled_or_unbuildable_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_KERNELS", "0")
    assert kernels.small_gemm.__wrapped__() is None
    if not kernels.cpu_has_avx512_bf16():
        return
    monkeypatch.setenv("DRAFTSMITH_KERNELS", "1")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))  # never touch the real build cache
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE", bad)
    with pytest.warns(UserWarning, match="did not build"):
        assert kernels.small_gemm.__wrapped__() is None
