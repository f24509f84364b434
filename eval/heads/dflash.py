"""The DFlash draft: a block of tokens in one forward (Chen et al., 2026, "DFlash: Block Diffusion for Flash
Speculative Decoding"), as speculators 0.9 defines it and vLLM 0.32 serves it (qwen3_dflash.py).

The target's residual streams entering `aux_layers` (vLLM's ids, as EAGLE-3's) are concatenated and fused
into a context, ctx = hidden_norm(fc(aux)) [.., H], which every layer projects into keys and values of its own
(k_proj, then k_norm and RoPE at the context's positions; v_proj): the context asks nothing, it is attended
to. A round's query block is [anchor, mask x k] at positions a..a+k: the anchor is the token the target just
produced at a (its feature does not exist yet, so the context stops at a - 1), the masks are `mask_token_id`.
Each layer is a Qwen3 decoder layer (pre-norm, q_norm/k_norm over each head before RoPE, SwiGLU MLP) whose
block queries attend to the context before a and to the block, causally (`causal`, speculators' default,
and what vLLM 0.32 serves) or all of it. Slot s >= 1 of the block gives the draft for position a + s, so one
forward drafts k tokens; slot 0's logits are unused.

The state dict uses speculators' names (fc, hidden_norm, layers.N.self_attn.{q,k,v,o}_proj,
layers.N.self_attn.{q,k}_norm, layers.N.mlp.{gate,up,down}_proj, layers.N.{input,post_attention}_layernorm,
norm, lm_head, d2t offsets and t2d), plus embed_tokens, a frozen copy of the target's that the export drops
(speculators 0.9 and vLLM take the verifier's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers import KVCache, RMSNorm, apply_rope, rope_cos_sin
from .eagle import HeadConfig
from .eagle3 import Eagle3MLP, SpeculatorsHead, resolve_aux_layers
from .io import load_head, save_head


@dataclass
class DFlashConfig:
    """The DFlash draft's shape; saved as "head_config" in the draft file (the export reads it)."""

    hidden_size: int  # the draft's width (== the target's: embeddings and LM head rows are copies)
    num_attention_heads: int  # query heads per layer
    num_key_value_heads: int  # key/value heads (GQA)
    head_dim: int  # width of one attention head
    intermediate_size: int  # SwiGLU MLP width
    rms_norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    max_position_embeddings: int  # the target's context length
    vocab_size: int  # the target's vocabulary (rows of embed_tokens, length of t2d)
    draft_vocab_size: int  # rows of lm_head (== vocab_size when not truncated)
    target_hidden_size: int  # width of one target feature (fc reads len(aux_layers) of them)
    num_layers: int  # decoder layers
    block_size: int  # tokens per query block: the anchor and block_size - 1 masks (K = block_size - 1)
    mask_token_id: int  # the id whose (frozen) embedding fills the block after the anchor
    aux_layers: list[int] = field(default_factory=list)  # target layer ids whose entering residual streams form the context
    causal: bool = True  # block queries attend to earlier block slots only (speculators' default; vLLM 0.32 serves it so)

    def __post_init__(self):
        self.aux_layers = [int(i) for i in self.aux_layers]
        if not self.aux_layers:
            raise ValueError("DFlash reads at least one target layer; aux_layers is empty")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block holds the anchor and at least one mask")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is not a row of the {self.vocab_size}-token embedding")

    @classmethod
    def from_target(cls, cfg, num_layers: int, block_size: int, mask_token_id: int, aux_layers=None,
                    draft_vocab_size: int = 0) -> "DFlashConfig":
        """The draft for a target of HF config `cfg`: its attention and MLP shapes; `aux_layers` None or empty:
        vLLM's default (eval/heads/eagle3.py default_aux_layers), each in 0..N-1."""
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        h = HeadConfig.from_target(cfg, num_layers, draft_vocab_size)
        layers = resolve_aux_layers(cfg.num_hidden_layers, aux_layers)
        return cls(h.hidden_size, h.num_attention_heads, h.num_key_value_heads, h.head_dim, h.intermediate_size,
                   h.rms_norm_eps, h.rope_theta, int(getattr(cfg, "max_position_embeddings", 2048)), h.vocab_size,
                   h.draft_vocab_size, cfg.hidden_size, num_layers, block_size, mask_token_id, layers)


