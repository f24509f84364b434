"""The EAGLE head: one decoder layer over the target's features.

EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"):
one decoder layer over [target feature ⊕ embedding of the next token] predicts the next *feature*;
the head is autoregressive at the feature level and its logits come from an LM head.

The decoder layer is written by hand (not transformers' LlamaDecoderLayer) because the decoder needs
a preallocated, position-indexed KV cache: a rejected draft token's slot is simply overwritten later,
and each sequence of a ragged batch writes at its own positions. The same module trains without a
cache (plain causal attention).

"Feature" here means the target's final hidden state after its final norm
(the decoder's `last_hidden_state` on every family, eval.family.final_features), i.e. the input
of the target's LM head.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers import KVCache, RMSNorm, apply_rope, rope_cos_sin
from .io import load_head, save_head


@dataclass
class HeadConfig:
    """The EAGLE head's shape; from_target copies the target's. Saved as "head_config" in the draft file."""

    hidden_size: int  # the target's hidden size (features and embeddings)
    num_attention_heads: int  # query heads of the head's decoder layer
    num_key_value_heads: int  # key/value heads (GQA)
    head_dim: int  # width of one attention head
    intermediate_size: int  # SwiGLU MLP width
    rms_norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # rows of the head's LM head (== vocab_size when not truncated)
    num_layers: int = 1  # decoder layers in the head

    @classmethod
    def from_target(cls, cfg, num_layers: int = 1, draft_vocab_size: int = 0) -> "HeadConfig":
        """The head for a target of HF config `cfg`, any family: names a family lacks (GPT-2 has no
        num_key_value_heads, intermediate_size or rms_norm_eps) take the value that family implies."""
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
        head_dim = getattr(cfg, "head_dim", None) or H // nh
        inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * H
        eps = next((getattr(cfg, a) for a in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
                    if getattr(cfg, a, None)), 1e-6)
        return cls(H, nh, getattr(cfg, "num_key_value_heads", None) or nh, head_dim, inter, float(eps),
                   float(theta), cfg.vocab_size, draft_vocab_size or cfg.vocab_size, num_layers)


def init_norm(norm: RMSNorm, target) -> None:
    """The head's final RMSNorm starts as the target's final norm where that is an RMSNorm (its gain,
    Gemma's 1 + w included); a LayerNorm target (GPT-2, GPT-NeoX) keeps the fresh ones, with a warning:
    its centring and bias have no RMSNorm counterpart."""
    import warnings

    from ..family import rms_norm_gain

    g, why = rms_norm_gain(target)
    if g is None:
        warnings.warn(f"{why}: the head's norm starts at ones", stacklevel=3)
        return
    norm.weight.copy_(g)


def attention(c, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """A head layer's attention with RoPE at positions pos [B, T], from the projections q [B, T, nh*hd],
    k, v [B, T, nkv*hd] (c: the head's config) -> [B, T, nh*hd], the input of o_proj. Without a cache:
    causal attention over T (training). With one: keys/values are written at `pos` and queries attend
    to every slot <= their own position (or to `mask` [B, 1, T, S] when given)."""
    B, T, _ = q.shape
    q = q.view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
    k = k.view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    v = v.view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, q.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = c.num_attention_heads // c.num_key_value_heads
    if cache is None:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    else:
        k, v = cache.write(pos, k, v)  # [B, n_kv, S, hd]
        if mask is None:
            slots = torch.arange(k.shape[2], device=q.device)
            mask = (slots[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return a.transpose(1, 2).reshape(B, T, -1)


class Block(nn.Module):
    """A Llama decoder layer (pre-norm, GQA attention with RoPE, SwiGLU MLP)."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H]; pos [B, T] absolute positions. Without a cache: causal attention over T
        (training). With one: keys/values are written at `pos` and queries attend to every slot
        <= their own position (or to `mask` [B, 1, T, S] when given)."""
        h = self.input_layernorm(x)
        x = x + self.o_proj(attention(self.c, self.q_proj(h), self.k_proj(h), self.v_proj(h), pos, cache, mask))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class EagleHead(nn.Module):
    """feature_t ⊕ embed(token_{t+1}) -> predicted feature_{t+1} -> draft logits over the draft vocab.

    `d2t` maps draft-vocab rows to target token ids (the truncated vocabulary, kept with the
    checkpoint); it is the identity when the vocabulary is not truncated. Token embeddings are the
    target's own (frozen, passed in), so the head stores no copy of the 49k-row embedding table.
    """

    def __init__(self, c: HeadConfig, d2t: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if d2t is None:
            d2t = torch.arange(c.draft_vocab_size)
        assert d2t.shape == (c.draft_vocab_size,), "d2t must map every draft row to a target id"
        self.register_buffer("d2t", d2t.long(), persistent=True)

    @classmethod
    def from_target(cls, target, num_layers: int = 1, draft_ids: torch.Tensor | None = None) -> "EagleHead":
        """A fresh head for `target` (an HF causal LM): LM head rows and final norm copied from the
        target so the head starts out reading features the way the target does."""
        n = 0 if draft_ids is None else len(draft_ids)
        c = HeadConfig.from_target(target.config, num_layers, n)
        head = cls(c, draft_ids)
        W = target.get_output_embeddings().weight.detach()
        with torch.no_grad():
            head.lm_head.weight.copy_(W[head.d2t].float())
            init_norm(head.norm, target)
            # Start close to "pass the feature through": identity on the feature half of fc.
            H = c.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, :H].copy_(torch.eye(H))
            head.fc.weight[:, H:].normal_(0, 1 / math.sqrt(H))
            head.fc.bias.zero_()
        return head

    def forward(self, feat: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor,
                caches: list[KVCache] | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """feat [B, T, H] target (or predicted) features at positions pos-1... aligned with emb [B, T, H],
        the embeddings of the tokens at `pos` [B, T]. Returns predicted features [B, T, H]."""
        x = self.fc(torch.cat([feat, emb], dim=-1))
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, None if caches is None else caches[i], mask)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T, draft_vocab_size]; map argmax rows to target ids with self.d2t."""
        return self.lm_head(self.norm(h))

    def new_caches(self, batch: int, max_len: int, dtype=None, device=None) -> list[KVCache]:
        c = self.config
        p = self.fc.weight
        return [KVCache(batch, c.num_key_value_heads, max_len, c.head_dim, dtype or p.dtype, device or p.device)
                for _ in range(c.num_layers)]

    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        save_head(self, directory, {"kind": "eagle", "head_config": asdict(self.config), **(extra or {})})

    @classmethod
    def load(cls, directory: str | Path, dtype=None, device=None) -> "EagleHead":
        return load_head(directory, "eagle", "an eagle head",
                         lambda meta, d2t: cls(HeadConfig(**meta["head_config"]), d2t), dtype, device)
