"""The attention masks both runners build (eval/target.py's LeanLlama, eval/hf_forward.py's HFFallback): a
chain's causal mask over the position-indexed cache, and the sliding-window masks of a tree's slots."""

from __future__ import annotations

import torch


def window_masks(mask: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, windows) -> dict:
    """mask [B, 1, T, S] (which slots each query sees), pos/slots [B, T] of this forward -> {W: mask with
    the slots older than W positions hidden} for each window W in `windows` (None: `mask` itself).
    A slot written now holds its token's position; every other visible slot is a committed one, whose
    position is its index (the cache is position-indexed), so trees get their nodes' true distances."""
    B, S = mask.shape[0], mask.shape[-1]
    cols = torch.arange(S, device=mask.device)
    held = cols.expand(B, S).clone().scatter_(1, slots, pos)  # [B, S] position in each slot
    return {w: mask if w is None else mask & (held[:, None, None, :] > pos[:, None, :, None] - w)
            for w in set(windows)}


def causal_mask(pos: torch.Tensor, s_len: int) -> torch.Tensor:
    """pos [B, T] -> [B, 1, T, s_len]: query at position p sees slots 0..p of its own row (a chain)."""
    cols = torch.arange(s_len, device=pos.device)
    return (cols[None, None, :] <= pos[:, :, None])[:, None]
