"""Medusa heads: extra decoding heads on the target's last feature, one per further position.

Medusa (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"), Medusa-1 flavour (frozen target): head i is a residual block h + SiLU(W_i h + b_i) followed
by its own LM head. All heads read the same feature, so one propose step drafts up to `num_heads`
tokens at once, without feeding the drafts back (no autoregression inside the draft).

Alignment (absolute token positions):
    target LM head(feature_t)  -> token t + 1
    Medusa head i (feature_t)  -> token t + 2 + i        (i = 0 .. num_heads - 1)
so with the current token at position n (produced from feature_{n-1}), head i proposes draft i at
position n + 1 + i.

"Feature" is the target's final hidden state AFTER its final norm (the decoder's `last_hidden_state`,
the input of the target's LM head, what `eval.target` runners return), so each head's LM head applies
to the residual block's output directly; no norm is stored here.

The LM heads cover a draft vocabulary: `d2t` [Vd] maps a draft row to its target id (the identity when
the vocabulary is not truncated), as for the EAGLE head (eval/heads/eagle.py).

Recurrent heads (`MedusaConfig.recurrent`): a Medusa head cannot see the tokens between its feature
and the one it predicts, although at decode time they are known: token t + 1 is the target's own
choice and tokens t + 2 .. t + 1 + i are the drafts before head i, which only count if they were
accepted. A recurrent head reads them, as the recurrent drafter of ReDrafter (Cheng et al., 2024,
"Recurrent Drafter for Fast Speculative Decoding") and Hydra's sequentially dependent heads (Ankner
et al., 2024) do:
    s_0 = feature_t
    s_{i+1} = s_i + W2_i SiLU(W1_i [s_i ; embed(token_{t+1+i})] + b1_i) + b2_i     (TokenBlock)
    head i logits = LM head_i(s_{i+1})  -> token t + 2 + i
with the target's frozen input embedding. Trained teacher-forced on the target's greedy tokens, which
is exactly the decode-time input of every draft that matters (a draft after a rejected one is never
used). How they compare with plain heads: docs/reference/training.md.

Their proposer (chains, runner-up paths for token trees, sampling) is eval/proposers/medusa.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..family import text_config
from .io import load_head, save_head


@dataclass
class MedusaConfig:
    """The Medusa heads' shape. Saved as "medusa_config" in the draft file."""

    hidden_size: int  # the target's hidden size (the features the heads read)
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # rows of each LM head (== vocab_size when not truncated)
    num_heads: int = 4  # heads: head i drafts the token i + 2 positions past its feature
    num_layers: int = 1  # residual blocks per head (Medusa's medusa_num_layers; plain heads only)
    recurrent: bool = False  # heads read the tokens before their target (TokenBlock; see the module doc)
    shared_lm_head: bool = False  # one LM head for every head (vLLM's original_lm_head: its truncated-vocabulary form)