def mask_token_for(tokenizer, vocab_size: int, config=None) -> int:
    """speculators' choice of the mask id (train/utils.py resolve_mask_token_id): the tokenizer's mask token;
    else the first row past the tokenizer, where the embedding has spare rows; else pad, eos, unk. Without a
    tokenizer, the target config's pad or eos id."""
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return int(tokenizer.mask_token_id)
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
    names = ("pad_token_id", "eos_token_id", "unk_token_id") if tokenizer is not None else ("pad_token_id", "eos_token_id")
    for name in names:
        tid = getattr(tokenizer if tokenizer is not None else config, name, None)
        if isinstance(tid, list):
            tid = tid[0] if tid else None
        if tid is not None:
            return int(tid)
    raise ValueError("the tokenizer has no mask, pad, eos or unk token and no spare embedding row: give "
                     "train.dflash.mask_token_id")


class DFlashAttention(nn.Module):
    """GQA attention with Qwen3's per-head q_norm/k_norm before RoPE; keys and values are [context ; block]."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, pos: torch.Tensor):
        """x [B, T, H] at positions pos [B, T] -> k, v [B, nkv, T, hd] (k normed and rotated)."""
        B, T, _ = x.shape
        c = self.c
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, k.dtype)
        return apply_rope(k, cos, sin), v

    def forward(self, x, pos, ctx_k, ctx_v, mask, cache: KVCache | None = None):
        """x [B, Q, H] block inputs at positions pos [B, Q]; ctx_k, ctx_v [B, nkv, S, hd] the context's keys and
        values (a cache's whole storage, or the training rows'); mask [B, 1, Q, S (+ Q without a cache)] True
        where a query may look. With `cache` the block's keys are written into it at `pos` (slots the next
        context write overwrites) and attention runs over the cache alone; without, over [context ; block]."""
        B, Q, _ = x.shape
        c = self.c
        q = self.q_norm(self.q_proj(x).view(B, Q, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, q.dtype)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, pos)
        if cache is not None:
            k, v = cache.write(pos, k, v)  # [B, nkv, S, hd]
        else:
            k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)  # [B, nkv, S + Q, hd]
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        return self.o_proj(a.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Eagle3MLP(c)

    def forward(self, x, pos, ctx_k, ctx_v, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), pos, ctx_k, ctx_v, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(SpeculatorsHead):
    """aux features -> context keys/values per layer; [anchor, masks] -> one forward -> draft logits, over the
    draft vocabulary of SpeculatorsHead."""

    def __init__(self, c: DFlashConfig, d2t: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen (speculators: never saved)
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.register_vocab(c.vocab_size, c.draft_vocab_size, d2t)

    @classmethod
    def from_target(cls, target, num_layers: int, block_size: int, mask_token_id: int, aux_layers=None,
                    draft_ids: torch.Tensor | None = None) -> "DFlashHead":
        """A fresh draft for `target` (an HF causal LM): its embedding, LM head rows `draft_ids` (sorted target
        ids; None: all) and final norm copied; fc starts as "the high layer's feature" (identity on its last
        block of columns), so the context begins as a real target feature."""
        n = 0 if draft_ids is None else len(draft_ids)
        c = DFlashConfig.from_target(target.config, num_layers, block_size, mask_token_id, aux_layers, n)
        ids = torch.arange(c.draft_vocab_size) if draft_ids is None else torch.as_tensor(draft_ids).long()
        head = cls(c, ids - torch.arange(len(ids)))
        head.init_from_target(target, ids)
        return head

    @torch.no_grad()
    def copy_layers_from(self, target) -> str:
        """Start the decoder layers as the target's last `num_layers` layers: every attention and MLP weight, which
        the two name alike, and the gains of their RMSNorms (q_norm and k_norm where the target has them);
        hidden_norm as the first copied layer's input norm, since the context enters every layer where that
        norm's output would. Biases (Qwen2's q, k and v) are not copied: the draft's projections have none.
        Better held-out acceptance than random layers (docs/reference/training.md, "Where the held-out gap is").
        -> "" when copied, else why not (nothing is changed then)."""
        from ..family import describe, layer_list, norm_gain

        _, src = layer_list(target)
        if len(src) < len(self.layers):
            return f"{describe(target)} has {len(src)} layers, fewer than the draft's {len(self.layers)}"
        src = src[len(src) - len(self.layers):]
        norms = {"input_layernorm", "post_attention_layernorm"}
        copies = []  # (draft tensor, source tensor)
        for mine, theirs in zip(self.layers, src):
            names = {n for n, _ in theirs.named_children() if "norm" in n}
            if names != norms:
                return f"{describe(target)}'s layers have the norms {sorted(names)}, not Llama's {sorted(norms)}"
            params = dict(theirs.named_parameters())
            for name, p in mine.named_parameters():
                if not name.endswith("_proj.weight"):
                    continue
                q = params.get(name)
                if q is None or q.shape != p.shape:
                    return f"{describe(target)}'s layers have no {name} of shape {tuple(p.shape)}"
                copies.append((p, q))
            modules = dict(theirs.named_modules())
            for name, norm in mine.named_modules():
                if not isinstance(norm, RMSNorm):
                    continue
                other = modules.get(name)
                if other is None and name in norms:
                    return f"{describe(target)}'s layers have no {name}"
                g = norm_gain(other, norm.weight.shape[0]) if other is not None else torch.ones_like(norm.weight)
                if g is None:
                    return f"{describe(target)}'s {name} is a {type(other).__name__}, not an RMSNorm"
                copies.append((norm.weight, g))
        g = norm_gain(src[0].input_layernorm, self.config.hidden_size)
        for p, q in copies + [(self.hidden_norm.weight, g)]:
            p.copy_(q.to(p.dtype))
        return ""

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux features [B, T, A*Ht] -> the context [B, T, H]."""
        return self.hidden_norm(self.fc(aux))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The context [B, T, H] at positions pos [B, T] -> per layer (k, v) [B, nkv, T, hd]."""
        return [layer.self_attn.kv(ctx, pos) for layer in self.layers]

    def block_input(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """anchors [...] token ids -> the blocks' inputs [..., k + 1, H]: embed(anchor), then k mask embeddings."""
        ids = torch.full((*anchors.shape, k + 1), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return self.embed_tokens(ids)

    def forward(self, x, pos, kv, mask, caches: list[KVCache] | None = None) -> torch.Tensor:
        """x [B, Q, H] block inputs at positions pos [B, Q]; kv: per layer (ctx_k, ctx_v) (training) or None
        with `caches` (decoding: each layer's cache holds the context); mask [B, 1, Q, S(+Q)] -> the last
        layer's output before the final norm [B, Q, H]."""
        for i, layer in enumerate(self.layers):
            if caches is not None:
                x = layer(x, pos, None, None, mask, caches[i])
            else:
                x = layer(x, pos, kv[i][0], kv[i][1], mask)
        return x

    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        save_head(self, directory, {"kind": "dflash", "head_config": asdict(self.config), **(extra or {})})

    @classmethod
    def load(cls, directory: str | Path, dtype=None, device=None) -> "DFlashHead":
        return load_head(directory, "dflash", "a DFlash draft",
                         lambda meta, d2t: cls(DFlashConfig(**meta["head_config"]), d2t), dtype, device)


def block_mask(anchor: torch.Tensor, k: int, S: int, causal: bool) -> torch.Tensor:
    """Decoding: anchor [B] positions, a block of k + 1 queries at anchor..anchor+k over a cache of S slots
    holding the context below the anchor and the block itself -> [B, 1, k + 1, S] True where a query looks."""
    slots = torch.arange(S, device=anchor.device)  # [S]
    last = anchor[:, None] + (torch.arange(k + 1, device=anchor.device) if causal else k)  # [B, k + 1]
    return (slots[None, None, :] <= last[:, :, None])[:, None]
