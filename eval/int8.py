"""Weight-only int8 linears: one quantisation and one matmul for every int8 weight in draftsmith (the
int8 draft's layers, eval/drafts.py, and the Medusa proposer's head copies, eval/proposers/medusa.py).

Each output row n keeps a scale s_n = max |w_n| / 127 (float32) and q = round(w / s_n) in [-127, 127];
activations stay in their dtype. Written by hand because the library routes lose here: torch.ao's
`quantize_dynamic` also quantizes activations per tensor, which the residual stream's outliers do not
survive, and dequantizing the weight per call reads more memory than bf16 (docs/reference/kernels.md).

The matmul, by where it runs:
  CPU bf16, at most I8_MAX_ROWS rows, where this project's kernels build: `linear_i8` (eval/csrc), the
      int8 pairs widened to bf16 in registers, float32 sums, y = s * sum + b rounded to bf16;
  otherwise `exact` when given (the bf16 weight the copy was taken from: proposals at many rows are
      worth the full precision), else ATen's int8-weight matmul on CPU (`_weight_int8pack_mm`, the
      kernel behind gpt-fast's int8 path) or the dequantized weight elsewhere.
Only drafts use these weights: verification, and so the output, never sees them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cpu import small_gemm

I8_MAX_ROWS = 4  # linear_i8's row limit: a draft proposes at 1-2 rows a call at batch 1
_MIN_SCALE = 1e-30  # an all-zero row: q = 0 whatever its scale


@torch.no_grad()
def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q [out, in] int8, scale [out] float32) with W ≈ q * scale[:, None]: symmetric,
    per output row. The same numbers as the kernel's own `pack_i8`."""
    w = weight.detach().float()  # [out, in]
    s = (w.abs().amax(1) / 127.0).clamp(min=_MIN_SCALE)  # [out]
    q = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, s


def _kernel_pack(q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None):
    """(q [N, K], s [N], bias [N]) -> linear_i8's arguments (q blocks [ceil(N/16), K/2, 16, 2] int8, scale
    [Nb * 16] float32, bias [Nb * 16] float32 or empty, N), rows zero-padded to whole blocks of 16; or
    None where the kernel cannot run this weight."""
    ext = small_gemm()
    N, K = q.shape
    if ext is None or q.device.type != "cpu" or K % 2:
        return None
    n_pad = (N + 15) // 16 * 16
    qp = q.new_zeros(n_pad, K)
    qp[:N] = q
    blocks = qp.view(n_pad // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()
    sp = torch.full((n_pad,), _MIN_SCALE)
    sp[:N] = s.float()
    bp = torch.empty(0)
    if bias is not None:
        bp = torch.zeros(n_pad)
        bp[:N] = bias.float()
    return blocks, sp, bp, N


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T (+ bias): a weight-only int8 linear (see the module doc for the matmul).

    exact: an optional callable x -> y on the original weight, used where the int8 kernel does not run
    (more than I8_MAX_ROWS rows, not CPU bf16, or no kernel); pack=False skips the kernel's copy (views
    that are never called, e.g. `rows`)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 exact: Callable[[torch.Tensor], torch.Tensor] | None = None, pack: bool = True):
        super().__init__()
        self.register_buffer("weight", qweight)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out] float32
        self.register_buffer("bias", bias)  # [out] or None
        self.out_features, self.in_features = qweight.shape
        self.exact = exact
        self.packed = _kernel_pack(qweight, scales, bias) if pack else None

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype=None,
                 exact: Callable | None = None, pack: bool = True) -> "Int8Linear":
        """An int8 copy of `weight` [out, in]; the bias is kept in `dtype` (default: the weight's)."""
        q, s = quantize(weight)
        b = None if bias is None else bias.detach().to(dtype or weight.dtype)
        return cls(q, s, b, exact, pack)

    @classmethod
    def cat(cls, parts: list["Int8Linear"]) -> "Int8Linear":
        """Several linears over the same input as one (rows stacked): the fused q|k|v or gate|up."""
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return cls(torch.cat([p.weight for p in parts]), torch.cat([p.scales for p in parts]), bias)

    def rows(self, start: int, end: int) -> "Int8Linear":
        """Rows start..end as views (no copy): the q, k, v parts of a fused q|k|v."""
        return Int8Linear(self.weight[start:end], self.scales[start:end],
                          None if self.bias is None else self.bias[start:end], pack=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // x.shape[-1]  # host ints only
        if self.packed is not None and rows <= I8_MAX_ROWS and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            q, s, b, n_out = self.packed
            y = small_gemm().linear_i8(x.reshape(rows, -1).contiguous(), q, s, b, n_out)
            return y.view(*x.shape[:-1], n_out)
        if self.exact is not None:
            return self.exact(x)
        s = self.scales.to(x.dtype)
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), self.weight, s)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * s
        return y if self.bias is None else y + self.bias.to(x.dtype)
