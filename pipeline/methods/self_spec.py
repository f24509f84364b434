"""The self-speculative draft (`eval.drafts.SelfSpecDraft`): the target's own first N layers, frozen,
+ a residual adapter (and, with a truncated vocabulary, the draft's LM head rows), distilled toward
the target's stored top-k distributions. The checkpoint holds only the adapter.

Self-speculation: Zhang et al., 2023, "Draft & Verify" (layer skipping); Elhoushi et al., 2024,
"LayerSkip" (early exit into the shared LM head). Here the target stays untouched, so one copy of its
weights serves both as target and as draft.

Alignment is draft_lm's: the logits at position p predict the token at p + 1, whose teacher
distribution is row p + 1 of the batch's token-position top-k (`tk_ids`/`tk_lp`), present where
`has_t` (completion positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from eval.drafts import SelfSpecDraft

from ..losses import divergence
from ..options import option, positive
from .base import DraftMethod, draft_ids, evaluating


@dataclass
class SelfSpecOptions:
    num_layers: int = option(1, "The target's first layers the draft shares.")
    adapter_rank: int = option(64, "Rank of the residual adapter between the shared layers and the target's "
                                   "final norm.")

    def __post_init__(self):
        positive("train.self_spec.num_layers", self.num_layers)
        positive("train.self_spec.adapter_rank", self.adapter_rank)


def trainable_parameters(draft: SelfSpecDraft) -> list[nn.Parameter]:
    """What the optimizer updates: the adapter (+ the truncated LM head); never a target weight."""
    return draft.trainable_parameters()


class SelfSpecTrainer(nn.Module):
    """forward(batch) -> (loss, metrics {div, acc_0}); tc needs `divergence` and `jsd_beta`.

    Only completion positions reach the LM head (the features of prompt positions are dropped before
    it): with a 49k-row head, that is most of a step's memory and much of its time."""

    def __init__(self, draft: SelfSpecDraft, tc):
        super().__init__()
        self.draft, self.tc = draft, tc

    def forward(self, batch):
        ids, valid = batch["ids"], batch["valid"]
        draft = self.draft
        feats = draft.features(ids, valid.long())[:, :-1]  # [B, L-1, H]: position p -> token p+1
        B, T, H = feats.shape
        m = batch["has_t"][:, 1:].reshape(-1)  # [B*T] teacher exists for token p+1
        if not bool(m.any()):  # no completion token in this batch: nothing to distil
            return feats.sum() * 0, {"div": 0.0, "acc_0": 0.0}
        logits = draft.logits(feats.reshape(B * T, H)[m])  # [N, Vd]
        tk_ids = batch["tk_ids"][:, 1:].reshape(B * T, -1)[m]  # [N, k] target ids
        tk_lp = batch["tk_lp"][:, 1:].reshape(B * T, -1)[m]
        div = divergence(self.tc.divergence, logits, topk_ids=tk_ids, topk_logprobs=tk_lp, d2t=draft.d2t,
                         beta=self.tc.jsd_beta)
        with torch.no_grad():
            top = logits.argmax(-1)
            if draft.d2t is not None:
                top = draft.d2t[top]
            acc = (top == tk_ids[:, 0]).float().mean() if len(top) else torch.tensor(0.0)
        return div, {"div": float(div.detach()), "acc_0": float(acc)}


class SelfSpec(DraftMethod):
    name = "self_spec"
    config = SelfSpecOptions
    token_level = True

    def build(self, tc, target, tokenizer, rows, resume):
        ids = draft_ids(tc, target, rows)
        if resume is not None:  # rebuilt around the target: only the adapter (and head) are read
            draft = SelfSpecDraft.load(resume, target, dtype=torch.float32)
        else:
            draft = SelfSpecDraft(target, tc.self_spec.num_layers, tc.self_spec.adapter_rank, ids)
        return SelfSpecTrainer(draft, tc)

    def trainable_parameters(self, module):
        return trainable_parameters(module.draft)

    def vocab_size(self, module, target):
        d2t = module.draft.d2t
        return target.config.vocab_size if d2t is None else len(d2t)

    def save(self, module, directory, extra, step):
        module.draft.save(directory, extra={**extra, "step": step})

    @torch.no_grad()
    def sample(self, module, target, prompts, firsts, n, seed):
        """The decoder's own draft runner: a KV cache over the shared layers."""
        from eval.proposers import Sampling, load_proposer

        g = torch.Generator().manual_seed(seed)
        with evaluating(module.draft) as draft:
            prop = load_proposer(draft, target)  # a DraftLMProposer with the draft's d2t
            prop.begin(prompts, torch.tensor(firsts), max(map(len, prompts)) + 1 + n, Sampling(1.0, generator=g))
            return prop.propose(n)[0].tolist()
