"""Medusa heads (`eval/heads/medusa.py`) trained on the cached target features.

Medusa-1 (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): the target stays frozen, its features come from the feature cache (no target
forward per step), and the loss of head i is weighted by lambda_i = 0.8 ** i (the paper's choice:
later heads are less certain and matter less, since a draft is only used when all the drafts before
it were accepted). Here each head's loss is the recipe's divergence to the target's stored top-k
distribution rather than cross-entropy to the next tokens (self-distillation, Medusa's section 3.2.2).

Alignment: head i at feature index t predicts the token at t + 2 + i, whose teacher is the top-k row
stored at that TOKEN position (tk_ids / tk_lp [:, t + 2 + i], present where has_t [:, t + 2 + i]).

On-policy positions only: at decode time head i reads the feature that produced token t + 1 and the
tokens t + 1 .. t + 1 + i in between are the target's own greedy choices, which the head cannot see.
So head i trains at t only where those tokens are the target's top-1 (ids == tk_ids[..., 0]): always
true of greedy generated completions, and true of the raw-text mix (train.raw_windows) exactly where
the text happens to follow the target. Elsewhere the teacher at t + 2 + i is conditioned on a token
the target would not have produced, and training on it did not help (docs/reference/training.md).

Recurrent heads (train.medusa.recurrent) are teacher-forced: head i reads the embeddings of tokens
t + 1 .. t + 1 + i, which on those same positions are the target's greedy tokens, i.e. what head i
reads at decode time whenever its draft can count (the drafts before it accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eval.heads import MedusaHeads

from ..losses import divergence
from ..options import RecipeError, option, positive
from .base import DraftMethod, draft_ids, frozen_embedding


@dataclass
class MedusaOptions:
    heads: int = option(3, "Heads, i.e. further positions predicted from one feature (the largest K "
                           "served; docs/reference/training.md).")
    recurrent: bool = option(True, "Each head also reads the previous head's state and the token before the "
                                   "one it predicts (ReDrafter / Hydra-style recurrent heads, eval/heads/medusa.py); "
                                   "false: Medusa-1's independent heads.")
    shared_lm_head: bool = option(False, "The heads read out through ONE frozen LM head, the target's rows of the "
                                         "draft vocabulary, as vLLM's MedusaModel serves a truncated vocabulary "
                                         "(original_lm_head + token_map: `draftsmith export --format medusa`); "
                                         "independent heads only. false: an LM head each (trained).")
    layers: int = option(1, "Residual blocks per independent head (Medusa's medusa_num_layers): their capacity when "
                            "they share the LM head. Recurrent heads have one TokenBlock each.")

    def __post_init__(self):
        positive("train.medusa.heads", self.heads)
        positive("train.medusa.layers", self.layers)
        if self.recurrent and (self.shared_lm_head or self.layers != 1):
            key = "shared_lm_head=true" if self.shared_lm_head else f"layers={self.layers}"
            raise RecipeError(f"train.medusa.{key} is for independent heads; recurrent heads (train.medusa.recurrent="
                              f"true) have one TokenBlock and an LM head each: set train.medusa.recurrent=false")


HEAD_DECAY = 0.8  # Medusa's lambda_i = 0.8 ** i


class MedusaTrainer(nn.Module):
    """forward(batch) -> (loss, metrics). batch as `pipeline.train_data.collate` makes it, with "feat".

    loss = sum_i 0.8^i div_i / sum_i 0.8^i over the heads with a target in the window; div_i is the
    masked mean divergence of head i over the positions whose token at t + 2 + i has a teacher.
    metrics: acc_i (top-1 of head i, mapped through d2t, == the teacher's top-1, over those
    positions), div_i, and div (the weighted divergence, the loss)."""

    def __init__(self, heads: MedusaHeads, tc, embed: nn.Embedding | None = None):
        super().__init__()
        self.heads, self.tc = heads, tc
        if heads.recurrent and embed is None:
            raise ValueError("recurrent Medusa heads read token embeddings: pass the target's input embedding")
        self.embed = embed  # frozen: the target's own
        if embed is not None:
            embed.weight.requires_grad_(False)

    def forward(self, batch):
        heads, tc = self.heads, self.tc
        feat = batch["feat"].float()  # [B, L, H] (cached in the target's dtype, often bf16)
        ids, has_t, tk_ids, tk_lp = batch["ids"], batch["has_t"], batch["tk_ids"], batch["tk_lp"]  # [B, L], [B, L, k] x2
        greedy = has_t & (ids == tk_ids[..., 0])  # [B, L]: token j is the target's top-1
        B, L = ids.shape
        n = min(heads.num_heads, L - 2)
        masks = []
        for i in range(n):
            T = L - 2 - i  # feature indices t = 0..T-1 predict tokens 2+i..L-1
            m = has_t[:, 2 + i:].clone()  # [B, T] the token at t+2+i has a teacher ...
            for j in range(i + 1):  # ... and the tokens t+1..t+1+i between are the target's greedy ones
                m &= greedy[:, 1 + j:1 + j + T]
            masks.append(F.pad(m, (0, L - T)))  # [B, L]; each within head 0's (it needs greedy t+1, t+2)
        if heads.recurrent and n > 0:
            # Teacher-forced states, computed only where head 0 trains (prompts and padding skipped):
            # state i at t reads tokens t+1..t+1+i.
            sel = masks[0]  # [B, L]
            with torch.no_grad():
                nxt = torch.stack([F.pad(ids[:, 1 + i:], (0, 1 + i)) for i in range(n)], -1)  # [B, L, n]
                embs = self.embed(nxt[sel])  # [M0, n, H]
            states = heads.states(feat[sel], embs.to(feat.dtype))  # [M0, n, H]
        total, wsum, metrics = 0.0, 0.0, {}
        for i in range(n):
            T = L - 2 - i
            m = masks[i][:, :T]
            if not bool(m.any()):
                continue
            # Only the positions with a teacher go through the LM head (prompts and padding do not).
            if heads.recurrent:
                logits = heads.lm_heads[i](states[masks[i][sel], i]).float()  # [M, Vd]
            else:
                logits = heads.head_logits(feat[:, :T][m], i).float()  # [M, Vd] (bf16 under autocast: the loss in float)
            t_ids, t_lp = tk_ids[:, 2 + i:][m], tk_lp[:, 2 + i:][m]  # [M, k], [M, k]
            div = divergence(tc.divergence, logits, topk_ids=t_ids, topk_logprobs=t_lp, d2t=heads.d2t,
                             beta=tc.jsd_beta, temperature=tc.temperature)
            w = HEAD_DECAY ** i
            total, wsum = total + w * div, wsum + w
            with torch.no_grad():
                acc = (heads.d2t[logits.argmax(-1)] == t_ids[:, 0]).float().mean()
            metrics[f"acc_{i}"] = float(acc)
            metrics[f"div_{i}"] = float(div.detach())
        if wsum == 0:  # no teacher in this batch's windows: a zero loss that still has a graph
            loss = sum(p.sum() for p in heads.parameters()) * 0.0
        else:
            loss = total / wsum
        metrics["div"] = float(loss.detach())
        return loss, metrics


class Medusa(DraftMethod):
    name = "medusa"
    config = MedusaOptions
    help = "heads on the target's last feature, one per further position, Cai et al. 2024"
    # recurrent heads, and Medusa-1's independent ones
    variants = {"medusa": {"medusa": {"recurrent": True}}, "medusa_indep": {"medusa": {"recurrent": False}}}
    flat = True
    flat_names = {"heads": "medusa_heads", "recurrent": "medusa_recurrent", "shared_lm_head": "medusa_shared_lm_head",
                  "layers": "medusa_layers"}
    needs_features = True

    def build(self, tc, target, tokenizer, rows, resume):
        ids = draft_ids(tc, target, rows)
        embed = frozen_embedding(target) if tc.medusa.recurrent else None
        mo = tc.medusa
        heads = MedusaHeads.from_target(target, mo.heads, ids, num_layers=mo.layers, recurrent=mo.recurrent,
                                        shared_lm_head=mo.shared_lm_head).float()
        if resume is not None:
            heads.load_state_dict(MedusaHeads.load(resume).state_dict())
        if mo.shared_lm_head:  # the target's own rows, as the engine's original_lm_head reads them
            heads.lm_heads[0].weight.requires_grad_(False)
        return MedusaTrainer(heads, tc, embed)

    def trainable_parameters(self, module):
        return [p for p in module.heads.parameters() if p.requires_grad]

    def vocab_size(self, module, target):
        return len(module.heads.d2t)

    def save(self, module, directory, extra, step):
        module.heads.save(directory, extra={**extra, "step": step})
