"""Layers shared by the target's lean forward (eval/target.py) and the draft heads (eval/heads/):
RMSNorm, Llama's rotary embedding, and a preallocated KV cache indexed by absolute position (a rejected
draft's slot is overwritten by a later write, never cropped)."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """pos [B, T] -> cos, sin [B, 1, T, head_dim] (Llama's rotate-half convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    ang = pos.float()[..., None] * inv  # [B, T, hd/2]
    emb = torch.cat([ang, ang], dim=-1)[:, None]  # [B, 1, T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, nh, T, hd] rotated by cos, sin from rope_cos_sin (HF's rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """Preallocated per-layer keys/values indexed by absolute position: k, v [B, n_kv, S_max, hd]."""

    def __init__(self, batch: int, n_kv: int, max_len: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """A cache over existing storage k, v [B, n_kv, S_max, hd] (e.g. one layer's slice of a cache
        stacked over layers)."""
        c = cls.__new__(cls)
        c.k, c.v = k, v
        return c

    def write(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """pos [B, T]; k, v [B, n_kv, T, hd] -> slots pos of each row (overwrites whatever was there),
        converted to the cache's dtype (eval.target's CPU cache: bf16 under its attention kernel, else float32)."""
        # one row: consecutive positions, a slice copy beats indexing (not under torch.compile: int() breaks the graph).
        # Several rows: index_put_, not scatter_ (2.6x faster in float32 on CPU, 50x in bf16: docs/reference/verify-cost.md)
        if k.shape[0] == 1 and k.device.type == "cpu" and not torch.compiler.is_compiling():
            start = int(pos[0, 0])  # a host read, free on CPU (CUDA keeps the sync-free scatter)
            self.k[:, :, start:start + k.shape[2]] = k
            self.v[:, :, start:start + k.shape[2]] = v
            return self.k, self.v
        rows = torch.arange(k.shape[0], device=pos.device)[:, None]  # [B, 1]
        self.k[rows, :, pos] = k.transpose(1, 2).to(self.k.dtype)  # [B, T, n_kv, hd] at (b, pos[b, t])
        self.v[rows, :, pos] = v.transpose(1, 2).to(self.v.dtype)
        return self.k, self.v
