"""The report a model owner reads: report.md and two plots, from metrics.json and the eval files."""

from __future__ import annotations

import json
from pathlib import Path

from .engine_rank import markdown as engine_markdown


def _plots(run_dir: Path, metrics: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    ev = run_dir / "eval"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for ck in metrics["checkpoints"] + ([{"name": "ngram"}] if metrics.get("ngram_baseline") else []):
        p = ev / f"{ck['name']}.json"
        if p.exists():
            acc = json.loads(p.read_text())["stats"]["accept_per_pos"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=ck["name"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance per draft position")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run_dir / "acceptance_per_position.png", dpi=110)
    made.append("acceptance_per_position.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [c["name"] for c in metrics["checkpoints"]]
    speeds = [c["speedup"] for c in metrics["checkpoints"]]
    if metrics.get("ngram_baseline"):
        names.append("ngram")
        speeds.append(metrics["ngram_baseline"]["speedup"])
    ax.bar(range(len(names)), speeds, color=["C0"] * len(metrics["checkpoints"]) + ["C1"] * (len(names) - len(metrics["checkpoints"])))
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("measured speedup vs plain")
    ax.set_title("Speedup per checkpoint (batch 1, greedy)")
    fig.tight_layout()
    fig.savefig(run_dir / "speedup.png", dpi=110)
    made.append("speedup.png")
    plt.close(fig)
    return made


def compare_section(run_dir: Path) -> list[str]:
    """When `draftsmith compare` ran on this run: every method's measured speedup (int8 and n-gram
    baselines included) as a short table and a bar plot, pointing to compare/compare.md for the rest."""
    p = Path(run_dir) / "compare" / "compare.json"
    if not p.exists():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = json.loads(p.read_text())
    lift = out.get("lift") or {}
    rows = out["methods"] + out["divergences"][1:] + ([out["raw_baseline"]] if out.get("raw_baseline") else [])
    if lift.get("distilled") and lift["distilled"]["name"] not in {r["name"] for r in rows}:
        rows.insert(len(rows) - 1, lift["distilled"])  # the lift's own distilled arm, next to its raw one
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(rows)), [r["speedup"] for r in rows],
           color=["C1" if r["name"] in ("ngram", "ngram+datastore", "int8-fkl") else "C0" for r in rows])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("measured speedup vs plain")
    ax.set_title("Draft methods (baselines in orange)")
    fig.tight_layout()
    fig.savefig(Path(run_dir) / "compare_speedup.png", dpi=110)
    plt.close(fig)
    f = lambda x, d=2: "n/a" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = ["", "## Draft methods compared (`draftsmith compare`)", "",
             "| variant | α | τ | speedup |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {f(r['alpha'], 3)} | {f(r['tau'])} | {f(r['speedup'])}× |" for r in rows]
    if out.get("distillation_tau_lift") is not None:
        lines += ["", f"Distillation lifts τ by {out['distillation_tau_lift'] * 100:.0f}% over the same method trained on "
                  f"raw domain text ({lift.get('steps', out.get('steps'))} steps each, "
                  f"{lift.get('n_prompts', out.get('n_prompts'))} held-out prompts)."]
    lines += ["", "Baselines without training: `ngram` (prompt lookup), `ngram+datastore` (prompt lookup and "
              "the datastore of the target's outputs, no draft) and `int8-fkl` (an int8 copy of the "
              "target as the draft). Full table: [compare/compare.md](compare/compare.md).", "",
              "![compare_speedup.png](compare_speedup.png)"]
    return lines


def serve_section(m: dict) -> list[str]:
    """How to serve the promoted draft in an engine (its exports in best/), and, when our decoder is
    the target, the fastest candidate each engine could serve."""
    if "serve" not in m:  # metrics.json written before evaluate.serve
        return []
    lines = ["", "## Serving it in an engine", ""]
    if m.get("engine_ranking"):
        lines += [f"Promoted for **{m['serve']}** (evaluate.serve) by its tokens/s inside the engine; the figures "
                  f"above are our decoder's for the checkpoint in best/.", "", *engine_markdown(m["engine_ranking"])]
    elif m["serve"] != "draftsmith":
        lines.append(f"Promoted for **{m['serve']}** (evaluate.serve): only a checkpoint {m['serve']} loads was "
                     f"eligible; the figures above are our decoder's for that draft.")
    for fmt, e in (m.get("exports") or {}).items():
        lines += ["", f"`{e['dir']}/` ({fmt} format, K={e.get('k', m['k'])}):", "", "```", *e["serve"].values(), "```"]
    if m["serve"] == "draftsmith":
        lines += ["", "The fastest candidate each engine can load (a bare checkpoint; the hybrid's lookups and "
                      "tree are our decoder's), measured in our decoder; write it with `draftsmith export`:", ""]
        for engine, b in (m.get("best_exportable") or {}).items():
            lines.append(f"- {engine}: " + ("none of this run's drafts" if b is None else
                         f"`{b['name']}`, speedup {b['speedup']:.2f}×, τ {b['tau']:.2f}: `draftsmith export --draft "
                         f"{b['source']} --format {b['format']} --out DIR`"))
    return lines


def _fmt(x, d: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{d}f}"


def temperature_section(m: dict) -> list[str]:
    """α, τ and speedup greedy and at the serving temperature, for the promoted draft and the n-gram
    baseline (metrics.json's "sampled" block; greedy alone when the recipe serves greedy)."""
    if "sampled" not in m:  # metrics.json written before evaluate.temperature
        return []
    s, f = m["sampled"], _fmt
    if s is None:
        return ["", "Served greedy (evaluate.temperature=0): every figure here is at temperature 0."]
    how = f"T={s['temperature']:g}" + (f", top-p {s['top_p']:g}" if s["top_p"] < 1 else "") + \
        (f", top-k {s['top_k']}" if s["top_k"] else "")
    why = ("promoted by its speedup at the serving temperature" if m.get("promoted_by") == "sampled"
           else "promoted by its greedy speedup")
    lines = ["", f"## Greedy and at the serving temperature ({how})", "",
             f"Lossless speculative sampling against plain sampled decoding on the same {s['n_prompts']} "
             f"held-out prompts, the two taking turns, each prompt i drawn with seed {s['seed']} + i; the draft "
             f"is {why}. Mean acceptance length and draft acceptance rate use vLLM's definitions "
             f"(1 + accepted / drafts; accepted / drafted tokens).", "",
             "| proposer | temperature | α | τ | mean acceptance length | speedup |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| promoted `{m['checkpoint']}` | 0 | {f(m['alpha'], 3)} | {f(m['tau'])} | "
             f"{f(m.get('mean_acceptance_length'))} | {f(m['speedup'])}× |",
             *([f"| promoted `{s['draft']['name']}` | {s['temperature']:g} | {f(s['draft']['alpha'], 3)} | "
                f"{f(s['draft']['tau'])} | {f(s['draft']['mean_acceptance_length'])} | {f(s['draft']['speedup'])}× |"]
               if s["draft"] else [])]
    b, bs = m.get("ngram_baseline"), s.get("ngram_baseline")
    if b:
        lines.append(f"| n-gram baseline | 0 | {f(b['alpha'], 3)} | {f(b['tau'])} | "
                     f"{f(b.get('mean_acceptance_length'))} | {f(b['speedup'])}× |")
    if bs:
        lines.append(f"| n-gram baseline | {s['temperature']:g} | {f(bs['alpha'], 3)} | {f(bs['tau'])} | "
                     f"{f(bs['mean_acceptance_length'])} | {f(bs['speedup'])}× |")
    others = [c for c in s["candidates"] if not s["draft"] or c["name"] != s["draft"]["name"]]
    lines += [f"| `{c['name']}` | {s['temperature']:g} | {f(c['alpha'], 3)} | {f(c['tau'])} | "
              f"{f(c['mean_acceptance_length'])} | {f(c['speedup'])}× |" for c in others]
    if s["draft"]:
        lines += ["", f"Acceptance per draft position at {how} (P(accepted | reached)): "
                  + ", ".join(f(a, 3) for a in s["draft"]["accept_per_pos"])]
    return lines


def data_section(run_dir: Path) -> list[str]:
    """Where the prompts came from, when the generate stage recorded it in run_dir/data.json (data.source=self:
    pipeline/synth.py's counts of what the target wrote and what was dropped, and the JSON parse rate)."""
    p = Path(run_dir) / "data.json"
    if not p.exists():
        return []
    d = json.loads(p.read_text())
    lines = ["", "## Data", "", f"- source: {d.get('source')}"
             + (" (requests written by the target from its chat template's user turn, Magpie)"
                if d.get("source") == "self" else "")]
    if d.get("system"):
        lines.append(f"- system prompt: {d['system']!r}")
    if d.get("seeds"):
        lines.append(f"- request beginnings: {', '.join(repr(x) for x in d['seeds'])}")
    for split, n_key in (("train", "n_train_requests"), ("heldout", "n_heldout_requests")):
        c = d.get(split)
        if isinstance(c, dict) and n_key in d:
            drops = ", ".join(f"{k} {v}" for k, v in c.items() if k != "sampled") or "none"
            lines.append(f"- {'training' if split == 'train' else 'held-out'} requests: {d[n_key]} kept of "
                         f"{c.get('sampled')} sampled (dropped: {drops})")
    if d.get("json_parse_rate") is not None:
        lines.append(f"- the target's answers that hold valid JSON: {d['json_parse_rate']:.1%} of "
                     f"{d.get('json_checked')}")
    return lines


def budget_section(run_dir: Path) -> list[str]:
    """What the time budgets cut, from the stages' own records: generate's manifest ("budget": the shards left
    out) and train/budget.json (the steps planned); nothing where neither cut."""
    run_dir, lines = Path(run_dir), []
    gen = run_dir / "generate" / "manifest.json"
    g = json.loads(gen.read_text()) if gen.exists() else {}
    if g.get("budget", {}).get("skipped"):
        b, kept = g["budget"], g.get("shards", {})
        lines.append(f"- generate: {len(kept)} of {len(kept) + len(b['skipped'])} shards "
                     f"({sum(e.get('rows', 0) for e in kept.values())} completions) in {b['seconds'] / 60:.1f} min "
                     f"(generate.max_minutes={b['max_minutes']:g})")
    plan = run_dir / "train" / "budget.json"
    t = json.loads(plan.read_text()) if plan.exists() else {}
    if t and t["steps"] < t["train_steps"]:
        lines.append(f"- train: {t['steps']} of {t['train_steps']} steps at {t['seconds_per_step']:.2f} s a step "
                     f"(train.max_minutes={t['max_minutes']:g}; the schedule anneals to step {t['steps']})")
    return ["", "## Time budgets", "", "This machine did not fit the whole recipe in its budgets:"] + lines if lines else []


def write_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    m = json.loads((run_dir / "metrics.json").read_text())
    plots = _plots(run_dir, m)
    f = lambda x, d=2: "n/a" if x is None else f"{x:.{d}f}"  # noqa: E731
    # the chain formula counts a verify as one plain step; a tree's verify of many nodes costs more
    bound = "; token trees: an upper bound, a tree's verify costs more than a plain step" if m.get("tree_rounds") else ""
    lines = [
        f"# draftsmith report: {m['domain']} ({run_dir.name})",
        "",
        f"Target `{m['target']}` ({m['dtype']}, {m['device']}). Promoted draft: **{m['draft_method']}** "
        f"checkpoint `{m['checkpoint']}` (divergence {m.get('divergence')}), in `best/`.",
        "",
        f"On {m['n_prompts']} held-out prompts, greedy, batch 1, {m['max_new_tokens']} new tokens, K={m['k']}:",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| acceptance rate α | {f(m['alpha'], 3)} |",
        f"| tokens per target forward τ | {f(m['tau'])} |",
        f"| plain decoding tokens/s | {f(m['tokens_per_s_plain'], 1)} |",
        f"| speculative tokens/s | {f(m['tokens_per_s_spec'], 1)} |",
        f"| **measured speedup** | **{f(m['speedup'])}×** |",
        f"| predicted speedup (from α and c={f(m.get('c'), 3)}{bound}) | {f(m.get('predicted_speedup'))}× |",
        f"| greedy output identical to plain decoding | {m['greedy_exact']} |",
        f"| lossless (identical, or differing only after near-ties where verifies are not row-invariant) | "
        f"{m.get('lossless', m['greedy_exact'])} |",
    ]
    if m.get("cpu_path"):
        lines.append(f"| CPU path (eval/cpu.py) | {m['cpu_path']}: {m.get('cpu_path_reason')}; {m.get('cpu')} |")
    if m.get("bf16_match_rate") is not None:
        rule = ("exact match required: row-invariant CPU kernels" if m.get("exactness_rule") == "exact"
                else f"divergences all near-ties < {m['near_tie_tol']}")
        lines.append(f"| bf16 token match rate ({rule}) | "
                     f"{f(m['bf16_match_rate'], 4)} ({m['n_divergences']} divergences, max margin "
                     f"{f(m.get('max_divergence_margin'), 3)}) |")
    lines.append(f"| fp32 exact on a subset | {m.get('fp32_exact')} |")
    fit = m.get("tree_budget_fit")
    if m.get("max_nodes") is not None:
        how = "fixed by the recipe" if not fit else (
            f"fitted on this machine: replayed on {fit['n_prompts']} {fit['prompts']} prompts"
            + (f" sampled at T={fit['sampling']['temperature']}" if fit.get("sampling") else "")
            + " with its measured verify times"
            + (f" and the decoder's own {f(fit['host_ms'])} ms a round" if fit.get("host_ms") is not None else "")
            + ", estimated speedup (prefill left out) per budget "
            + ", ".join(f"{n}: {f(b['est_speedup'])}×" for n, b in sorted(fit["budgets"].items(), key=lambda x: int(x[0]))))
        lines += ["", f"Token trees of at most **{m['max_nodes']} nodes** a round ({how})."]
    if m.get("ngram_baseline"):
        b = m["ngram_baseline"]
        lines += ["", f"Baseline without training (n-gram prompt lookup, K={m.get('ngram_k', m['k'])}): "
                      f"α {f(b['alpha'], 3)}, τ {f(b['tau'])}, "
                      f"speedup {f(b['speedup'])}×."]
    lines += ["", "## Every checkpoint", "", "| checkpoint | α | τ | tokens/s | speedup | greedy exact |",
              "| --- | --- | --- | --- | --- | --- |"]
    for c in m["checkpoints"]:
        lines.append(f"| {c['name']} | {f(c['alpha'], 3)} | {f(c['tau'])} | {f(c['tokens_per_s'], 1)} | "
                     f"{f(c['speedup'])}× | {c['greedy_exact']} |")
    lines += ["", "Acceptance per draft position (P(accepted | reached)): "
              + ", ".join(f(a, 3) for a in m.get("accept_per_pos", []))]
    lines += temperature_section(m)
    lines += data_section(run_dir)
    lines += budget_section(run_dir)
    lines += [""] + [f"![{p}]({p})" for p in plots]
    lines += serve_section(m)
    lines += compare_section(run_dir)
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out
