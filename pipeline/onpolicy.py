"""GKD's on-policy step (Agarwal et al., 2024, "On-Policy Distillation of Language Models"): a batch
whose continuations are sampled from the draft itself and scored by the target.

draft_lm with data=onpolicy is the setting TRL's GKDTrainer computes as is: it trains there (pipeline/gkd.py).
This step serves the rest, which GKDTrainer (trl 1.16: trl.experimental.gkd; nor trl.DistillationTrainer, its
fully on-policy successor) does not fit: data=mix's generated batches reuse the generate stage's stored top-k where
both trainers rerun the target over every batch for full-vocabulary logits; the self_spec draft has no HF
`generate`; and Medusa/EAGLE heads read the target's features, which neither trainer feeds.
"""

from __future__ import annotations

import random

import torch

from .train_data import collate, right_padded

SEED_STRIDE = 1_000_003  # step s of a run seeded r draws from seed r * SEED_STRIDE + s


def step_seed(seed: int, step: int) -> int:
    """The seed of one training step's on-policy draw and sampling: a resumed run repeats them."""
    return seed * SEED_STRIDE + step


def is_onpolicy_step(data: str, fraction: float, seed: int, step: int) -> bool:
    """GKD's lambda: data=onpolicy trains every step on the draft's own samples, data=mix a seeded
    `fraction` of the steps."""
    return data == "onpolicy" or (data == "mix" and random.Random(step_seed(seed, step)).random() < fraction)


@torch.no_grad()
def teacher_topk(target, seqs: list[list[int]], P: list[int], k: int):
    """Score sequences with the target (teacher-forced, right-padded): per row, the target's top-k
    log-probs for the tokens at positions P..len-1 -> (tk_ids, tk_lp) lists."""
    dev = next(target.parameters()).device
    ids, am = right_padded(seqs)  # [B, L] each
    logits = target(input_ids=ids.to(dev), attention_mask=am.to(dev)).logits  # [B, L, V]
    out = []
    for b, (sq, p) in enumerate(zip(seqs, P)):
        lp = torch.log_softmax(logits[b, p - 1:len(sq) - 1].float(), -1)  # predicts tokens p..len-1
        v, ix = lp.topk(k, -1)
        out.append((ix.cpu().tolist(), v.cpu().tolist()))
    return out


@torch.no_grad()
def onpolicy_batch(batch: dict, method, module, target, eos: set[int], seed: int) -> dict:
    """Keep each row's prompt and the target's first completion token, continue it with the draft's
    own samples (`method.sample`, temperature 1) for as many tokens as the row had, cut at a sampled
    EOS, score them with the target, and return a batch in `collate`'s format."""
    k = batch["tk_ids"].shape[-1]
    prompts, firsts, n_new = [], [], []
    for b in range(batch["ids"].shape[0]):
        P, n = int(batch["P"][b]), int(batch["valid"][b].sum())
        if n <= P:
            continue
        prompts.append(batch["ids"][b, :P].tolist())
        firsts.append(int(batch["ids"][b, P]))
        n_new.append(n - P - 1)
    if not prompts or max(n_new) == 0:
        return batch
    samples = method.sample(module, target, prompts, firsts, max(n_new), seed)
    seqs, P_list = [], []
    for pr, f, smp, n in zip(prompts, firsts, samples, n_new):
        comp = [f] + list(smp[:n])
        for t, tok in enumerate(comp):  # a sampled EOS ends the sequence
            if tok in eos:
                comp = comp[:t + 1]
                break
        seqs.append(pr + comp)
        P_list.append(len(pr))
    scored = teacher_topk(target, seqs, P_list, k)
    items = [{"ids": torch.tensor(sq), "P": p, "tk_ids": torch.tensor(ti, dtype=torch.long),
              "tk_lp": torch.tensor(tl, dtype=torch.float32)} for sq, p, (ti, tl) in zip(seqs, P_list, scored)]
    return collate(items)
