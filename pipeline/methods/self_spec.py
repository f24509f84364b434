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

from ..options import option, positive
from .base import DraftMethod, draft_ids, evaluating, next_token_distillation


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
        draft = self.draft
        feats = draft.features(batch["ids"], batch["valid"].long())  # [B, L, H]
        return next_token_distillation(self.tc, batch, feats, head=draft.logits, d2t=draft.d2t)


class SelfSpec(DraftMethod):
    name = "self_spec"
    config = SelfSpecOptions
    help = "the target's own first layers + an adapter, no second copy of the weights"
    variants = {"self_spec": {"self_spec": {"num_layers": 6, "adapter_rank": 128}, "lr": 1e-2}}
    flat = True
    reuses_target_layers = True
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
