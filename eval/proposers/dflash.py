"""The DFlash proposer: a DFlashHead (eval/heads/dflash.py) drafting a whole block in one forward."""

from __future__ import annotations

import torch

from ..heads.dflash import DFlashHead, block_mask
from .base import Proposer, draw, target_device


class DFlashProposer(Proposer):
    """DFlash over the target's aux features (the residual streams entering `feature_layers`).

    Each layer's cache holds the context's keys and values by position: begin() writes the prompt's,
    accept() the verified tokens' (a rejected draft's slot is overwritten before a later block can read it).
    A round is one forward of the block [current token, mask x k] at positions a..a+k, a the current token's;
    the block's own keys go into the cache slots a..a+k, which the next accept() overwrites. The drafts do not
    read each other (each slot sees masks, not the tokens drafted before it), so under sampling each is drawn
    from its own slot's distribution, and that distribution is its q."""

    name = "dflash"
    uses_features = True

    def __init__(self, head: DFlashHead, target):
        p = target.get_output_embeddings().weight
        self.head = head.to(device=p.device, dtype=p.dtype).eval()
        self.feature_layers = tuple(head.config.aux_layers)
        self.block_k = head.config.block_size - 1  # the most a block drafts (asked for more, it gives these)
        self.draft_ids = self.head.draft_ids  # [Vd] draft row -> target id
        self.vocab_size = target.config.vocab_size

    def _write_context(self, features: torch.Tensor, pos: torch.Tensor):
        """features [B, T, A*Ht] of the tokens at positions pos [B, T] -> every layer's cache at pos."""
        ctx = self.head.context(features.to(self.head.fc.weight.dtype))  # [B, T, H]
        for cache, (k, v) in zip(self.caches, self.head.context_kv(ctx, pos)):
            cache.write(pos, k, v)

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.sampling = sampling
        B, dev = len(prompts), first.device
        self.caches = self.head.new_caches(B, max_len + self.block_k + 1)
        T = features.shape[1]
        self._write_context(features, torch.arange(T, device=dev).expand(B, T))  # past a prompt's end: junk, masked
        self.anchor = torch.tensor([len(p) for p in prompts], device=dev)  # [B] the current token's position
        self.cur = first  # [B]

    def propose(self, k):
        k = min(k, self.block_k)
        pos = self.anchor[:, None] + torch.arange(k + 1, device=self.anchor.device)  # [B, k + 1]
        mask = block_mask(self.anchor, k, self.caches[0].k.shape[2], self.head.config.causal)  # [B, 1, k + 1, S]
        h = self.head(self.head.block_input(self.cur, k), pos, None, mask, self.caches)[:, 1:]  # [B, k, H]
        logits = self.head.logits(h)  # [B, k, Vd]
        return draw(logits, self.sampling, self.draft_ids, self.vocab_size)  # [B, k], [B, k, V] | None

    def accept(self, tokens, start, n_acc, bonus, features=None):
        # the verified tokens' features at start..start+T-1 become context (columns past a row's accepted ones
        # sit at or above its new anchor, where no block looks before they are overwritten); a finished row
        # (n_acc == -1) keeps its anchor
        T = features.shape[1]
        self._write_context(features, start[:, None] + torch.arange(T, device=start.device))
        live = n_acc >= 0
        self.anchor = torch.where(live, start + n_acc + 1, self.anchor)
        self.cur = torch.where(live, bonus, self.cur)


def load(directory, meta, target, dtype) -> DFlashProposer:
    """The draft kind 'dflash''s loader (eval/draft_dir.py): its head.safetensors, served over `target`."""
    return DFlashProposer(DFlashHead.load(directory, dtype=dtype, device=target_device(target)), target)
