"""vLLM's own speculative methods on held-out prompts: tokens/s and acceptance at each batch size, one engine
per method (started one after another, never two at once).

    python -m pipeline.vllm_bench --prompts he.jsonl --n 16 --method plain --method ngram:8 \
        --method suffix --batch-sizes 1,16 --json vllm.json

Methods: `plain`; `ngram:K` (prompt lookup, n-grams of --ngram-min..--ngram-max tokens); `suffix` (Arctic
Inference's suffix decoding: needs `pip install arctic-inference` in the engine venv); `FORMAT:K:DIR` for an
export directory DIR of an export format (pipeline/formats.py: speculators, eagle3, medusa, hf,
vllm-proposer), loaded as that format's vLLM speculative config says. Each speculative method's output is compared with plain's,
prompt by prompt. `--profile` runs each engine in this process with timers on
vLLM's step functions (vllm_worker.PROFILED) and adds a table of where an engine step's time goes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eval.cpu import cpu_path

from .engines.vllm import EngineError, acceptance, run_vllm, vllm_job
from .export import k_table
from .formats import FORMATS, vllm_speculative_config


def speculative_config(method: str, ngram_min: int, ngram_max: int, k_by_batch: list | None = None) -> dict | None:
    """vLLM's speculative config for a --method; k_by_batch (vLLM's K-by-batch table) for an export's."""
    name, *rest = method.split(":", 2)
    if name == "plain":
        return None
    if name == "suffix":
        return vllm_speculative_config("suffix")
    if not rest or not rest[0].isdigit():
        raise EngineError(f"--method {method}: give {name}:K (K drafted tokens per round)")
    k = int(rest[0])
    if name == "ngram":
        return vllm_speculative_config("ngram", k, prompt_lookup_min=ngram_min, prompt_lookup_max=ngram_max)
    export = export_of(method)
    if export:
        return FORMATS[export[0]].vllm_spec(export[1], k, k_by_batch)
    raise EngineError(f"--method {method}: one of plain, ngram:K, suffix, or FORMAT:K:DIR for an export format "
                      f"({', '.join(FORMATS)})")


def export_of(method: str) -> tuple[str, Path] | None:
    """`method` FORMAT:K:DIR -> (FORMAT, DIR); None for vLLM's own methods."""
    name, *rest = method.split(":", 2)
    return (name, Path(rest[1]).resolve()) if name in FORMATS and len(rest) == 2 else None


def loader(method: str) -> dict:
    """vLLM's model_loader_extra_config for `method`: what an export needs to load ({} for vLLM's own methods)."""
    export = export_of(method)
    return FORMATS[export[0]].vllm_loader(export[1]) if export else {}


def python_path(method: str) -> list[str]:
    """What vLLM must import for `method`: an export that ships its proposer's module (vllm-proposer)."""
    export = export_of(method)
    return FORMATS[export[0]].vllm_python_path(export[1]) if export else []


def step_profile(run: dict) -> dict | None:
    """A profiled run's timers -> per engine step: tokens and milliseconds in each part. The parts nest:
    engine step = execute_model (input preparation + target forward + logits) + sample_tokens (sample or
    verify, bookkeeping, draft) + the scheduler and output handling; `outside` is the wall time outside
    engine steps (request handling in LLM.generate)."""
    prof = run.get("profile")
    if not prof or not prof.get("engine_step", {}).get("calls"):
        return None
    n = prof["engine_step"]["calls"]
    ms = {p: 1000 * v["s"] / n for p, v in prof.items()}

    def part(whole: str, *inner: str) -> float | None:
        """ms of `whole` less its `inner` parts; None where this vLLM lacks one of them (install_timers left it
        out), so a renamed method shows as unknown, never as a part of zero time."""
        if whole not in ms or any(p not in ms for p in inner):
            return None
        return ms[whole] - sum(ms[p] for p in inner)

    return {"steps": n, "tokens_per_step": run["new_tokens"] / n, "step_ms": part("engine_step"),
            "target_forward_ms": part("target_forward"), "prepare_ms": part("execute_model", "target_forward"),
            "sample_ms": part("sample"), "draft_ms": part("draft"), "draft_forward_ms": part("draft_forward"),
            "bookkeeping_ms": part("sample_tokens", "sample", "draft"),
            "scheduler_ms": part("engine_step", "execute_model", "sample_tokens"),
            "outside_ms": 1000 * run["wall_s"] / n - ms["engine_step"],
            "draft_forward_calls_per_step": prof["draft_forward"]["calls"] / n if "draft_forward" in prof else None}


