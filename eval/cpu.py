"""What this CPU runs, decided once at start-up, and the matmul routes of the lean forward built on it.

Four named paths (docs/reference/kernels.md has each one's figures):
  amx-bf16     the same kernels with the bf16 matmul on AMX tiles (`tdpbf16ps`), for every row count: on
               AMX CPUs (Sapphire Rapids and later) a verify of 16-48 rows then costs about a one-row step;
  avx512-bf16  this project's kernels built for AVX512-BF16 (`vdpbf16ps`), oneDNN's bf16 matmul beside
               them for forwards of more than VDP_MAX_ROWS rows (prefills);
  avx2         the same kernels built for AVX2 + FMA (bf16 weights widened to fp32 in registers), for every
               row count, since oneDNN has no bf16 matmul on such a CPU;
  generic      PyTorch's own ops: oneDNN where its bf16 path runs here, else ATen's.
`cpu_path()` picks the first path this CPU runs whose kernels build. DRAFTSMITH_CPU_PATH=<name> forces one
(an error when this CPU cannot run it) and hides the instructions above it, so a forced `avx2` on an
AVX-512 machine takes the routes an AVX2-only machine takes; DRAFTSMITH_KERNELS=0 is `generic`.
Never call an ISA-specific op without asking this module: oneDNN's bf16 ops, for one, abort on AVX2.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from . import kernels
from .kernels import KernelBuildError

ENV_PATH = "DRAFTSMITH_CPU_PATH"
ENV_KERNELS = "DRAFTSMITH_KERNELS"
PATHS = ("amx-bf16", "avx512-bf16", "avx2", "generic")  # best first
NEEDS = {  # /proc/cpuinfo flags each path's kernels execute
    "amx-bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"),
    "avx512-bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "avx2": ("avx2", "fma"),
    "generic": (),
}
# On avx512-bf16, forwards of up to this many rows (a batch-16 K=3 verify, a batch-32 K=1 one) stay on the
# kernels, so batched verifies round like one-token steps: alike with oneDNN's there, 10-17% dearer from ~128 rows
# (prefills) on a Zen 5 EPYC (docs/reference/kernels.md#on-a-zen-5-epyc-avx512-bf16-cpu-2core-h).
VDP_MAX_ROWS = 64
# oneDNN's bf16 matmul and weight reorder run with these (PyTorch's mkldnn_bf16_device_check)
ONEDNN_BF16_NEEDS = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))
SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
               "avx_ne_convert", "amx_tile", "amx_bf16")


class CpuPathError(RuntimeError):
    """A forced path this CPU cannot run, or an unknown name; the message says what to set instead."""


@functools.lru_cache(maxsize=None)
def cpu_info() -> tuple[str, frozenset]:
    """(model name, flags) from /proc/cpuinfo; elsewhere the model from `platform` and the flags PyTorch's
    own capability implies (it cannot tell AVX512-BF16 apart, so that path is not picked there)."""
    model = flags = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = val.strip()
                elif key.strip() == "flags" and flags is None:
                    flags = frozenset(val.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    if flags is None:
        cap = torch.backends.cpu.get_cpu_capability()
        flags = frozenset({"AVX2": ("avx2", "fma"), "AVX512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                              "avx512dq")}.get(cap, ()))
    return model, flags


def missing(path: str, flags: frozenset | None = None) -> list[str]:
    """The flags `path`'s instructions need that this CPU (or `flags`) lacks."""
    have = cpu_info()[1] if flags is None else flags
    return [f for f in NEEDS[path] if f not in have]


def runs(path: str, flags: frozenset | None = None) -> bool:
    """Whether this CPU executes `path`'s instructions."""
    return not missing(path, flags)