class TokenBlock(nn.Module):
    """s + W2 SiLU(W1 [s ; e] + b1) + b2: a recurrent head's step, from its state s and the embedding e
    of the token before the one it predicts. W2 and b2 start at zero, so the block starts as the
    identity (the head as a copy of the target's LM head) while W1 still gets gradients."""

    def __init__(self, hidden_size: int, mult: int = 3):
        super().__init__()
        self.up = nn.Linear(2 * hidden_size, mult * hidden_size)
        self.down = nn.Linear(mult * hidden_size, hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """s [..., H] state, e [..., H] token embedding -> [..., H] the next state."""
        return s + self.down(F.silu(self.up(torch.cat([s, e.to(s.dtype)], -1))))


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)) (Medusa's ResBlock). Weight and bias start at zero: the block starts as
    the identity, so each head starts out as a copy of the target's LM head."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` Medusa heads over the target's features.

    Each head has its OWN LM head, as in Medusa-1. Head i predicts the token i + 1 positions further
    than the target does, and its LM head is most of its capacity: the residual block is H x H
    (0.3M parameters at H = 576) against Vd x H for the LM head (4.7M at Vd = 8192). A shared LM head
    would make every head's distribution a function of one H-dim vector through the same readout,
    leaving a single small block to carry the whole offset. Memory: num_heads x Vd x H, i.e. 19M
    parameters for 4 heads at Vd = 8192 (76 MB fp32); the full 49,152-token vocabulary would be 113M,
    which is why the recipe's truncated draft vocabulary matters here.

    `shared_lm_head`: every head reads out through ONE LM head (the same module in every `lm_heads` slot),
    the form in which vLLM's MedusaModel serves a truncated draft vocabulary (`original_lm_head` with a
    `token_map`); the residual blocks then carry each head's offset (`num_layers` of them).
    """

    def __init__(self, c: MedusaConfig, d2t: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        self.num_heads = c.num_heads
        H, Vd = c.hidden_size, c.draft_vocab_size
        if c.recurrent:
            self.blocks = nn.ModuleList([TokenBlock(H) for _ in range(c.num_heads)])
        else:
            self.blocks = nn.ModuleList([nn.Sequential(*[ResBlock(H) for _ in range(c.num_layers)])
                                         for _ in range(c.num_heads)])
        if c.shared_lm_head:
            lm = nn.Linear(H, Vd, bias=False)
            self.lm_heads = nn.ModuleList([lm] * c.num_heads)  # [V_d, H] once, in every head's slot
        else:
            self.lm_heads = nn.ModuleList([nn.Linear(H, Vd, bias=False) for _ in range(c.num_heads)])
        if d2t is None:
            d2t = torch.arange(Vd)
        assert d2t.shape == (Vd,), "d2t must map every draft row to a target id"
        self.register_buffer("d2t", d2t.long(), persistent=True)

    @classmethod
    def from_target(cls, target, num_heads: int = 4, draft_ids: torch.Tensor | None = None,
                    num_layers: int = 1, recurrent: bool = False, shared_lm_head: bool = False) -> "MedusaHeads":
        """Fresh heads for `target` (an HF causal LM): every LM head starts as the target's LM head
        rows `draft_ids` (all rows when None), every residual block as the identity."""
        cfg = text_config(target)
        n = cfg.vocab_size if draft_ids is None else len(draft_ids)
        heads = cls(MedusaConfig(cfg.hidden_size, cfg.vocab_size, n, num_heads, num_layers, recurrent, shared_lm_head),
                    draft_ids)
        W = target.get_output_embeddings().weight.detach()  # [V, H]
        with torch.no_grad():
            for lm in heads.lm_heads:
                lm.weight.copy_(W[heads.d2t].float())
        return heads

    @property
    def recurrent(self) -> bool:
        return self.config.recurrent

    def forward(self, feat: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """Plain heads: feat [..., H] target features -> [..., n, H], the residual blocks of heads
        0..n-1 (n = num_heads by default)."""
        assert not self.recurrent, "recurrent heads read tokens too: use states() or step()"
        n = self.num_heads if n is None else n
        return torch.stack([blk(feat) for blk in self.blocks[:n]], dim=-2)

    def step(self, i: int, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Recurrent head i: state s [..., H] (the feature for i = 0), e [..., H] the embedding of
        the token before head i's target -> [..., H] the state head i's LM head reads."""
        return self.blocks[i](s, e)

    def states(self, feat: torch.Tensor, embs: torch.Tensor) -> torch.Tensor:
        """Recurrent heads, teacher-forced: feat [..., H], embs [..., n, H] the embeddings of tokens
        t + 1 .. t + n -> [..., n, H] the states of heads 0..n-1 (read by logits())."""
        out, s = [], feat
        for i in range(embs.shape[-2]):
            s = self.step(i, s, embs[..., i, :])
            out.append(s)
        return torch.stack(out, dim=-2)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., n, H] (heads 0..n-1, from forward) -> [..., n, Vd] draft-vocab logits; map argmax
        rows to target ids with self.d2t."""
        return torch.stack([lm(h[..., i, :]) for i, lm in enumerate(self.lm_heads[: h.shape[-2]])], dim=-2)

    def head_logits(self, feat: torch.Tensor, i: int) -> torch.Tensor:
        """One plain head: feat [..., H] -> [..., Vd], the logits of head i (token t + 2 + i from
        feature t). A recurrent head's input is its state: lm_heads[i](state)."""
        assert not self.recurrent, "recurrent heads: lm_heads[i](states(...)[..., i, :])"
        return self.lm_heads[i](self.blocks[i](feat))

    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        save_head(self, directory, {"kind": "medusa", "medusa_config": asdict(self.config), **(extra or {})})

    @classmethod
    def load(cls, directory: str | Path, dtype=None, device=None) -> "MedusaHeads":
        return load_head(directory, "medusa", "medusa heads",
                         lambda meta, d2t: cls(MedusaConfig(**meta["medusa_config"]), d2t), dtype, device)
