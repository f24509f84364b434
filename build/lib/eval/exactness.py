"""Greedy exactness report: do two decoders' outputs agree token for token, and where they do not,
was the target's choice a near-tie?

In bf16 a multi-token verify forward can round differently from a one-token forward (oneDNN's and
SDPA's sums are blocked by row and kv counts), so speculative and plain greedy outputs may part at
positions where the target's top-2 logits are nearly equal. On CPUs where eval/kernels.py builds, the
lean runner's forwards of up to 16 tokens are row-invariant and bf16 outputs must match exactly.
`compare_greedy` finds each sequence's first divergence and recomputes that margin with one target
forward over prompt + common prefix, so such a divergence can be shown to be a near-tie.
"""

from __future__ import annotations

import torch


def exactness_rule(dtype: str, row_invariant: bool) -> str:
    """How greedy speculative output must agree with plain decoding's: "exact" in fp32, or in bf16 where
    every verify forward was row-invariant (the decoder's stats["row_invariant"]); else "near-ties"
    (each first divergence a near-tie, `compare_greedy`'s all_near_ties)."""
    return "exact" if dtype == "float32" or row_invariant else "near-ties"


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def _margin(target, ids: list[int]) -> float:
    """Top-1 minus top-2 logit of the target's next-token distribution after `ids`."""
    dev = target.get_output_embeddings().weight.device
    logits = target(torch.tensor([ids], device=dev)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare_greedy(target, prompts: list[list[int]], seqs_a: list[list[int]], seqs_b: list[list[int]],
                   tol: float = 0.5) -> dict:
    """-> {match_rate, exact, divergences: [{prompt_index, position, token_a, token_b, margin}],
    all_near_ties}. match_rate: tokens equal before each sequence's first divergence over the total
    (the longer of the two per prompt). A length difference with no differing token counts as a
    divergence at the shorter length (the missing side's token is None)."""
    assert len(prompts) == len(seqs_a) == len(seqs_b), "one sequence per prompt on each side"
    matched = total = 0
    divs = []
    for i, (p, a, b) in enumerate(zip(prompts, seqs_a, seqs_b)):
        total += max(len(a), len(b))
        j = _first_divergence(a, b)
        if j is None:
            matched += len(a)
            continue
        matched += j
        divs.append({
            "prompt_index": i,
            "position": j,
            "token_a": a[j] if j < len(a) else None,
            "token_b": b[j] if j < len(b) else None,
            "margin": _margin(target, list(p) + list(a[:j])),
        })
    return {
        "match_rate": matched / total if total else 1.0,
        "exact": not divs,
        "divergences": divs,
        "all_near_ties": all(d["margin"] < tol for d in divs),
    }