@dataclass(frozen=True)
class CpuPath:
    """The path in use (`name`), why (`reason`), its kernels module (None: generic) and whether oneDNN's bf16
    matmul may run (this CPU has it and no forced path hides it)."""

    name: str
    reason: str
    kernels: object | None
    onednn_bf16: bool
    cpu: str
    flags: tuple[str, ...]  # the SHOWN_FLAGS this CPU has

    @property
    def kernel_rows(self) -> int | None:
        """The most rows of one matmul this path's kernels take; None: every row count, so every forward
        rounds each row as a one-token step would. vdpbf16ps hands more rows than VDP_MAX_ROWS to oneDNN where
        that runs (faster for prefills); AMX's tiles stay fast at any row count, and AVX2 has nothing else. 0 on
        the generic path, which has no kernels."""
        if self.kernels is None:
            return 0
        return VDP_MAX_ROWS if self.name == "avx512-bf16" and self.onednn_bf16 else None

    def summary(self) -> dict:
        """What bench, evaluate's metrics.json and the report record."""
        return {"cpu_path": self.name, "cpu_path_reason": self.reason, "cpu": self.cpu, "cpu_flags": list(self.flags),
                "onednn_bf16": self.onednn_bf16, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}

    def line(self) -> str:
        return f"cpu path: {self.name} ({self.reason}); {self.cpu}; flags: {' '.join(self.flags) or 'none of note'}"


def _onednn_bf16(flags: frozenset) -> bool:
    """oneDNN's bf16 matmul and its weight reorder run here: the CPU has their instructions, this build the
    ops, and oneDNN itself agrees (it may be capped below the CPU, e.g. by its own ONEDNN_MAX_CPU_ISA)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and any(all(f in flags for f in need) for need in ONEDNN_BF16_NEEDS) and _onednn_bf16_runs()


@functools.cache
def _onednn_bf16_runs() -> bool:
    """One tiny bf16 weight reorder and matmul: oneDNN refuses them with a RuntimeError where its ISA is capped."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), PACK_HINT_ROWS)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=torch.bfloat16), w, None, "none", [None], "")
        return bool(y[0, 0] == 16)
    except RuntimeError:
        return False


def _capped(flags: frozenset, path: str) -> frozenset:
    """The flags with every instruction above `path` hidden (a forced path behaves as on a CPU without them)."""
    if path == "amx-bf16":
        return flags
    if path == "avx512-bf16":
        return frozenset(f for f in flags if not f.startswith("amx"))
    return frozenset(f for f in flags if not f.startswith(("avx512", "amx", "avx_ne", "avx_vnni")))


_ISA_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}


def inductor_refusal(device) -> str | None:
    """Why torch.compile's code cannot be trusted on `device` in this process, or None. With ATen's CPU
    capability capped below what the CPU runs (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU), torch 2.13's
    inductor computes wrong values: compiled silu(linear(x)).sum(-1) read 1.17 where eager read 2.11, and the
    compiled decoder step crashed (docs/reference/kernels.md#emulating-an-avx2-cpu)."""
    if torch.device(device).type != "cpu":
        return None
    _, flags = cpu_info()
    runs_here = 2 if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else 1 if {"avx2", "fma"} <= flags else 0
    cap = torch.backends.cpu.get_cpu_capability()
    if _ISA_RANK.get(cap, runs_here) < runs_here:
        return (f"torch.compile on CPU computes wrong values with ATen's CPU capability capped at {cap} below what "
                f"this CPU runs (ATEN_CPU_CAPABILITY): unset it, or leave compile off")
    return None


def _kernels(name: str):
    """The built kernels of `name`, or None where the CPU has the instructions but the OS withholds them:
    Linux grants a process AMX's tile state only on request (kernel 5.16 and later)."""
    ext = kernels.build(name)
    return None if name == "amx-bf16" and not ext.amx_ready() else ext


