"""The speedup a speculative decoder can expect from its acceptance rate (Leviathan et al., 2023).

With per-token acceptance a (geometric: each draft is accepted with probability a once the drafts
before it were), K drafts per round and a draft step costing c target steps, a round emits
(1 - a^(K+1)) / (1 - a) tokens on average and costs K c + 1 target steps. It assumes a verify of K + 1
tokens costs one plain step, which holds roughly at batch 1 (docs/reference/verify-cost.md).
"""

from __future__ import annotations

A_MAX = 0.999  # a = 1 divides by zero; the formula is flat this close to it


def clamped(alpha: float) -> float:
    """alpha clamped to [0, A_MAX]: a per-token acceptance the formulas can take."""
    return min(max(alpha, 0.0), A_MAX)


def tokens_per_round(alpha: float, k: float) -> float:
    """(1 - a^(K+1)) / (1 - a): a chain round's expected tokens, a = alpha clamped to [0, A_MAX]."""
    a = clamped(alpha)
    return (1 - a ** (k + 1)) / (1 - a)


def expected_speedup(alpha: float, k: float, c: float) -> float:
    """(1 - a^(K+1)) / ((1 - a)(K c + 1)) with a = alpha clamped to [0, A_MAX]."""
    return tokens_per_round(alpha, k) / (k * c + 1)


def best_k(alpha: float, c: float, k_max: int = 8) -> tuple[int, float]:
    """The K in 1..k_max with the highest expected speedup, and that speedup (ties go to the larger K)."""
    v, k = max((expected_speedup(alpha, k, c), k) for k in range(1, k_max + 1))
    return k, v
