"""The promotion gate: whether a challenger draft replaces the champion in service (docs/retraining.md#the-gate).

Pure functions of measurements (eval results as HeldOut.judge writes them: "speedup" over the plain runs
it took turns with, "lossless", "stats" with "per_prompt" and the accepted-length histogram, "plain_stats"
with the plain runs' "per_prompt"), so every rule is tested on hand-computed numbers and on real timing.
Every speed rule reads one paired bootstrap over the prompts (pipeline/bootstrap.py).

The rules, in order:
- evidence: at least `min_prompts` paired prompts and `min_tokens` generated tokens, else the verdict is "not
  enough evidence" and the champion (or no champion) stays: with one prompt every resample is that prompt;
- speed floors: the one-sided lower bound at `confidence` of the speedup over plain decoding, and of the speedup
  over the n-gram baseline's, is above 1;
- lossless: its greedy output matched plain decoding (the exactness rule of the recipe's dtype);
- gain (with a champion): the lower bound of its speedup over the champion's is at least 1 + `min_gain`;
- per-position acceptance (with a champion): at each position the served K reaches, at most
  `position_tolerance` below the champion's. It vetoes only where the draft is served by another engine than
  the one that measured it: served by draftsmith, the measured gain is the serving speed itself, and a dip at
  one position that the speed already counts is reported, not a veto.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .bootstrap import SEED as BOOTSTRAP_SEED
from .bootstrap import n_paired, speed_ratio
from .engines.vllm import acceptance, counters_from_hist

INSUFFICIENT = "not enough evidence"


@dataclass(frozen=True)
class Serving:
    """The serving setting the gate protects: the engine the draft is served by and its draft tokens per round."""

    engine: str = "draftsmith"
    k: int = 2

    @property
    def measured_here(self) -> bool:
        """Whether the gate's timing is this setting's own speed (our decoder measured it)."""
        return self.engine == "draftsmith"

    def __str__(self) -> str:
        return f"{self.engine} K={self.k}"


@dataclass
class Check:
    """One gate rule, with the figures it was decided on."""

    name: str
    passed: bool
    value: float | bool | None
    threshold: float | bool | None
    detail: str


@dataclass
class Decision:
    promote: bool
    reasons: list[Check] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.reasons if not c.passed]

    @property
    def outcome(self) -> str:
        """promote, keep, or "not enough evidence" (kept: the evidence rule failed and nothing else was judged)."""
        if self.promote:
            return "promote"
        return INSUFFICIENT if any(c.name == "evidence" for c in self.failed) else "keep"

    def summary(self) -> str:
        """One line: the verdict and the rules that decided it."""
        if self.promote:
            return "promote: " + "; ".join(c.detail for c in self.reasons)
        keep = "keep the champion" if self.figures.get("champion") else "not promoted (no champion yet)"
        if self.outcome == INSUFFICIENT:
            keep = f"{INSUFFICIENT}: " + ("kept the champion" if self.figures.get("champion") else "not promoted")
        return f"{keep}: " + "; ".join(c.detail for c in self.failed)

    def to_dict(self) -> dict:
        return {"promote": self.promote, "outcome": self.outcome, "reasons": [asdict(c) for c in self.reasons],
                "figures": self.figures, "summary": self.summary()}


def acceptance_at_pos(stats: dict) -> list[float]:
    """vLLM's acceptance_at_pos_i: tokens accepted at draft position i over drafts, from the accepted-length
    histogram. Not P(accepted | reached): a draft that reaches a deep position only in easy contexts reads high
    there on few rounds, and a better draft that reaches it often reads lower (seen on chat traffic:
    docs/retraining-demo.md). Falls back to accept_per_pos where no histogram was kept."""
    hist = stats.get("accept_len_hist")
    if not hist or not sum(hist):
        return list(stats.get("accept_per_pos") or [])
    return acceptance(counters_from_hist(hist, len(hist) - 1))["acceptance_per_pos"]


def _pad(xs: list[float], n: int) -> list[float]:
    return list(xs[:n]) + [0.0] * (n - len(xs[:n]))


def _pos_check(challenger: list[float], champion: list[float], tol: float, serving: Serving) -> Check:
    """acceptance_at_pos over the positions the served K reaches, the union of both drafts' (a position one
    draft never reached reads 0 for it); a dip beyond `tol` vetoes only where the serving engine is not the
    one that measured the speed (module docstring)."""
    k = serving.k
    a, b = _pad(challenger, k), _pad(champion, k)
    if not any(a) and not any(b):
        return Check("acceptance_per_position", True, None, None, f"no draft position to compare ({serving})")
    pos = max(range(k), key=lambda i: b[i] - a[i])  # the largest shortfall
    dip = b[pos] - a[pos] > tol
    where = f"acceptance_at_pos_{pos} {a[pos]:.3f} {'<' if dip else '>='} champion's {b[pos]:.3f} - {tol:g}"
    if not dip:
        return Check("acceptance_per_position", True, a[pos], b[pos] - tol, f"{where} (positions < K, {serving})")
    if serving.measured_here:
        return Check("acceptance_per_position", True, a[pos], b[pos] - tol,
                     f"{where}: not a veto, served by {serving}, whose speed the gain measured")
    return Check("acceptance_per_position", False, a[pos], b[pos] - tol,
                 f"{where}: protects {serving}, where this draft's speed was not measured")


def _evidence(challenger: dict, champion: dict | None, baseline: dict | None, min_prompts: int,
              min_tokens: int) -> tuple[Check, dict]:
    """The evidence rule, and the counts it read (figures["evidence"])."""
    if not challenger["stats"].get("per_prompt") or not (challenger.get("plain_stats") or {}).get("per_prompt"):
        n, tokens = 0, 0  # measured before per-prompt figures were kept: nothing to resample
    else:
        n = n_paired(challenger, champion)
        if baseline is not None:
            n_paired(challenger, baseline)
        tokens = sum(p["n_tokens"] for p in challenger["stats"]["per_prompt"])
    ok = n >= min_prompts and tokens >= min_tokens
    check = Check("evidence", ok, n, min_prompts,
                  f"{n} paired prompts {'>=' if n >= min_prompts else '<'} min_prompts {min_prompts}, {tokens} "
                  f"generated tokens {'>=' if tokens >= min_tokens else '<'} min_tokens {min_tokens}")
    return check, {"n_prompts": n, "n_tokens": tokens, "min_prompts": min_prompts, "min_tokens": min_tokens}


def _floor(name: str, boot: dict, what: str, confidence: float) -> Check:
    ok = boot["lower"] > 1.0
    return Check(name, ok, boot["lower"], 1.0,
                 f"{what} {boot['ratio']:.3f}x ({confidence:.0%} lower bound {boot['lower']:.3f}x, "
                 f"{boot['n_prompts']} prompts) {'>' if ok else '<='} 1.0x")


def decide(challenger: dict, champion: dict | None, baseline: dict | None, *, serving: Serving = Serving(),
           min_gain: float = 0.02, confidence: float = 0.95, n_boot: int = 2000, position_tolerance: float = 0.05,
           min_prompts: int = 8, min_tokens: int = 512, seed: int = BOOTSTRAP_SEED) -> Decision:
    """The gate's decision on `challenger` (an eval result), against `champion`'s and the n-gram `baseline`'s
    results over the same prompts (None: no champion yet / no baseline measured)."""
    figures = {"challenger": _figures(challenger), "champion": _figures(champion) if champion else None,
               "ngram": _figures(baseline) if baseline else None, "serving": asdict(serving)}
    evidence, figures["evidence"] = _evidence(challenger, champion, baseline, min_prompts, min_tokens)
    if not evidence.passed:
        return Decision(False, [evidence], figures)
    boot = dict(confidence=confidence, n_boot=n_boot, seed=seed)
    figures["bootstrap_plain"] = over_plain = speed_ratio(challenger, None, **boot)
    checks = [evidence, _floor("speedup_over_plain", over_plain, "speedup over plain", confidence)]
    if baseline is not None:
        figures["bootstrap_ngram"] = over_ngram = speed_ratio(challenger, baseline, **boot)
        checks.append(_floor("speedup_over_ngram", over_ngram, "speedup over the n-gram baseline's", confidence))
    # lossless: output identical to plain decoding's, or differing only after near-ties where verifies are not
    # row-invariant (evaluate.mark_exactness); metrics written before `lossless` existed meant it by greedy_exact
    exact = bool(challenger.get("lossless", challenger.get("greedy_exact")))
    checks.append(Check("lossless", exact, exact, True,
                        "greedy output " + ("matches plain decoding" if exact else "differs from plain decoding")))
    if champion is not None:
        figures["bootstrap"] = gain = speed_ratio(challenger, champion, **boot)
        gain_lb = gain["lower"] - 1.0
        ok = gain_lb >= min_gain
        checks.append(Check("gain_over_champion", ok, gain_lb, min_gain,
                            f"gain over the champion {gain['ratio'] - 1:+.3f} ({confidence:.0%} lower bound "
                            f"{gain_lb:+.3f}, {gain['n_prompts']} prompts) {'>=' if ok else '<'} "
                            f"min_gain {min_gain:g}"))
        checks.append(_pos_check(acceptance_at_pos(challenger["stats"]), acceptance_at_pos(champion["stats"]),
                                 position_tolerance, serving))
    return Decision(all(c.passed for c in checks), checks, figures)


def _figures(r: dict) -> dict:
    s = r["stats"]
    return {"name": r.get("name"), "speedup": r["speedup"], "tau": s.get("tau"), "alpha": s.get("alpha"),
            "accept_per_pos": s.get("accept_per_pos"), "acceptance_at_pos": acceptance_at_pos(s),
            "tokens_per_s": s.get("tokens_per_s"),
            "greedy_exact": r.get("greedy_exact"), "lossless": r.get("lossless", r.get("greedy_exact"))}


def table_rows(d: Decision) -> tuple[list[str], list[list]]:
    """(columns, rows) of the decision as a table: one row per rule (W&B's gate table)."""
    cols = ["check", "passed", "value", "threshold", "detail"]
    return cols, [[c.name, c.passed, None if c.value is None else float(c.value),
                   None if c.threshold is None else float(c.threshold), c.detail] for c in d.reasons]
