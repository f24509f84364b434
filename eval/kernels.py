"""This project's hand-written CPU kernels (eval/csrc/small_gemm.cpp) and their build, one module per
CPU path (eval/cpu.py picks the path): bf16 matmuls that stream each weight once whatever the row count,
fp32 attention whose sums do not depend on the other query rows, and a Llama layer's elementwise steps
fused (residual add + RMSNorm, RoPE, SiLU * up), each row on its own.

Why by hand: a verify forward of 2-16 tokens is bandwidth-bound, like a one-token step, but neither
PyTorch's native GEMV (fast at one row, slow at many), oneDNN's bf16 matmul nor inductor has a
small-M bf16 path that streams the weights once at full bandwidth, and on CPUs without AVX-512 oneDNN
has no bf16 matmul at all (docs/reference/kernels.md). The kernel keeps all rows' accumulators in
registers, reads each weight once, and sums each output in the same order whatever the row count, so a
verify forward's matmuls round exactly like a one-token step's. The attention sums each row over its
own visible cache slots in slot order, for the same reason (eval/target.py). The elementwise kernels
exist because at 1-16 rows a layer's ~20 ATen elementwise ops cost more in dispatch and temporaries
than in arithmetic, and no PyTorch op fuses them on CPU without a compiler.

`build(path)` compiles the source for one path once per machine and torch installation (cached under
`eval.loading.cache_dir()`/ext) with torch's own extension builder.
"""

from __future__ import annotations

import functools
import hashlib
import time
import warnings
from pathlib import Path

import torch

from .loading import cache_dir

MAX_ROWS = 16  # the most tokens a row verifies through the attention kernel (row-invariant verifies)
SOURCE = Path(__file__).parent / "csrc" / "small_gemm.cpp"
# Compiler flags per CPU path; the source picks its instructions from them (DS_AVX512 in small_gemm.cpp).
FLAGS = {
    "amx-bf16": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp"],
    "avx512-bf16": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-fopenmp"],
}


STALE_LOCK_S = 600  # a build takes 30-90 s on 2 cores; an older lock is a killed build's


def build_dir(path: str, source: Path | None = None) -> Path:
    """Where `path`'s module is built: one directory per path, torch installation and checkout. The module
    links against that torch, and its build file names the source, so two venvs or two checkouts sharing a
    directory would rebuild it each time they alternate."""
    src = (source or SOURCE).resolve()
    key = f"{torch.__version__}:{Path(torch.__file__).resolve()}:{src}"
    return cache_dir() / "ext" / f"{module_name(path, source)}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def module_name(path: str, source: Path | None = None) -> str:
    """The Python module `path`'s build is imported as; another source (an older version of the kernels,
    measured beside these by `eval.cpu_bench --against`) gets a name of its own, keyed by its text."""
    name = "draftsmith_kernels_" + path.replace("-", "_")
    return name if source is None else f"{name}_{hashlib.sha1(Path(source).read_bytes()).hexdigest()[:10]}"


def _clear_stale_lock(lock: Path) -> None:
    """torch's extension builder waits, without end, while its lock file exists; a build killed mid-way
    (a timed-out CI job) leaves one behind, and every later process would hang at its first forward."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"draftsmith: removing {lock}, left {age / 60:.0f} min ago by a kernel build that did not finish")
        lock.unlink(missing_ok=True)


class KernelBuildError(RuntimeError):
    """The kernels of a path did not build here (no compiler, no ninja, an old assembler)."""


@functools.lru_cache(maxsize=None)
def build(path: str, source: Path | None = None):
    """The compiled module of `path` (a FLAGS key): `pack(w)`, `linear(x, packed, bias, n_out)`,
    `attend(q, k, v, vis, scale)`, `add_rmsnorm(x, y, w, eps)`, `silu_mul(gate_up)`, `rope(x, n, cos, sin)`,
    `argmax_rows(x)`, `layer(...)`, `pack_i8(w)`, `linear_i8(...)`. Raises KernelBuildError when it does
    not build. Compiling does not need the CPU to run the path, but importing the module does: its
    initialisers are compiled with the path's flags, so an AVX2-only CPU loading the AVX-512 build dies of
    SIGILL. Ask eval.cpu.runs(path) first, as eval/cpu.py does. `source`: another version of small_gemm.cpp
    (default: this checkout's), built under a module name of its own."""
    from torch.utils.cpp_extension import load  # imported here: it pulls in setuptools

    out = build_dir(path, source)
    out.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(out / "lock")
    try:
        return load(module_name(path, source), [str(source or SOURCE)], extra_cflags=FLAGS[path],
                    build_directory=str(out), verbose=False)
    except Exception as e:  # no compiler, no ninja, an old assembler
        first = str(e).splitlines()[0] if str(e) else ""
        raise KernelBuildError(f"the {path} kernels did not build ({type(e).__name__}: {first}): install a C++ "
                               "compiler and `pip install ninja`") from e
