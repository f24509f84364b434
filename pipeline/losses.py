"""Divergences between a draft (student) and the target (teacher), TRL style (cf. trl's
`generalized_jsd_loss`): pure functions of student logits and a teacher distribution.

The teacher is given either as full logits [N, V] or as the generate stage's top-k
(`topk_ids` [N, k] target ids, `topk_logprobs` [N, k], log-softmax over the full vocabulary).

Top-k tail handling (the choice, explicitly): both distributions are compared on k + 1 *buckets*:
the teacher's top-k ids plus one "rest" bucket holding everything else. The teacher keeps its
true top-k probabilities and puts its exact tail mass `1 - sum(top-k probs)` in the rest bucket
(not renormalised over the top-k); the student's bucket probabilities are its probabilities of
those ids and, for the rest bucket, logsumexp of all its other logits. This is the divergence of
the two distributions coarsened to that partition — a lower bound of the full divergence (data
processing inequality) that equals it when k = V.

Truncated draft vocabulary: the student's logits are over V' draft rows, `d2t` [V'] maps a row to its
target id. Teacher top-k ids outside the draft vocabulary fall into the rest bucket. When the
student has no rest mass at all (its whole vocabulary is among the teacher's ids, e.g. k = V' or full
teacher logits with a truncated draft) the teacher is renormalised over the draft-representable
buckets and its rest bucket dropped: otherwise any teacher mass outside the draft vocabulary would
make fkl infinite.

Every function returns the mean over rows (optionally only rows where `mask` is true), or the
per-row values with `reduction="none"`. Computation is in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG = -1e9  # stands for log(0) without producing inf/nan in values or gradients
_TAIL_FLOOR = 1e-8  # smallest teacher rest mass (logprobs are stored rounded; tail must stay >= 0)


def _buckets(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None = None,
             topk_ids: torch.Tensor | None = None, topk_logprobs: torch.Tensor | None = None,
             d2t: torch.Tensor | None = None):
    """-> (teacher probs, teacher log-probs, student log-probs), each [N, B] over common buckets."""
    s = student_logits.float()
    if teacher_logits is not None and d2t is None:
        if teacher_logits.shape != s.shape:
            raise ValueError(f"teacher logits {tuple(teacher_logits.shape)} vs student {tuple(s.shape)}; "
                             f"pass d2t when the draft vocabulary is truncated")
        lt = F.log_softmax(teacher_logits.detach().float(), -1)
        return lt.exp(), lt, F.log_softmax(s, -1)
    if teacher_logits is not None:  # full teacher, truncated student: the teacher's ids are d2t's
        lt_full = F.log_softmax(teacher_logits.detach().float(), -1)
        topk_ids = d2t[None, :].expand(s.shape[0], -1)
        topk_logprobs = lt_full.gather(-1, topk_ids)
    if topk_ids is None or topk_logprobs is None:
        raise ValueError("give the teacher as full logits or as (topk_ids, topk_logprobs)")
    N, Vd = s.shape
    ids = topk_ids.long()
    if d2t is None:
        rows = ids
    else:  # target id -> draft row (-1 outside the draft vocabulary)
        t2d = torch.full((int(max(int(d2t.max()), int(ids.max())) + 1),), -1, dtype=torch.long, device=s.device)
        t2d[d2t.long()] = torch.arange(Vd, device=s.device)
        rows = t2d[ids]
    valid = (rows >= 0) & (rows < Vd)
    rows_c = torch.where(valid, rows, torch.zeros_like(rows))
    # student: gathered logits of the in-vocab top-k ids, and logsumexp of everything else
    s_top = s.gather(-1, rows_c).masked_fill(~valid, NEG)
    in_top = torch.zeros(N, Vd + 1, dtype=torch.bool, device=s.device)
    in_top.scatter_(1, torch.where(valid, rows, torch.full_like(rows, Vd)), True)
    in_top = in_top[:, :Vd]
    rest_empty = in_top.all(-1)  # [N]
    s_rest = torch.logsumexp(s.masked_fill(in_top, NEG), -1, keepdim=True)
    s_rest = torch.where(rest_empty[:, None], torch.full_like(s_rest, NEG), s_rest)
    ls = F.log_softmax(torch.cat([s_top, s_rest], -1), -1)
    # teacher: exact top-k probabilities, tail mass (incl. out-of-draft-vocab ids) in the rest bucket
    pt_top = topk_logprobs.detach().float().exp() * valid
    tail = (1.0 - pt_top.sum(-1, keepdim=True)).clamp(min=_TAIL_FLOOR)
    tail = torch.where(rest_empty[:, None], torch.zeros_like(tail), tail)
    pt = torch.cat([pt_top, tail], -1)
    pt = pt / pt.sum(-1, keepdim=True)
    lt = torch.where(pt > 0, pt.clamp(min=1e-30).log(), torch.full_like(pt, NEG))
    return pt, lt, ls


def _reduce(per_row: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_row
    if mask is None:
        return per_row.mean()
    m = mask.to(per_row.dtype)
    return (per_row * m).sum() / m.sum().clamp(min=1.0)


def _kl(p, lp, lq):
    """sum_i p_i (log p_i - log q_i), with 0 log 0 = 0."""
    return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(-1)


def forward_kl(student_logits, teacher_logits=None, *, topk_ids=None, topk_logprobs=None, d2t=None,
               mask=None, reduction: str = "mean"):
    """KL(teacher || student): mass-covering; the usual distillation loss (= CE to the teacher - H(teacher))."""
    pt, lt, ls = _buckets(student_logits, teacher_logits, topk_ids, topk_logprobs, d2t)
    return _reduce(_kl(pt, lt, ls), mask, reduction)


def reverse_kl(student_logits, teacher_logits=None, *, topk_ids=None, topk_logprobs=None, d2t=None,
               mask=None, reduction: str = "mean"):
    """KL(student || teacher): mode-seeking."""
    pt, lt, ls = _buckets(student_logits, teacher_logits, topk_ids, topk_logprobs, d2t)
    return _reduce(_kl(ls.exp(), ls, lt), mask, reduction)


def jsd(student_logits, teacher_logits=None, *, topk_ids=None, topk_logprobs=None, d2t=None,
        beta: float = 0.5, mask=None, reduction: str = "mean"):
    """Generalised JSD as in trl: M = beta * teacher + (1 - beta) * student,
    beta * KL(teacher || M) + (1 - beta) * KL(student || M). beta=0.5 is the symmetric JSD."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta={beta} must be in (0, 1)")
    pt, lt, ls = _buckets(student_logits, teacher_logits, topk_ids, topk_logprobs, d2t)
    lm = torch.logsumexp(torch.stack([lt + torch.log(torch.tensor(beta)), ls + torch.log(torch.tensor(1 - beta))]), 0)
    per_row = beta * _kl(pt, lt, lm) + (1 - beta) * _kl(ls.exp(), ls, lm)
    return _reduce(per_row, mask, reduction)


