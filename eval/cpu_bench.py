"""`python -m eval.cpu_bench`: the lean runner's forward on each CPU path this CPU runs, in one process and
interleaved turns, so the paths' ratios hold while the machine's speed drifts (docs/reference/kernels.md).

    python -m eval.cpu_bench [--paths avx512-bf16,avx2,generic] [--turns 7] [--json OUT]
    git show REV:eval/csrc/small_gemm.cpp > old.cpp; python -m eval.cpu_bench --paths avx2 --against old.cpp

Each path gets its own runner over the same bf16 target (the embedded one, or --target DIR), its weights
packed afresh each turn; the table is ms per forward, the median over the turns, at position --pos with
batch x tokens as given by --shapes.
`--against` builds another version of the kernels' source for each path and measures it in the same turns
as `PATH@STEM` (a kernel change's before and after, while the machine's speed drifts). `--fp32-cache` also
measures each path's runner with a float32 K/V cache as `PATH+fp32-cache` (the layout a bf16 cache replaced
where the attention kernel runs).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from . import cpu, kernels
from .bench import turn_order
from .cli_args import OneLineParser, out_file_problem


def measure(model, paths: list[str], shapes: list[tuple[int, int]], pos: int, turns: int, reps: int = 3,
            against: Path | None = None, fp32_cache: bool = False) -> dict:
    """{path: {"BxT": [ms per forward, one per turn]}} with the paths taking turns shape by shape; with
    `against`, also "PATH@STEM" for each path with kernels, its kernels built from that source; with
    `fp32_cache`, also "PATH+fp32-cache" for each path with kernels: the path's own runner (the same packed
    weights, so only the cache differs) with its cache float32."""
    from .target import LeanLlama

    chosen = {name: cpu.decide({cpu.ENV_PATH: name}) for name in paths}
    if against is not None:
        for name, p in list(chosen.items()):
            if p.kernels is not None:
                chosen[f"{name}@{against.stem}"] = dataclasses.replace(p, kernels=kernels.build(name, against))
    base = {name: name for name in chosen}  # whose runner each name times
    if fp32_cache:
        for name, p in list(chosen.items()):
            if p.kernels is not None:
                chosen[f"{name}+fp32-cache"] = p
                base[f"{name}+fp32-cache"] = name
    real = cpu.cpu_path
    names = list(chosen)
    try:
        vocab = model.config.vocab_size
        longest = max(T for _, T in shapes)
        toks = torch.randint(min(100, vocab - 1), min(vocab, 5000), (1, pos + longest), generator=torch.Generator().manual_seed(0))
        out = {name: {} for name in chosen}
        with torch.no_grad():
            for turn in range(turns):
                # Each turn packs every runner's weights afresh, in rotated order: with one copy each for all turns,
                # where a copy lay moved a build ~4% against another build of the same source (kernels.md).
                order = turn_order(names, turn)
                runners, own, r = {}, {}, None  # the last turn's copies go before the new ones are packed
                for name in order:
                    if base[name] == name:
                        cpu.cpu_path = lambda p=chosen[name]: p  # the runner packs its weights for this path when built
                        runners[name] = LeanLlama(model)
                        own[name] = runners[name].cache_dtype
                for name in order:
                    r = runners[base[name]]
                    r.cache_dtype = torch.float32 if base[name] != name else own[name]  # reset() allocates it
                    cpu.cpu_path = lambda p=chosen[name]: p
                    for B, T in shapes:
                        tk = toks[:, pos:pos + T].expand(B, -1).contiguous()  # [B, T]
                        ps = torch.arange(pos, pos + T)[None].expand(B, -1).contiguous()  # [B, T]
                        r.reset(B, pos + longest)
                        r(tk, ps, pos + T)  # untimed: the other runner's weights were the last in cache
                        t = time.perf_counter()
                        for _ in range(reps):
                            r(tk, ps, pos + T)
                        out[name].setdefault(f"{B}x{T}", []).append((time.perf_counter() - t) / reps * 1e3)
    finally:
        cpu.cpu_path = real
    return out


def _check(args) -> tuple[list[str], list[tuple[int, int]]]:
    """Every argument checked before the model loads -> (paths, shapes); ValueError naming the bad one."""
    if args.against is not None and not args.against.is_file():
        raise ValueError(f"--against {args.against} does not exist; write one with "
                         "`git show REV:eval/csrc/small_gemm.cpp > old.cpp`")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in cpu.PATHS]
    if bad or not paths:
        raise ValueError(f"--paths {args.paths!r}: {', '.join(bad) or 'none given'} not a CPU path; use some of "
                         f"{', '.join(cpu.PATHS)}")
    lacks = [p for p in paths if not cpu.runs(p)]
    if lacks:
        raise ValueError(f"--paths: this CPU does not run {', '.join(lacks)}; it runs "
                         f"{', '.join(p for p in cpu.PATHS if cpu.runs(p))}")
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"--shapes {args.shapes!r}: give BxT pairs of positive integers, e.g. 1x1,1x3,16x1")
    for flag, v, least in (("--pos", args.pos, 0), ("--turns", args.turns, 1)):
        if v < least:
            raise ValueError(f"{flag} {v}: give at least {least}")
    why = args.json and out_file_problem(args.json, "--json")
    if why:
        raise ValueError(why)
    return paths, shapes


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m eval.cpu_bench", description=__doc__.split("\n\n")[0], lead="cpu_bench")
    ap.add_argument("--paths", default=",".join(p for p in cpu.PATHS if cpu.runs(p)),
                    help="comma-separated CPU paths (default: every path this CPU runs)")
    ap.add_argument("--target", default="embedded", help="an HF checkpoint dir, a GGUF, or 'embedded' (default)")
    ap.add_argument("--shapes", default="1x1,1x3,1x9,1x16,16x1,32x1,1x128", help="batch x tokens per forward")
    ap.add_argument("--pos", type=int, default=200, help="cached positions before each forward")
    ap.add_argument("--turns", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--fp32-cache", action="store_true",
                    help="also measure each path with a float32 K/V cache, as PATH+fp32-cache")
    ap.add_argument("--against", default=None, type=Path,
                    help="another version of eval/csrc/small_gemm.cpp, measured beside this checkout's as PATH@STEM")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from .bench import BenchError, resolve_target
    from .loading import LoadError

    try:
        paths, shapes = _check(args)
        model = AutoModelForCausalLM.from_pretrained(resolve_target(args.target), dtype=torch.bfloat16).eval()
        res = measure(model, paths, shapes, args.pos, args.turns, against=args.against, fp32_cache=args.fp32_cache)
    except (ValueError, LoadError, BenchError, cpu.CpuPathError, kernels.KernelBuildError) as e:
        print(f"cpu_bench: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    p = cpu.cpu_path()
    med = {name: {k: statistics.median(v) for k, v in rows.items()} for name, rows in res.items()}
    print(f"{p.cpu}; flags: {' '.join(p.flags)}; torch capability {torch.backends.cpu.get_cpu_capability()}")
    names = list(res)
    print(f"{'batch x tokens':>14s} " + " ".join(f"{n:>12s}" for n in names))
    for k in med[names[0]]:
        print(f"{k:>14s} " + " ".join(f"{med[n][k]:12.2f}" for n in names))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": p.cpu, "cpu_flags": list(p.flags), "pos": args.pos,
                                               "turns": args.turns, "torch": torch.__version__,
                                               "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                               "against": str(args.against) if args.against else None,
                                               "fp32_cache": args.fp32_cache,
                                               "median_ms": med, "ms": res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
