"""This project's hand-written CPU kernels (eval/csrc/small_gemm.cpp, CPUs with AVX512-BF16): bf16
matmuls of 1-16 rows, fp32 attention whose sums do not depend on the other query rows, and a Llama
layer's elementwise steps fused (residual add + RMSNorm, RoPE, SiLU * up), each row on its own.

Why by hand: a verify forward of 2-16 tokens is bandwidth-bound, like a one-token step, but neither
PyTorch's native GEMV (fast at one row, slow at many), oneDNN's bf16 matmul nor inductor has a
small-M bf16 path that streams the weights once at full bandwidth (docs/reference/kernels.md). This
one keeps all rows' accumulators in registers and reads each weight once, and sums each output in the
same order whatever the row count, so a verify forward's matmuls round exactly like a one-token
step's. The attention sums each row over its own visible cache slots in slot order, for the same
reason (eval/target.py). The elementwise kernels exist because at 1-16 rows a layer's ~20 ATen
elementwise ops cost more in dispatch and temporaries than in arithmetic, and no PyTorch op fuses
them on CPU without a compiler.

`small_gemm()` compiles it once per machine (cached under `eval.loading.cache_dir()`/ext) with
torch's own extension builder, and returns None, so callers fall back to oneDNN, where the CPU lacks
avx512_bf16, no compiler or ninja is found, or DRAFTSMITH_KERNELS=0.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

from .loading import cache_dir

MAX_ROWS = 16  # the kernel's row limit (one accumulator per row and 16 outputs in registers)
SOURCE = Path(__file__).parent / "csrc" / "small_gemm.cpp"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]


def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return False


@functools.lru_cache(maxsize=None)
def small_gemm():
    """The compiled module (`pack(w)`, `linear(x, packed, bias, n_out)`, `attend(q, k, v, vis, scale)`,
    `add_rmsnorm(x, y, w, eps)`, `silu_mul(gate_up)`, `rope(x, n, cos, sin)`), or None where it cannot run."""
    if os.environ.get("DRAFTSMITH_KERNELS", "1") == "0" or not cpu_has_avx512_bf16():
        return None
    from torch.utils.cpp_extension import load  # imported here: it pulls in setuptools

    # One build directory per torch installation: the extension links against that torch, and two
    # venvs sharing one directory would rebuild it each time they alternate.
    tag = hashlib.sha1(f"{torch.__version__}:{Path(torch.__file__).resolve()}".encode()).hexdigest()[:10]
    build = cache_dir() / "ext" / f"small_gemm-{tag}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load("draftsmith_small_gemm", [str(SOURCE)], extra_cflags=FLAGS, build_directory=str(build),
                    verbose=False)
    except Exception as e:  # no compiler, no ninja, an old assembler: oneDNN does the work instead
        warnings.warn(f"draftsmith: the CPU kernels did not build ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); using oneDNN and SDPA (slower verifies, bf16 not bit-exact). "
                      "Install a C++ compiler and `pip install ninja`, or set DRAFTSMITH_KERNELS=0 to silence this.")
        return None
