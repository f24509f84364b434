"""The one bootstrap over prompts behind every speed ratio the gate decides on and the report shows.

A measurement (pipeline.measure.aggregate via evaluate's HeldOut) keeps, prompt by prompt and in prompt order,
the speculative run's tokens and wall time and those of the plain run it took turns with. A speed ratio is
pooled the way aggregate() pools: summed tokens over summed wall time, then over plain's. Resampling draws
prompt indices with replacement, the same indices for every list, so a ratio of two measurements pairs them
prompt by prompt; where the two took turns with the same plain runs, those cancel exactly.
"""

from __future__ import annotations

import numpy as np

SEED = 0


def _columns(stats: dict) -> tuple[np.ndarray, np.ndarray]:
    pp = stats["per_prompt"]
    return (np.array([p["n_tokens"] for p in pp], dtype=float), np.array([p["wall_s"] for p in pp], dtype=float))


def _speed(result: dict | None, idx: np.ndarray) -> np.ndarray:
    """result's pooled speedup over its plain runs for each row of prompt indices `idx` ([..., n] -> [...])."""
    if result is None:  # plain decoding itself
        return np.ones(idx.shape[:-1])
    tok, wall = _columns(result["stats"])
    ptok, pwall = _columns(result["plain_stats"])
    return (tok[idx].sum(-1) / wall[idx].sum(-1)) / (ptok[idx].sum(-1) / pwall[idx].sum(-1))


def n_paired(a: dict, b: dict | None = None) -> int:
    """The prompts measured for a (and b): the same prompts in the same order, or ValueError."""
    lists = [a["stats"]["per_prompt"], a["plain_stats"]["per_prompt"]]
    if b is not None:
        lists += [b["stats"]["per_prompt"], b["plain_stats"]["per_prompt"]]
    n = {len(x) for x in lists}
    if len(n) != 1:
        raise ValueError(f"a paired bootstrap needs the same prompts in every list: {sorted(n)} measured")
    return n.pop()


def speed_ratio(a: dict, b: dict | None = None, *, confidence: float = 0.95, n_boot: int = 2000,
                seed: int = SEED, sided: str = "one") -> dict:
    """a's speedup over b's (b None: over plain decoding), both pooled over the same prompts, with its
    bootstrap. sided="one": `lower` is the one-sided `confidence` bound (the gate's); "two": [lower, upper] is
    the central `confidence` interval (the report's). Seeded, so a rerun gives the same figures.
    -> {ratio, lower, upper, n_prompts, n_tokens (a's generated tokens), n_boot, confidence, seed}."""
    n = n_paired(a, b)
    if n == 0:
        raise ValueError("a paired bootstrap needs at least one prompt measured")
    every = np.arange(n)
    ratio = float(_speed(a, every) / _speed(b, every))
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boots = _speed(a, idx) / _speed(b, idx)
    lo, hi = (1 - confidence, confidence) if sided == "one" else ((1 - confidence) / 2, (1 + confidence) / 2)
    return {"ratio": ratio, "lower": float(np.quantile(boots, lo, method="lower")),
            "upper": float(np.quantile(boots, hi, method="higher")), "n_prompts": n,
            "n_tokens": int(sum(p["n_tokens"] for p in a["stats"]["per_prompt"])), "n_boot": n_boot,
            "confidence": confidence, "seed": seed}