def decide(env: dict | None = None, flags: frozenset | None = None) -> CpuPath:
    """The path for this process, from the environment and the CPU's flags (cpu_path() caches it)."""
    env = os.environ if env is None else env
    model, real = cpu_info()
    flags = real if flags is None else flags
    shown = tuple(f for f in SHOWN_FLAGS if f in flags)
    forced = env.get(ENV_PATH, "").strip()
    if forced and forced not in PATHS:
        raise CpuPathError(f"{ENV_PATH}={forced!r} is not a CPU path: use one of {', '.join(PATHS)}, or unset it")
    if forced and not runs(forced, flags):
        ok = [p for p in PATHS if runs(p, flags)]
        lacks = " ".join(missing(forced, flags))
        raise CpuPathError(f"{ENV_PATH}={forced}: this CPU ({model}) lacks {lacks}; use one of "
                           f"{', '.join(ok)}, or unset it to pick the best")
    if env.get(ENV_KERNELS, "1") == "0" and forced not in ("", "generic"):
        raise CpuPathError(f"{ENV_KERNELS}=0 turns the kernels off, {ENV_PATH}={forced} asks for them: unset one")
    mk = lambda name, why, mod, fl: CpuPath(name, why, mod, _onednn_bf16(fl), model, shown)  # noqa: E731
    if forced:
        capped = _capped(flags, forced)
        if forced == "generic":
            return mk("generic", f"forced by {ENV_PATH}", None, capped)
        try:
            ext = _kernels(forced)
        except KernelBuildError as e:
            raise CpuPathError(f"{ENV_PATH}={forced}: {e}") from e
        if ext is None:
            raise CpuPathError(f"{ENV_PATH}={forced}: the OS did not grant this process AMX (Linux 5.16 or later "
                               "does); use avx512-bf16, or unset it to pick the best")
        return mk(forced, f"forced by {ENV_PATH}", ext, capped)
    if env.get(ENV_KERNELS, "1") == "0":
        return mk("generic", f"{ENV_KERNELS}=0", None, flags)
    skipped = []
    for name in PATHS[:-1]:
        if not runs(name, flags):
            skipped.append(f"{name} needs {' '.join(missing(name, flags))}")
            continue
        try:
            ext = _kernels(name)
        except KernelBuildError as e:
            if name != "amx-bf16":  # without AMX the next path is as exact, only slower at many rows
                warnings.warn(f"draftsmith: {e}; using PyTorch's ops (slower verifies, bf16 not bit-exact). "
                              f"Set {ENV_KERNELS}=0 to silence this.")
            skipped.append(f"{name} kernels did not build")
            continue
        if ext is None:
            skipped.append("the OS did not grant AMX")
            continue
        why = "the best this CPU runs" + (f" ({'; '.join(skipped)})" if skipped else "")
        return mk(name, why, ext, flags)
    return mk("generic", "; ".join(skipped) or "no kernel path for this CPU", None, flags)


@functools.lru_cache(maxsize=None)
def cpu_path() -> CpuPath:
    """The path of this process, decided at first use and kept (docs/reference/kernels.md)."""
    return decide()


def bf16_matmul_fast(device) -> bool:
    """Whether PyTorch's own bf16 matmuls (autograd, HF forwards) are fast on `device`: CUDA, or a CPU where
    oneDNN's bf16 path runs. Elsewhere ATen's bf16 GEMM is ~20x slower than fp32 forward and backward
    (docs/reference/kernels.md), so training and feature extraction compute in fp32 there."""
    return torch.device(device).type != "cpu" or cpu_path().onednn_bf16


def small_gemm():
    """The kernels module of this process's path, or None on the generic path."""
    return cpu_path().kernels


# Matmuls on CPU, where a decode step is weight-bandwidth bound and so this is most of a token's time.
# PyTorch's default bf16 matmul (oneDNN) re-lays the weights out on every call. Without the kernels, two
# faster routes give the same numbers: the native GEMV (fp32 accumulation) at one or two rows, which slows
# down sharply with more, and oneDNN with the weights packed once (`_reorder_linear_weight`) for verify and
# prefill forwards. The kernels beat both at 1-16 rows, so where they build they take every forward of up to
# the path's kernel_rows, and every forward where oneDNN has no bf16 path. Figures: docs/reference/kernels.md.
GEMV_MAX_ROWS = 2
PACK_HINT_ROWS = 16  # the row count oneDNN picks its packed layout for (docs/reference/kernels.md)


