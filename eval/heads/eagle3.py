"""The EAGLE-3 head: one decoder layer over three of the target's layers, fused (Li et al., 2025,
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test").

Where the EAGLE head (eagle.py) reads the target's final feature, EAGLE-3 reads the residual streams
entering three target layers (low, middle, high: `aux_layers`, vLLM's layer ids), concatenated
[3H] and fused by `fc` (3H -> H, no bias). Its one decoder layer attends over
[input_layernorm(embed(token)) ⊕ hidden_norm(fused)] (2H), as vLLM's llama_eagle3.py; the residual
is the fused feature before hidden_norm (norm_before_residual false, the EAGLE reference's and
SGLang's layout) or after it (true). The layer's output before the final norm is what the next draft
step reads in place of the fused feature (no fc), and the LM head reads norm(output).

The state dict uses the speculators / vLLM names (the draft-directory contract, docs/DESIGN.md):
embed_tokens, fc, layers.0.{hidden_norm, input_layernorm, self_attn.*, post_attention_layernorm,
mlp.*}, norm, lm_head, d2t (int64 offsets: target id = draft id + d2t[draft id]) and t2d (bool over
the target vocabulary: the id is in the draft vocabulary). The embedding is a frozen copy of the
target's, so an engine loading the directory needs nothing shared.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers import KVCache, RMSNorm
from .eagle import HeadConfig, attention, init_norm
from .io import load_head, save_head


def default_aux_layers(n_layers: int) -> list[int]:
    """vLLM's default layer ids (2, N//2, N-3) for an N-layer target where they fit (N >= 6: inside the
    target and in order). Shallower targets (test models of 1-5 layers) get (0, N//2, N-1): the
    embeddings, the middle layer's input and the last layer's input."""
    N = n_layers
    return [2, N // 2, N - 3] if N >= 6 else [0, N // 2, max(N - 1, 0)]


def resolve_aux_layers(N: int, aux_layers=None) -> list[int]:
    """The aux layer ids for an N-layer target: `aux_layers`, or default_aux_layers(N) when None or empty;
    ValueError unless each is in 0..N-1 (layer N's input would be the final norm's, which HF's hidden_states
    give after the norm and vLLM before it)."""
    layers = list(aux_layers) if aux_layers else default_aux_layers(N)
    bad = [i for i in layers if not 0 <= i < N]
    if bad:
        raise ValueError(f"aux_layers={layers}: layer id {bad[0]} is outside the target's {N} layers "
                         f"(give ids in 0..{N - 1}, or none for the default {default_aux_layers(N)})")
    return layers


@dataclass
class Eagle3Config:
    """The EAGLE-3 head's shape; saved as "head_config" in the draft file (the export reads it)."""

    hidden_size: int  # the head's width (== the target's: its embedding and LM head rows are copies)
    num_attention_heads: int  # query heads of the decoder layer
    num_key_value_heads: int  # key/value heads (GQA)
    head_dim: int  # width of one attention head
    intermediate_size: int  # SwiGLU MLP width
    rms_norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    max_position_embeddings: int  # the target's context length
    vocab_size: int  # the target's vocabulary (rows of embed_tokens, length of t2d)
    draft_vocab_size: int  # rows of lm_head (== vocab_size when not truncated)
    target_hidden_size: int  # width of one target feature (fc reads 3 of them)
    norm_before_residual: bool = False  # the residual is the fused feature after hidden_norm (else before)
    aux_layers: list[int] = field(default_factory=list)  # target layer ids whose entering residual streams are fused

    def __post_init__(self):
        self.aux_layers = [int(i) for i in self.aux_layers]
        if len(self.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers; aux_layers={self.aux_layers} (give 3 layer ids)")

    @classmethod
    def from_target(cls, cfg, aux_layers=None, draft_vocab_size: int = 0) -> "Eagle3Config":
        """The head for a target of HF config `cfg`: its attention and MLP shapes, and `aux_layers` (None
        or empty: default_aux_layers), each in 0..N-1 (layer N's input would be the final norm's, which
        HF's hidden_states give after the norm and vLLM before it)."""
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        h = HeadConfig.from_target(cfg, 1, draft_vocab_size)
        layers = resolve_aux_layers(cfg.num_hidden_layers, aux_layers)
        return cls(h.hidden_size, h.num_attention_heads, h.num_key_value_heads, h.head_dim, h.intermediate_size,
                   h.rms_norm_eps, h.rope_theta, int(getattr(cfg, "max_position_embeddings", 2048)), h.vocab_size,
                   h.draft_vocab_size, cfg.hidden_size, False, layers)


class Eagle3Attention(nn.Module):
    """GQA attention with RoPE whose q/k/v read the 2H input [embed ⊕ hidden]."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)

    def forward(self, x, pos, cache=None, mask=None):
        """x [B, T, 2H] -> [B, T, H]."""
        return self.o_proj(attention(self.c, self.q_proj(x), self.k_proj(x), self.v_proj(x), pos, cache, mask))


class Eagle3MLP(nn.Module):
    """Llama's SwiGLU MLP."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """vLLM's first EAGLE-3 decoder layer: attention over [input_layernorm(embed) ⊕ hidden_norm(hidden)]."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Eagle3MLP(c)

    def forward(self, hidden, emb, pos, cache=None, mask=None):
        """hidden, emb [B, T, H] -> the layer's output before the final norm [B, T, H]."""
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), h], -1)  # [B, T, 2H]: embeddings first, as vLLM
        x = residual + self.self_attn(x, pos, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class SpeculatorsHead(nn.Module):
    """What speculators' heads (EAGLE-3, DFlash) share: `fc` over the target's aux layers, decoder `layers` with a
    KV cache each, a final `norm` and an `lm_head` over a draft vocabulary held as `d2t` [Vd] offsets (target id =
    draft id + d2t) and `t2d` [V] marking the target ids it covers, both saved; `draft_ids` [Vd] is the absolute map."""

    def register_vocab(self, vocab_size: int, draft_vocab_size: int, d2t: torch.Tensor | None) -> None:
        if d2t is None:
            d2t = torch.zeros(draft_vocab_size, dtype=torch.long)
        if d2t.shape != (draft_vocab_size,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}; it must hold one offset per draft row "
                             f"({draft_vocab_size})")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[torch.arange(draft_vocab_size) + d2t.long().cpu()] = True
        self.register_buffer("d2t", d2t.long(), persistent=True)
        self.register_buffer("t2d", t2d, persistent=True)

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] the target id of each draft row (absolute: arange + d2t)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def init_from_target(self, target, ids: torch.Tensor) -> None:
        """Start from `target`: its embedding, its LM head rows `ids` (the draft vocabulary's target ids) and
        its final norm copied; fc "passes the last aux layer through" (identity on its last block of columns,
        zeros elsewhere), so the fused feature begins as a real target feature."""
        self.embed_tokens.weight.copy_(target.get_input_embeddings().weight.detach().float())
        self.lm_head.weight.copy_(target.get_output_embeddings().weight.detach()[ids].float())
        init_norm(self.norm, target)
        H, Ht = self.fc.weight.shape[0], self.config.target_hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -Ht:].copy_(torch.eye(H, Ht))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, H] pre-norm hidden -> [B, T, draft_vocab_size]; map rows to target ids with draft_ids."""
        return self.lm_head(self.norm(h))

    def new_caches(self, batch: int, max_len: int, dtype=None, device=None) -> list[KVCache]:
        c, p = self.config, self.fc.weight
        return [KVCache(batch, c.num_key_value_heads, max_len, c.head_dim, dtype or p.dtype, device or p.device)
                for _ in self.layers]


class Eagle3Head(SpeculatorsHead):
    """fc(aux features) or the previous step's output, ⊕ embed(next token) -> the next step's hidden
    state -> draft logits over the draft vocabulary.

    `d2t` [Vd] holds offsets (target id = draft id + d2t), `t2d` [V] marks the target ids in the draft
    vocabulary; `draft_ids` [Vd] is the absolute map."""

    def __init__(self, c: Eagle3Config, d2t: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(3 * c.target_hidden_size, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c)])
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.register_vocab(c.vocab_size, c.draft_vocab_size, d2t)

    @classmethod
    def from_target(cls, target, aux_layers=None, draft_ids: torch.Tensor | None = None) -> "Eagle3Head":
        """A fresh head for `target` (an HF causal LM): its embedding (frozen), LM head rows `draft_ids`
        (sorted target ids; None: all) and final norm copied; fc starts as "pass the high layer's
        feature through" (identity on its third, zeros elsewhere), so the fused feature begins as a
        real target feature and training mixes in the others."""
        n = 0 if draft_ids is None else len(draft_ids)
        c = Eagle3Config.from_target(target.config, aux_layers, n)
        ids = torch.arange(c.draft_vocab_size) if draft_ids is None else torch.as_tensor(draft_ids).long()
        head = cls(c, ids - torch.arange(len(ids)))
        head.init_from_target(target, ids)
        return head

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux features [B, T, 3H] -> the fused feature [B, T, H]."""
        return self.fc(aux)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor,
                caches: list[KVCache] | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, H] (fused target features, or the head's own previous outputs) at positions
        pos-1..., aligned with emb [B, T, H], the embeddings of the tokens at those positions + 1; pos
        [B, T] the head's slots. Returns the layer's output before the final norm [B, T, H]."""
        x = hidden
        for i, layer in enumerate(self.layers):
            x = layer(x, emb, pos, None if caches is None else caches[i], mask)
        return x

    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        save_head(self, directory, {"kind": "eagle3", "head_config": asdict(self.config), **(extra or {})})

    @classmethod
    def load(cls, directory: str | Path, dtype=None, device=None) -> "Eagle3Head":
        return load_head(directory, "eagle3", "an EAGLE-3 head",
                         lambda meta, d2t: cls(Eagle3Config(**meta["head_config"]), d2t), dtype, device)
