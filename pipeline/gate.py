"""The promotion gate: whether a challenger draft replaces the champion in service (issue 24 §2.6).

Pure functions of measurements (eval results as HeldOut.judge writes them: "speedup" over the plain runs
it took turns with, "greedy_exact", and "stats" with "accept_per_pos" and "per_prompt"), so every rule is
tested on hand-computed numbers. Challenger, champion, n-gram baseline and plain decoding are measured in
ONE decode_together call, so their per-prompt lists are in the same prompt order and pair prompt by prompt.

The rules (all must pass; a first draft, with no champion, is held to the absolute ones only):
- gain: the challenger's speedup over the champion's, as a paired bootstrap over prompts says: its lower
  bound at `retrain.confidence` (one-sided) is at least 1 + `retrain.min_gain`;
- per-position acceptance: at no draft position below the champion's by more than `retrain.position_tolerance`;
- greedy exactness: its greedy output matched plain decoding (the exactness rule of the recipe's dtype);
- speed floor: its speedup over plain decoding is above 1.0 and above the n-gram baseline's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .engines.vllm import acceptance, counters_from_hist

BOOTSTRAP_SEED = 0


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

    def summary(self) -> str:
        """One line: the verdict and the rules that decided it."""
        if self.promote:
            return "promote: " + "; ".join(c.detail for c in self.reasons)
        keep = "keep the champion" if self.figures.get("champion") else "not promoted (no champion yet)"
        return f"{keep}: " + "; ".join(c.detail for c in self.failed)

    def to_dict(self) -> dict:
        return {"promote": self.promote, "reasons": [asdict(c) for c in self.reasons], "figures": self.figures,
                "summary": self.summary()}


def _sums(per_prompt: list[dict], idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tok = np.array([p["n_tokens"] for p in per_prompt], dtype=float)
    wall = np.array([p["wall_s"] for p in per_prompt], dtype=float)
    return tok[idx].sum(-1), wall[idx].sum(-1)


def paired_bootstrap(challenger_pp: list[dict], champion_pp: list[dict], *, confidence: float = 0.95,
                     n_boot: int = 2000, seed: int = BOOTSTRAP_SEED) -> dict:
    """The ratio of the challenger's speedup to the champion's, (Σtok_c/Σwall_c) / (Σtok_h/Σwall_h) (both
    over the same plain runs, which cancel), and its bootstrap over prompts: prompts are resampled with
    replacement, the same indices for both (paired). Returns {ratio, lower (the 1 - confidence quantile),
    upper (the confidence quantile), n_prompts, n_boot, confidence, seed}."""
    n = len(challenger_pp)
    if n == 0 or n != len(champion_pp):
        raise ValueError(f"paired bootstrap needs the same prompts for both: {n} vs {len(champion_pp)} measured")
    all_idx = np.arange(n)
    tc, wc = _sums(challenger_pp, all_idx)
    th, wh = _sums(champion_pp, all_idx)
    ratio = (tc / wc) / (th / wh)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    tc, wc = _sums(challenger_pp, idx)
    th, wh = _sums(champion_pp, idx)
    boots = (tc / wc) / (th / wh)
    return {"ratio": float(ratio), "lower": float(np.quantile(boots, 1 - confidence, method="lower")),
            "upper": float(np.quantile(boots, confidence, method="higher")), "n_prompts": n, "n_boot": n_boot,
            "confidence": confidence, "seed": seed}


def acceptance_at_pos(stats: dict) -> list[float]:
    """vLLM's acceptance_at_pos_i: tokens accepted at draft position i over drafts, from the accepted-length
    histogram. Not P(accepted | reached): a draft that reaches a deep position only in easy contexts reads high
    there on few rounds, and a better draft that reaches it often reads lower (seen on chat traffic:
    docs/retraining-demo.md). Falls back to accept_per_pos where no histogram was kept."""
    hist = stats.get("accept_len_hist")
    if not hist or not sum(hist):
        return list(stats.get("accept_per_pos") or [])
    return acceptance(counters_from_hist(hist, len(hist) - 1))["acceptance_per_pos"]


def _pos_check(challenger: list[float], champion: list[float], tol: float) -> Check:
    worst = None  # (position, challenger, champion) with the largest shortfall
    for i, (a, b) in enumerate(zip(challenger, champion)):
        if a == b == 0:
            continue  # a position neither draft reaches says nothing
        if worst is None or b - a > worst[2] - worst[1]:
            worst = (i + 1, a, b)
    if worst is None:
        return Check("acceptance_per_position", True, None, None, "no draft position to compare")
    ok = all(a >= b - tol for a, b in zip(challenger, champion))
    pos, a, b = worst
    return Check("acceptance_per_position", ok, a, b - tol,
                 f"acceptance_at_pos_{pos - 1} {a:.3f} {'>=' if ok else '<'} champion's {b:.3f} - {tol:g}")


def decide(challenger: dict, champion: dict | None, baseline: dict | None, *, min_gain: float = 0.02,
           confidence: float = 0.95, n_boot: int = 2000, position_tolerance: float = 0.05,
           seed: int = BOOTSTRAP_SEED) -> Decision:
    """The gate's decision on `challenger` (an eval result), against `champion`'s and the n-gram `baseline`'s
    results from the same measurement (None: no champion yet / no baseline measured)."""
    checks = []
    sp = challenger["speedup"]
    checks.append(Check("speedup_over_plain", sp > 1.0, sp, 1.0,
                        f"speedup over plain {sp:.3f}x {'>' if sp > 1.0 else '<='} 1.0x"))
    if baseline is not None:
        b = baseline["speedup"]
        checks.append(Check("speedup_over_ngram", sp > b, sp, b,
                            f"speedup {sp:.3f}x {'>' if sp > b else '<='} n-gram baseline's {b:.3f}x"))
    # lossless: output identical to plain decoding's, or differing only after near-ties where verifies are not
    # row-invariant (evaluate.mark_exactness); metrics written before `lossless` existed meant it by greedy_exact
    exact = bool(challenger.get("lossless", challenger.get("greedy_exact")))
    checks.append(Check("lossless", exact, exact, True,
                        "greedy output " + ("matches plain decoding" if exact else "differs from plain decoding")))
    figures = {"challenger": _figures(challenger), "champion": _figures(champion) if champion else None,
               "ngram": _figures(baseline) if baseline else None}
    if champion is not None:
        boot = paired_bootstrap(challenger["stats"]["per_prompt"], champion["stats"]["per_prompt"],
                                confidence=confidence, n_boot=n_boot, seed=seed)
        figures["bootstrap"] = boot
        gain_lb = boot["lower"] - 1.0
        ok = gain_lb >= min_gain
        checks.append(Check("gain_over_champion", ok, gain_lb, min_gain,
                            f"gain over the champion {boot['ratio'] - 1:+.3f} ({confidence:.0%} lower bound "
                            f"{gain_lb:+.3f}, {boot['n_prompts']} prompts) {'>=' if ok else '<'} "
                            f"min_gain {min_gain:g}"))
        checks.append(_pos_check(acceptance_at_pos(challenger["stats"]), acceptance_at_pos(champion["stats"]),
                                 position_tolerance))
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
