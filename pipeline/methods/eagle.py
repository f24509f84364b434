"""EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"): a
decoder layer over the target's features and the next token's embedding (`eval/heads/eagle.py`), with
EAGLE-3's truncated draft vocabulary and training-time test (Li et al., 2025). It trains on a cache of
the target's features, so a step costs no target forward.

Alignment: the decoder calls head(feat[t], emb(tok[t+1]), pos=t+1) and reads the token at t+2 from
the logits. So head output index t is trained toward feature[t+1] (smooth L1) and toward the teacher
distribution that produced tok[t+2] (the batch's token-position top-k row t+2). Prompt positions feed
the head as context and the feature term, but carry no distribution loss (no teacher there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eval.heads import EagleHead

from ..losses import divergence
from ..options import option, positive
from .base import DraftMethod, draft_ids, frozen_embedding


@dataclass
class EagleOptions:
    num_layers: int = option(1, "Decoder layers of the head.")
    unroll: int = option(2, "Training-time test: draft steps unrolled on the head's own features.")
    feature_loss_weight: float = option(0.1, "Weight of the feature regression (smooth L1) term.")

    def __post_init__(self):
        positive("train.eagle.num_layers", self.num_layers)
        positive("train.eagle.unroll", self.unroll)


class EagleTrainer(nn.Module):
    """EAGLE Step 3: the head plus the target's frozen token embedding; forward(batch) -> loss, metrics.
    `tc` is the train section (divergence, jsd_beta, eagle.unroll, eagle.feature_loss_weight)."""

    def __init__(self, head: EagleHead, embed: nn.Embedding, tc):
        super().__init__()
        self.head, self.embed, self.tc = head, embed, tc
        self.embed.weight.requires_grad_(False)

    def forward(self, batch):
        tc, head, unroll = self.tc, self.head, self.tc.eagle.unroll
        ids, feat = batch["ids"], batch["feat"].float()  # [B, L], [B, L, H]
        B, L = ids.shape
        T = L - 2  # head index t: input feat[t] ⊕ emb(tok[t+1]) at pos t+1 -> feature[t+1], token t+2
        if T <= 0:
            z = feat.sum() * 0
            return z, {}
        with torch.no_grad():
            emb = self.embed(ids[:, 1:L - 1]).float()  # [B, T, H]
        pos = torch.arange(1, L - 1, device=ids.device)[None].expand(B, -1)
        f_true = feat[:, 1:L - 1]  # feature[t+1]
        f_mask = batch["valid"][:, 1:L - 1].float()[..., None]  # feature[t+1] exists
        t_mask = batch["has_t"][:, 2:]  # teacher for tok[t+2] exists (completion positions)
        tk_ids = batch["tk_ids"][:, 2:].reshape(B * T, -1)
        tk_lp = batch["tk_lp"][:, 2:].reshape(B * T, -1)
        f_in = feat[:, :L - 2]
        div_total, feat_total, metrics = 0.0, 0.0, {}
        for j in range(unroll):  # training-time test: step j>0 reads the head's own features
            h = head(f_in, emb, pos)  # [B, T, H]
            logits = head.logits(h).reshape(B * T, -1)
            div = divergence(tc.divergence, logits, topk_ids=tk_ids, topk_logprobs=tk_lp, d2t=head.d2t,
                             beta=tc.jsd_beta, temperature=tc.temperature, mask=t_mask.reshape(-1))
            fl = (F.smooth_l1_loss(h.float(), f_true, reduction="none") * f_mask).sum() / (
                f_mask.sum().clamp(min=1) * h.shape[-1])
            div_total, feat_total = div_total + div, feat_total + fl
            with torch.no_grad():
                m = t_mask.reshape(-1)
                top = head.d2t[logits.argmax(-1)]
                acc = ((top == tk_ids[:, 0]) & m).sum() / m.sum().clamp(min=1)
            metrics[f"acc_{j}"] = float(acc)
            # shift: h[t-1] is the head's prediction of feature[t], the input at index t next step
            f_in = torch.cat([feat[:, :1], h[:, :-1]], 1)
        loss = (div_total + tc.eagle.feature_loss_weight * feat_total) / unroll
        metrics.update(div=float(div_total.detach()) / unroll, feat_loss=float(feat_total.detach()) / unroll)
        return loss, metrics


class Eagle(DraftMethod):
    name = "eagle"
    config = EagleOptions
    help = "a decoder layer over the target's features and the next token, EAGLE, Li et al. 2024"
    variants = {"eagle": {}, "eagle_fullvocab": {"draft_vocab_size": 0}}  # the truncated vocabulary's counterpart
    flat = True
    needs_features = True

    def build(self, tc, target, tokenizer, rows, resume):
        embed = frozen_embedding(target)
        head = EagleHead.from_target(target, tc.eagle.num_layers, draft_ids(tc, target, rows)).float()
        if resume is not None:
            head.load_state_dict(EagleHead.load(resume).state_dict())
        return EagleTrainer(head, embed, tc)

    def trainable_parameters(self, module):
        return list(module.head.parameters())

    def vocab_size(self, module, target):
        return len(module.head.d2t)

    def save(self, module, directory, extra, step):
        module.head.save(directory, extra={**extra, "step": step})
