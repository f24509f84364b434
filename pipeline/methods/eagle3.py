"""EAGLE-3 (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"): one decoder layer over three of the target's layers, fused by fc
(`eval/heads/eagle3.py`), with a truncated draft vocabulary and the training-time test. The head's
directory is what vLLM, SGLang and speculators load as EAGLE-3 (after `draftsmith export`).

Features: the residual streams entering train.eagle3.aux_layers of the target ([B, L, 3H]), cached
once like EAGLE's (pipeline/features.py; bytes per token = 3 * H * the target dtype's size) or, with
features=online (or auto when the cache would pass max_cache_gb), computed by a target forward per
batch.

Alignment (as EAGLE's, eagle.py): head index t reads hidden[t] ⊕ embed(tok[t+1]) at slot t and is
trained toward the teacher distribution of tok[t+2] (the batch's top-k at row t+2; completion
positions only). Training-time test: step 0 reads hidden = fc(aux[t]); step j > 0 reads the head's
own output of step j-1 at t-1 (pre-norm, no fc), which is what the proposer feeds back while drafting.
The loss is the divergence averaged over the unrolled steps. EAGLE-3 drops EAGLE's feature regression;
feature_loss_weight > 0 adds a smooth L1 of the head's output toward the target's high aux layer at
t+1 (a real target feature, so fc cannot shrink it away), 0 by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eval.heads import Eagle3Config, Eagle3Head

from ..losses import divergence
from ..options import RecipeError, one_of, option, positive
from .base import DraftMethod, aux_feature_cache, batch_aux, draft_ids


@dataclass
class Eagle3Options:
    aux_layers: list[int] = option([], "Target layer ids fused by the head (vLLM's ids: the residual stream "
                                       "entering layer i); [] = vLLM's default (2, N//2, N-3) for an N-layer "
                                       "target ((0, N//2, N-1) below 6 layers).")
    unroll: int = option(3, "Training-time test: draft steps unrolled on the head's own outputs.")
    feature_loss_weight: float = option(0.0, "Weight of a smooth L1 term pulling the head's output toward the "
                                             "target's high aux layer at the next position (EAGLE-3 has none: 0).")
    features: str = option("auto", "The target's aux features: 'cache' (computed once, on disk), 'online' (a "
                                    "target forward per batch), 'auto' (cache when it fits max_cache_gb).")
    max_cache_gb: float = option(16.0, "features=auto: the largest aux-feature cache written (GB); above it, online.")

    def __post_init__(self):
        if len(self.aux_layers) not in (0, 3):
            raise RecipeError(f"train.eagle3.aux_layers={self.aux_layers} must list 3 target layer ids, or [] "
                              f"for vLLM's default")
        positive("train.eagle3.unroll", self.unroll)
        positive("train.eagle3.feature_loss_weight", self.feature_loss_weight, zero_ok=True)
        one_of("train.eagle3.features", self.features, {"auto", "cache", "online"})
        positive("train.eagle3.max_cache_gb", self.max_cache_gb, zero_ok=True)


class Eagle3Trainer(nn.Module):
    """The head and the training-time test; forward(batch) -> loss, metrics. The batch's "feat" holds the
    cached aux features [B, L, 3H]; without it they are computed from `target` (features=online).
    `tc` is the train section (divergence, jsd_beta, eagle3.*)."""

    def __init__(self, head: Eagle3Head, target, tc):
        super().__init__()
        self.head, self.tc = head, tc
        self.layers = tuple(head.config.aux_layers)
        self.target_config = target.config.to_dict()  # the draft file's "target_config" (for the export)
        object.__setattr__(self, "target", target)  # not a submodule: never trained, saved or moved

    def aux(self, batch) -> torch.Tensor:
        return batch_aux(batch, self.target, self.layers)

    def forward(self, batch):
        tc, head, unroll = self.tc, self.head, self.tc.eagle3.unroll
        ids, aux = batch["ids"], self.aux(batch)  # [B, L], [B, L, 3H]
        B, L = ids.shape
        T = L - 2  # head index t: hidden[t] ⊕ emb(tok[t+1]) at slot t -> token t+2
        if T <= 0:
            return aux.sum() * 0, {}
        emb = head.embed_tokens(ids[:, 1:L - 1]).float()  # [B, T, H] (frozen)
        pos = torch.arange(T, device=ids.device)[None].expand(B, -1)
        t_mask = batch["has_t"][:, 2:].reshape(-1)  # teacher for tok[t+2] exists (completion positions)
        tk_ids = batch["tk_ids"][:, 2:].reshape(B * T, -1)
        tk_lp = batch["tk_lp"][:, 2:].reshape(B * T, -1)
        d2t = head.draft_ids
        fused = head.fuse(aux[:, :T])  # [B, T, H]
        w = tc.eagle3.feature_loss_weight
        if w > 0:
            H = aux.shape[-1] // 3
            f_true, f_mask = aux[:, 1:L - 1, 2 * H:], batch["valid"][:, 1:L - 1].float()[..., None]  # high layer, t+1
        hidden, div_total, feat_total, metrics = fused, 0.0, 0.0, {}
        for j in range(unroll):  # training-time test: step j > 0 reads the head's own outputs
            h = head(hidden, emb, pos)  # [B, T, H] pre-norm
            logits = head.logits(h).reshape(B * T, -1)
            div_total = div_total + divergence(tc.divergence, logits, topk_ids=tk_ids, topk_logprobs=tk_lp, d2t=d2t,
                                               beta=tc.jsd_beta, temperature=tc.temperature, mask=t_mask)
            if w > 0:
                feat_total = feat_total + (F.smooth_l1_loss(h.float(), f_true, reduction="none") * f_mask).sum() / (
                    f_mask.sum().clamp(min=1) * h.shape[-1])
            with torch.no_grad():
                acc = ((d2t[logits.argmax(-1)] == tk_ids[:, 0]) & t_mask).sum() / t_mask.sum().clamp(min=1)
            metrics[f"acc_{j}"] = float(acc)
            # shift: h[t-1] stands for the hidden state at t, read with tok[t+1] at index t next step
            hidden = torch.cat([fused[:, :1], h[:, :-1]], 1)
        loss = (div_total + w * feat_total) / unroll
        metrics["div"] = float(div_total.detach()) / unroll
        if w > 0:
            metrics["feat_loss"] = float(feat_total.detach()) / unroll
        return loss, metrics


class Eagle3(DraftMethod):
    name = "eagle3"
    config = Eagle3Options
    help = "one layer over three fused target layers, EAGLE-3, Li et al. 2025: the draft vLLM and SGLang load"
    unhashed = ("features", "max_cache_gb")  # where the target's features come from: switching them resumes

    def layers(self, tc, target) -> list[int]:
        """The aux layer ids for `target`: the recipe's, or vLLM's default (checked against the target)."""
        return Eagle3Config.from_target(target.config, tc.eagle3.aux_layers or None, 0).aux_layers

    def feature_cache(self, tc, target, n_tokens):
        return aux_feature_cache("eagle3", tc.eagle3, self.layers(tc, target), target, n_tokens)

    def build(self, tc, target, tokenizer, rows, resume):
        head = Eagle3Head.from_target(target, self.layers(tc, target), draft_ids(tc, target, rows)).float()
        if resume is not None:
            head.load_state_dict(Eagle3Head.load(resume).state_dict())
        return Eagle3Trainer(head, target, tc)

    def trainable_parameters(self, module):
        return [p for p in module.head.parameters() if p.requires_grad]  # the embedding is the target's, frozen

    def vocab_size(self, module, target):
        return len(module.head.d2t)

    def save(self, module, directory, extra, step):
        module.head.save(directory, extra={"target_config": module.target_config, **extra, "step": step})
