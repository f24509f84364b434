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

"Feature" is the target's final hidden state AFTER its final norm (`target.model(...).last_hidden_state`,
the input of the target's LM head, what `eval.target` runners return), so each head's LM head applies
to the residual block's output directly; no norm is stored here.

The LM heads cover a draft vocabulary: `d2t` [Vd] maps a draft row to its target id (the identity when
the vocabulary is not truncated), as for the EAGLE head (`eval/heads.py`).

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
used). Measured on held-out generated code: head 0 top-1 0.536 vs 0.461 for Medusa heads (600 steps).

Greedy decoding proposes the chain of each head's top-1 and, for token trees, the runner-up paths
(`alternatives`); sampling draws one chain.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .heads import read_head, save_head
from .proposers import Proposer, Sampling, to_target_vocab
from .target import int8_linear, packed_linear


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # rows of each LM head (== vocab_size when not truncated)
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head (Medusa's medusa_num_layers; plain heads only)
    recurrent: bool = False  # heads read the tokens before their target (TokenBlock; see the module doc)


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
        self.lm_heads = nn.ModuleList([nn.Linear(H, Vd, bias=False) for _ in range(c.num_heads)])
        if d2t is None:
            d2t = torch.arange(Vd)
        assert d2t.shape == (Vd,), "d2t must map every draft row to a target id"
        self.register_buffer("d2t", d2t.long(), persistent=True)

    @classmethod
    def from_target(cls, target, num_heads: int = 4, draft_ids: torch.Tensor | None = None,
                    num_layers: int = 1, recurrent: bool = False) -> "MedusaHeads":
        """Fresh heads for `target` (an HF causal LM): every LM head starts as the target's LM head
        rows `draft_ids` (all rows when None), every residual block as the identity."""
        cfg = target.config
        n = cfg.vocab_size if draft_ids is None else len(draft_ids)
        heads = cls(MedusaConfig(cfg.hidden_size, cfg.vocab_size, n, num_heads, num_layers, recurrent), draft_ids)
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
        meta, state = read_head(directory, "medusa", "medusa heads")
        heads = cls(MedusaConfig(**meta["medusa_config"]), state["d2t"])
        heads.load_state_dict(state)
        return heads.to(device=device, dtype=dtype) if dtype is not None else heads.to(device=device)


class MedusaProposer(Proposer):
    """Drafts min(k, num_heads) tokens per round, all from the feature that produced the current
    token: draft i = head i (feature_{n-1}), the token at position n + 1 + i.

    State: one feature per row (`cur_feat` [B, H]) and, for recurrent heads, the current token
    (`cur_tok` [B]). Nothing is cached per position, so a rejected draft leaves nothing behind;
    accept() only picks the feature that produced the bonus token, and the bonus token.
    """

    name = "medusa"
    uses_features = True
    has_alternatives = True
    alt_m = 3  # per-head candidates kept for alternatives()
    with_alternatives = False  # recurrent heads: compute alternatives()' extra head-1 row in propose()
    last_alt1 = None  # recurrent heads: head 1's best after head 0's 2nd choice, once computed

    def __init__(self, heads: MedusaHeads, target, int8: bool = True):
        p = target.get_output_embeddings().weight
        self.heads = heads.to(device=p.device, dtype=p.dtype).eval()
        self.d2t = self.heads.d2t.to(p.device)  # [Vd] draft row -> target id
        self.vocab_size = target.config.vocab_size
        self.embed = target.get_input_embeddings()  # recurrent heads read token embeddings
        # The heads' matmuls as packed copies (eval.target.packed_linear): on CPU bf16 this project's
        # small-row kernel, which streams a weight once at any row count. A round's drafting reads ~31 MB
        # of head weights at K=2 (two blocks and two 8,192-row LM heads) and is bandwidth-bound like a
        # target step: 2.1 ms a round through F.linear, ~1.0 ms through the kernel (measured here).
        # Elsewhere (fp32, CUDA) these are F.linear on the heads' own weights. Copies: rebuild the
        # proposer if the heads change.
        # int8=True (the default): weight-only int8 copies instead (eval.target.int8_linear), half the
        # bytes again where the kernel builds: paired on 24 HumanEval prompts, the hybrid 2.28x against
        # 2.22x with bf16 heads, the same tau (docs/benchmarks.md). Proposals only: the output is the
        # target's either way.
        self.int8 = int8
        h = self.heads
        lin = int8_linear if int8 else packed_linear
        with torch.no_grad():
            self._lm = [lin(l.weight) for l in h.lm_heads]
            if h.recurrent:
                self._blocks = [(lin(b.up.weight, b.up.bias), lin(b.down.weight, b.down.bias)) for b in h.blocks]

    @property
    def dtype(self):
        return self.heads.lm_heads[0].weight.dtype

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, n, H] -> [B, n, V] target-vocab logits (ids outside the draft vocab at -inf)."""
        return to_target_vocab(self._draft_logits(h), self.d2t, self.vocab_size)

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, n, H] (heads 0..n-1) -> [B, n, Vd], as MedusaHeads.logits through the packed copies."""
        return torch.stack([self._lm[i](h[:, i]) for i in range(h.shape[1])], 1)

    def _step(self, i: int, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """MedusaHeads.step through the packed copies: s, e [..., H] -> [..., H]."""
        up, down = self._blocks[i]
        return s + down(F.silu(up(torch.cat([s, e], -1))))

    def _emb(self, tok: torch.Tensor) -> torch.Tensor:
        """token ids [...] -> [..., H] the target's input embeddings, in the heads' dtype."""
        return self.embed(tok).to(self.dtype)

    def _top(self, i: int, s: torch.Tensor) -> torch.Tensor:
        """state s [..., H] -> [..., alt_m] head i's best target ids, best first (top-m over the draft
        vocabulary, mapped: no [..., V] tensor)."""
        return self.d2t[self._lm[i](s).topk(self.alt_m, -1).indices]

    def begin(self, prompts, first, max_len, sampling: Sampling, features=None):
        if features is None:
            raise ValueError("MedusaProposer reads the target's features: the decoder must pass them")
        B, dev = len(prompts), first.device
        self.sampling = sampling
        L = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        # `first` sits at position L and was produced from the feature at L - 1.
        self.cur_feat = features[torch.arange(B, device=dev), L - 1].to(self.dtype)  # [B, H]
        self.cur_tok = first.clone()  # [B] the token after cur_feat's position: recurrent head 0 reads it

    @torch.no_grad()
    def propose(self, k):
        n = min(k, self.heads.num_heads)  # host ints only
        if self.heads.recurrent:
            return self._propose_recurrent(n)
        h = self.heads(self.cur_feat, n)  # [B, n, H]
        if self.sampling.greedy:
            top = self.d2t[self._draft_logits(h).topk(self.alt_m, -1).indices]  # [B, n, m], best first
            self.last_top = top  # the runners-up: alternatives() turns them into tree branches
            return top[..., 0], None  # [B, n]
        q = self.sampling.probs(self._logits(h))  # [B, n, V]
        return self.sampling.sample(q), q  # each draft sampled from its own head's q

    def _propose_recurrent(self, n: int):
        """Head i reads the state of head i - 1 and the token before its target: the current token for
        head 0, draft i - 1 after it. Greedy: the chain of top-1s; head 1 after head 0's 2nd choice, for
        alternatives(), joins head 1's call when a hybrid will ask for it, else alternatives() computes
        it on demand. Sampling: each draft drawn from its
        head's q given the drafts drawn before it, an autoregressive draft's q as verify_sample needs."""
        s = self._step(0, self.cur_feat, self._emb(self.cur_tok))  # [B, H]
        if not self.sampling.greedy:
            drafts, qs = [], []
            for i in range(n):
                if i:
                    s = self._step(i, s, self._emb(drafts[-1]))
                q = self.sampling.probs(to_target_vocab(self._lm[i](s), self.d2t, self.vocab_size))  # [B, V]
                drafts.append(self.sampling.sample(q))
                qs.append(q)
            return torch.stack(drafts, 1), torch.stack(qs, 1)
        tops = [self._top(0, s)]  # [B, m] per head
        self.last_alt1, self._s1 = None, s
        if n > 1:
            # With a tree to fill (HybridProposer sets with_alternatives), head 1 after head 0's 1st AND
            # 2nd choices in one call ([B, 2, H]): the heads' weight reads dominate at a few rows, so
            # the second row is nearly free here, and a call of its own in alternatives() is not.
            r = 2 if self.with_alternatives else 1
            s2 = self._step(1, s[:, None].expand(-1, r, -1), self._emb(tops[0][:, :r]))
            t1 = self._top(1, s2)  # [B, r, m]
            tops.append(t1[:, 0])
            if r == 2:
                self.last_alt1 = t1[:, 1, 0]  # [B] head 1's best after head 0's 2nd choice
            s = s2[:, 0]
        for i in range(2, n):
            s = self._step(i, s, self._emb(tops[-1][:, 0]))
            tops.append(self._top(i, s))
        self.last_top = torch.stack(tops, 1)  # [B, n, m]
        return self.last_top[..., 0], None  # [B, n]

    def alternatives(self, m: int) -> list[list[list[int]]]:
        """After a greedy propose(): per row, up to m runner-up paths, in Medusa's order of likelihood
        (Cai et al., 2024, section 3.1.2, sparse tree): head 0's 2nd choice followed by head 1's 1st,
        head 1's 2nd after head 0's 1st, head 0's 3rd. Plain heads are independent, so any pairing is
        a valid path; for recurrent heads head 1's 1st after head 0's 2nd choice is its own best
        given that token (last_alt1). The chain (every head's 1st) is propose()'s."""
        if self.heads.recurrent and self.last_top.shape[1] > 1 and self.last_alt1 is None:  # not batched in propose()
            e = self._emb(self.last_top[:, 0, 1])  # [B, H] head 0's 2nd choice
            self.last_alt1 = self._top(1, self._step(1, self._s1, e))[:, 0]
        top = self.last_top.tolist()  # host sync: the tree is built on the host
        alt1 = self.last_alt1.tolist() if self.last_alt1 is not None else None
        out = []
        for b, t in enumerate(top):  # t [n][alt_m]
            n = len(t)
            after2nd = [] if n < 2 else [alt1[b] if alt1 is not None else t[1][0]]
            paths = [[t[0][1]] + after2nd, ([t[0][0], t[1][1]] if n > 1 else None),
                     [t[0][2]] if self.alt_m > 2 else None]
            out.append([p for p in paths if p][:m])
        return out

    def accept(self, tokens, start, n_acc, bonus, features=None):
        # features [B, T, H] at positions start..start+T-1; the bonus token (position start+n_acc+1)
        # came from column n_acc. Finished rows (n_acc == -1) keep their feature.
        B = tokens.shape[0]
        rows = torch.arange(B, device=tokens.device)
        new = features[rows, n_acc.clamp(min=0)].to(self.dtype)  # [B, H]
        self.cur_feat = torch.where((n_acc >= 0)[:, None], new, self.cur_feat)
        self.cur_tok = torch.where(n_acc >= 0, bonus, self.cur_tok)  # the bonus token follows that feature