def total_variation(student_logits, teacher_logits=None, *, topk_ids=None, topk_logprobs=None, d2t=None,
                    mask=None, reduction: str = "mean"):
    """TV = 1/2 sum |p - q|; 1 - TV is the acceptance rate of speculative sampling at that position."""
    pt, lt, ls = _buckets(student_logits, teacher_logits, topk_ids, topk_logprobs, d2t)
    return _reduce(0.5 * (pt - ls.exp()).abs().sum(-1), mask, reduction)


DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tv": total_variation}


def temper_topk(topk_logprobs: torch.Tensor, temperature: float) -> torch.Tensor:
    """A teacher given by its top-k log-probs [N, k] at temperature T: p_i^(1/T) / Z over the top-k and the
    tail. The tail's tokens are unknown, each with p <= p_k (the k-th): its tempered mass is taken as
    tail * p_k^(1/T - 1), exact when the tail sits at p_k (for T < 1 an upper bound, for T > 1 a lower one).
    -> the tempered top-k log-probs [N, k] (their tail is 1 - their sum)."""
    lp = topk_logprobs.detach().float()
    inv = 1.0 / temperature
    tail = (1.0 - lp.exp().sum(-1, keepdim=True)).clamp(min=_TAIL_FLOOR)  # [N, 1]
    t_tail = tail.log() + (inv - 1.0) * lp.min(-1, keepdim=True).values  # log of the tail's tempered mass
    logz = torch.logsumexp(torch.cat([lp * inv, t_tail], -1), -1, keepdim=True)
    return lp * inv - logz


def divergence(name: str, student_logits, teacher_logits=None, *, beta: float = 0.5, temperature: float = 1.0,
               **kw):
    """Dispatch by the recipe's name (fkl, rkl, jsd, tv); `beta` only reaches jsd. temperature T != 1: both
    distributions as sampling at T serves them (student logits / T; the teacher's logits / T, or its top-k
    by temper_topk), so tv is 1 minus the acceptance of speculative sampling at T."""
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; one of {sorted(DIVERGENCES)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if name == "jsd":
        kw["beta"] = beta
    if temperature != 1.0:
        student_logits = student_logits.float() / temperature
        if teacher_logits is not None:
            teacher_logits = teacher_logits.float() / temperature
        elif kw.get("topk_logprobs") is not None:
            kw["topk_logprobs"] = temper_topk(kw["topk_logprobs"], temperature)
    return DIVERGENCES[name](student_logits, teacher_logits, **kw)