@contextmanager
def cpu_gemv(rows: int, device: torch.device):
    """For this block, send unpacked matmuls of at most GEMV_MAX_ROWS rows on CPU to the native GEMV
    (oneDNN off), and larger ones to oneDNN (on); the previous setting is restored on exit, so blocks
    nest (a draft LM's multi-token resync inside a one-row propose). torch.backends.mkldnn.flags()
    does the same but re-sets unrelated flags at many times the cost, so the raw switch is used."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        yield
        return
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(rows > GEMV_MAX_ROWS)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] the index of the first maximum, like argmax(-1). CPU bf16 logits go to
    the kernel `argmax_rows` (the same indices) where this path has one, since ATen's argmax and max over
    a large vocabulary are slow (docs/reference/kernels.md); max(-1) elsewhere. Both return the first
    maximal index on ties."""
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.numel():
        ext = small_gemm()
        if ext is not None:
            return ext.argmax_rows(logits.contiguous())
    return logits.max(-1).indices


SAMPLE_BLOCK = 256  # ids per block of cdf_search's first search (the kernel's CDF_BLOCK)


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """[R, n] -> [R, 1] the index of each row's last positive entry (0 where none is)."""
    n, pos = x.shape[-1], x.flip(-1) > 0
    return torch.where(pos.any(-1, keepdim=True), n - 1 - pos.int().argmax(-1, keepdim=True), 0)


def cdf_draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """w [R, V] non-negative weights, u [R] float64 uniforms in [0, 1) -> [R] ids by inverse CDF: the kernel
    `cdf_sample` on CPU where this path has one (0.02 ms a row against `cdf_search`'s 0.27 on the AVX2 EPYC,
    docs/reference/trees.md "Sampling cost"), else `cdf_search`. The same ids but where a float64 block sum's
    last bit, summed in another order, moves a boundary."""
    ext = small_gemm() if w.device.type == "cpu" and w.numel() else None
    return ext.cdf_sample(w.contiguous(), u) if ext is not None else cdf_search(w, u)