def bench(target_dir: str, prompts, methods: list[str], batch_sizes: list[int], max_new_tokens: int, dtype: str,
          eos, ngram_min: int = 2, ngram_max: int = 4, workdir=None, profile: bool = False,
          k_by_batch: list | None = None, sampling: dict | None = None) -> list[dict]:
    """One row per (method, batch size); speculative rows compare their outputs with plain's. k_by_batch: vLLM's
    `num_speculative_tokens_per_batch_size` for the exports (FORMAT:K:DIR: the report's recommended table);
    vLLM's own methods run as vLLM ships them. sampling: {temperature, top_p, top_k, seed} (None: greedy); a
    sampled output equals plain's only by chance, so its `identical_to_plain` says nothing of losslessness."""
    s = sampling or {}
    draw = dict(temperature=s.get("temperature", 0.0), top_p=s.get("top_p", 1.0), top_k=s.get("top_k", 0),
                seed=s.get("seed", 0))
    rows, plain = [], {}
    path = cpu_path().name  # the worker inherits it: DRAFTSMITH_CPU_PATH=avx2 caps vLLM's kernels too
    for method in ["plain"] + [m for m in methods if m != "plain"]:
        spec = speculative_config(method, ngram_min, ngram_max, k_by_batch)
        job = vllm_job(target_dir, prompts, max_new_tokens, speculative_config=spec, batch_sizes=batch_sizes,
                       dtype=dtype, eos_token_ids=eos, profile=profile, python_path=python_path(method),
                       loader=loader(method), **draw)
        try:
            res = run_vllm(job, method.replace(":", "-").replace("/", "_"), workdir=workdir)
        except EngineError as e:
            print(f"[vllm-bench] {method}: {e}", file=sys.stderr)
            rows.append({"method": method, "error": str(e).splitlines()[0]})
            continue
        for run in res["runs"]:
            b = run["batch_size"]
            if method == "plain":
                plain[b] = run["outputs"]
            same = sum(x == y for x, y in zip(run["outputs"], plain.get(b, [])))
            rows.append({"method": method, "speculative_config": spec, "batch_size": b,
                         "tokens_per_s": run["tokens_per_s"], "new_tokens": run["new_tokens"], "wall_s": run["wall_s"],
                         "startup_s": res["startup_s"], "identical_to_plain": same, "n_prompts": len(prompts),
                         "vllm_version": res["vllm_version"], "cpu_path": path, "counters": run["spec"],
                         **acceptance(run["spec"]),
                         **({"profile": step_profile(run)} if profile else {})})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| method | batch | tokens/s | vs plain | mean acceptance length | acceptance per position | "
             "output == plain |", "| --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["method"] == "plain" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | - | failed: {r['error']} | | | | |")
            continue
        pos = " ".join(f"{x:.2f}" for x in r["acceptance_per_pos"]) or "-"
        rel = r["tokens_per_s"] / base[r["batch_size"]] if base.get(r["batch_size"]) else 0.0
        acc = f"{r['mean_acceptance_length']:.2f}" if r["method"] != "plain" else "-"
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {rel:.2f}x | {acc} | {pos} | "
                     f"{r['identical_to_plain']}/{r['n_prompts']} |")
    return "\n".join(lines) + "\n"


def profile_markdown(rows: list[dict]) -> str:
    """Where an engine step's time goes, per method and batch size (ms per engine step)."""
    lines = ["| method | batch | steps | tokens/step | ms/step | target forward | draft (its forward) | sample/verify | "
             "input prep | bookkeeping | scheduler+output | outside steps |", "| --- |" + " ---: |" * 11]
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        f = {k: "–" if v is None else f"{v:.1f}" for k, v in p.items()}  # – : a part this vLLM lacks
        lines.append(f"| {r['method']} | {r['batch_size']} | {p['steps']} | {p['tokens_per_step']:.2f} | "
                     f"{f['step_ms']} | {f['target_forward_ms']} | {f['draft_ms']} ({f['draft_forward_ms']}) | "
                     f"{f['sample_ms']} | {f['prepare_ms']} | {f['bookkeeping_ms']} | {f['scheduler_ms']} | "
                     f"{f['outside_ms']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from eval.bench import BenchError, batch_sizes, encode_prompts, load_prompts

    from .generate import target_eos_ids
    from .models import ModelError, load_target, resolve_target
    from .options import positive

    ap = argparse.ArgumentParser(prog="python -m pipeline.vllm_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--prompts", required=True, help="JSONL prompts (`draftsmith prompts --out F`)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--method", action="append", default=[],
                    help="plain, ngram:K, suffix, FORMAT:K:DIR (FORMAT: an export format)")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--k-by-batch", type=k_table, default=None,
                    help="vLLM's num_speculative_tokens_per_batch_size for the FORMAT:K:DIR methods, as JSON: "
                         "inclusive [start, end, K] ranges from batch 1, e.g. '[[1, 4, 4], [5, 256, 0]]' "
                         "(the owner report recommends one from its batch curve)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--workdir", help="keep the engines' jobs, results and logs here")
    ap.add_argument("--profile", action="store_true", help="time vLLM's step functions (engine in this process) "
                                                            "and print where an engine step's time goes")
    args = ap.parse_args(argv)
    try:  # bad input is reported in one line, before the target loads
        sizes = batch_sizes("--batch-sizes", args.batch_sizes)
        positive("--n", args.n)
        positive("--max-new-tokens", args.max_new_tokens)
        for method in args.method:
            speculative_config(method, args.ngram_min, args.ngram_max, args.k_by_batch)
            export = export_of(method)
            if export and not export[1].is_dir():
                raise EngineError(f"--method {method}: export directory {export[1]} does not exist; write it with "
                                  f"`draftsmith export --format {export[0]}`")
        prompt_rows = load_prompts(args.prompts, args.n)
        model, tok = load_target(args.target, "float32", "cpu")
        prompts = encode_prompts(prompt_rows, tok)
    except (BenchError, EngineError, ModelError, ValueError) as e:
        print(f"vllm_bench: {e}", file=sys.stderr)
        return 2
    rows = bench(resolve_target(args.target), prompts, args.method, sizes,
                 args.max_new_tokens, args.dtype, target_eos_ids(model, tok), args.ngram_min, args.ngram_max,
                 args.workdir, args.profile, args.k_by_batch)
    print(markdown(rows))
    if args.profile:
        print(profile_markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
