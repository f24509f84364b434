"""Training step of the self-speculative draft (`eval.drafts.SelfSpecDraft`): the target's own first
N layers, frozen, + a residual adapter (and, with a truncated vocabulary, the draft's LM head rows),
distilled toward the target's stored top-k distributions.

Self-speculation: Zhang et al., 2023, "Draft & Verify" (layer skipping); Elhoushi et al., 2024,
"LayerSkip" (early exit into the shared LM head). Here the target stays untouched, so one copy of its
weights serves both as target and as draft.

Alignment is `pipeline.train.DraftLMTrainer`'s: the logits at position p predict the token at p + 1,
whose teacher distribution is row p + 1 of the batch's token-position top-k (`tk_ids`/`tk_lp`,
`_collate`), present where `has_t` (completion positions).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from eval.drafts import SelfSpecDraft

from .losses import divergence


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