def cdf_search(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """w [R, V] non-negative weights, u [R] uniforms in [0, 1) -> [R] ids: u * sum(w) located first among
    blocks of SAMPLE_BLOCK ids, then inside its block, both in float64 (an fp32 cumsum over a 49k vocabulary
    rounds the tail's mass away). A zero-weight id is never drawn."""
    R, V = w.shape
    if V % SAMPLE_BLOCK:
        w = torch.nn.functional.pad(w, (0, SAMPLE_BLOCK - V % SAMPLE_BLOCK))
    blocks = w.view(R, -1, SAMPLE_BLOCK)  # [R, nb, BLOCK]
    bsum = blocks.sum(-1, dtype=torch.float64)  # [R, nb]
    bcdf = bsum.cumsum(-1)  # [R, nb]
    u = u.view(R, 1) * bcdf[:, -1:]  # [R, 1]
    b = torch.searchsorted(bcdf, u, right=True).minimum(_last_positive(bsum))  # [R, 1] the block u falls in
    before = torch.where(b > 0, bcdf.gather(1, (b - 1).clamp_min(0)), torch.zeros_like(u))  # [R, 1]
    inner = blocks.gather(1, b[..., None].expand(-1, -1, SAMPLE_BLOCK))[:, 0].double()  # [R, BLOCK]
    i = torch.searchsorted(inner.cumsum(-1), u - before, right=True).minimum(_last_positive(inner))  # [R, 1]
    return (b * SAMPLE_BLOCK + i)[:, 0]


def can_pack(weight: torch.Tensor) -> bool:
    """Whether packed_linear packs `weight` (CPU bf16, where this path has kernels or oneDNN's bf16)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    p = cpu_path()
    return p.kernels is not None or p.onednn_bf16


_NONE = torch.empty(0)


class Projection(partial):
    """x [..., in] -> [..., out], with what the lean forward needs to know of it declared: `row_invariant` (a
    row's sums never depend on the other rows of the call, in calls of at most `invariant_rows` rows; None:
    any number) and `kernel` ((packed weight, bias, out width) for ext.layer, or None). A partial, so calling
    it costs no Python frame on the hot path."""
    row_invariant: bool = False
    invariant_rows: int | None = 0
    kernel: tuple | None = None


def projection(fn, *, row_invariant: bool = False, invariant_rows: int | None = 0, kernel: tuple | None = None,
               **kwargs) -> Projection:
    p = Projection(fn, **kwargs)
    p.row_invariant, p.invariant_rows, p.kernel = row_invariant, invariant_rows if row_invariant else 0, kernel
    return p


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Projection:
    """x [..., in] -> [..., out]: F.linear, with copies of the weight packed on CPU bf16 (see the note
    above): up to the path's `kernel_rows` go to the kernels where this path has them (every row count on
    AMX, or where oneDNN has no bf16 path); else one or two rows to the native GEMV on the plain weight and more rows to
    oneDNN's packed copy. Like the fused copies, packed weights are taken now; rebuild the runner if the
    weights change. `.row_invariant`: a row's sums never depend on the other rows of the call."""
    if not can_pack(weight):
        return projection(F.linear, weight=weight, bias=bias)
    path = cpu_path()
    ext = path.kernels if weight.shape[1] % 2 == 0 else None
    kernel_rows = path.kernel_rows if ext is not None else 0  # None: every row count
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS) \
        if path.onednn_bf16 and kernel_rows is not None else None
    if ext is not None:
        n_out, kpacked, kbias = weight.shape[0], ext.pack(weight), _NONE
        if bias is not None:
            kbias = torch.zeros(kpacked.shape[0] * 16)  # fp32, padded like the packed rows
            kbias[:n_out] = bias.float()

    def f(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]  # host ints only, here and below
        if ext is not None and (kernel_rows is None or rows <= kernel_rows):
            y = ext.linear(x.reshape(rows, -1).contiguous(), kpacked, kbias, n_out)
            return y.view(*x.shape[:-1], n_out)
        # The native GEMV where cpu_gemv turned oneDNN off for a forward of few rows, or where oneDNN has no
        # bf16 path; else (more rows, or a prefill's one-row LM head inside a many-row forward) the packed weight.
        if packed is None or (rows <= GEMV_MAX_ROWS and not torch._C._get_mkldnn_enabled()):
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
    # row-invariant up to path.kernel_rows rows; the kernel's operands for ext.layer (LeanLlama._forward_fused)
    return projection(f, row_invariant=ext is not None, invariant_rows=kernel_rows,
                      kernel=(kpacked, kbias, n_out) if ext is not None else None)


def module_linear(mod) -> Projection:
    """A projection module as a Projection: packed when it is a plain nn.Linear, else the module itself
    (e.g. eval.drafts' int8 or truncated-vocabulary layers)."""
    if type(mod) is torch.nn.Linear:
        return packed_linear(mod.weight, mod.bias)
    return projection(mod)


def main() -> int:
    """`python -m eval.cpu` (and `draftsmith doctor`): the path this process takes and which paths run here."""
    try:
        p = cpu_path()
    except CpuPathError as e:
        print(f"draftsmith: {e}", file=sys.stderr)
        return 2
    print(p.line())
    print(f"oneDNN bf16 matmul: {'yes' if p.onednn_bf16 else 'no'}; torch {torch.__version__}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")
    for name in PATHS:
        print(f"  {name:12s} {'runs here' if runs(name) else 'not on this CPU: needs ' + ' '.join(NEEDS[name])}")
    print(f"force one with {ENV_PATH}=<{'|'.join(PATHS)}>; {ENV_KERNELS}=0 is generic")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
