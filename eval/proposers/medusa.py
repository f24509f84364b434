"""The Medusa proposer: Medusa heads (eval/heads/medusa.py) drafting from the feature that produced the
current token, plain (independent heads) or recurrent (each head reads the drafts before it).

Greedy decoding proposes the chain of each head's top-1 and, for token trees, the runner-up paths
(`alternatives`, Medusa's sparse tree); sampling draws one chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..heads import MedusaHeads
from ..int8 import Int8Linear
from ..cpu import packed_linear
from .base import target_device, Proposer, Sampling, draw


def _int8_copy(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., in] -> [..., out] through an int8 copy of a head's weight [out, in]: the int8 kernel at a
    few rows, the packed bf16 weight otherwise (eval/int8.py). Its bound forward: no module-call
    overhead in the drafting loop."""
    return Int8Linear.quantize(weight, bias, exact=packed_linear(weight, bias)).forward


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
    last_alt1 = None  # recurrent heads: head 1's best after head 0's 2nd choice, once computed

    def __init__(self, heads: MedusaHeads, target, int8: bool = True):
        p = target.get_output_embeddings().weight
        self.heads = heads.to(device=p.device, dtype=p.dtype).eval()
        self.d2t = self.heads.d2t.to(p.device)  # [Vd] draft row -> target id
        self.vocab_size = target.config.vocab_size
        self.embed = target.get_input_embeddings()  # recurrent heads read token embeddings
        # The heads' matmuls as copies, for the same reason as the target's (drafting streams the heads'
        # weights at a few rows): packed (eval.target.packed_linear), or with int8=True (the default)
        # weight-only int8 copies (eval/int8.py) that fall back to the packed bf16 weight where the int8
        # kernel does not run. Proposals only: the output is the target's either way. Copies: rebuild
        # the proposer if the heads change. Costs and the int8 comparison: docs/reference/kernels.md.
        self.int8 = int8
        h = self.heads
        lin = _int8_copy if int8 else packed_linear
        with torch.no_grad():
            self._lm = [lin(l.weight) for l in h.lm_heads]
            if h.recurrent:
                self._blocks = [(lin(b.up.weight, b.up.bias), lin(b.down.weight, b.down.bias)) for b in h.blocks]

    @property
    def dtype(self):
        return self.heads.lm_heads[0].weight.dtype

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
        return draw(self._draft_logits(h), self.sampling, self.d2t, self.vocab_size)  # [B, n], [B, n, V]: each head's own q

    def _propose_recurrent(self, n: int):
        """Head i reads the state of head i - 1 and the token before its target: the current token for
        head 0, draft i - 1 after it. Greedy: the chain of top-1s; head 1 after head 0's 2nd choice, for
        alternatives(), joins head 1's call when a hybrid will ask for it, else alternatives() computes
        it on demand. Sampling: each draft drawn from its head's q given the drafts drawn before it, an
        autoregressive draft's q as verify_sample needs."""
        s = self._step(0, self.cur_feat, self._emb(self.cur_tok))  # [B, H]
        if not self.sampling.greedy:
            drafts, qs = [], []
            for i in range(n):
                if i:
                    s = self._step(i, s, self._emb(drafts[-1]))
                tok, q = draw(self._lm[i](s), self.sampling, self.d2t, self.vocab_size)  # [B], [B, V]
                drafts.append(tok)
                qs.append(q)
            return torch.stack(drafts, 1), torch.stack(qs, 1)
        tops = [self._top(0, s)]  # [B, m] per head
        self.last_alt1, self._s1 = None, s
        if n > 1:
            # With a tree to fill (with_alternatives, set by HybridProposer), head 1 after head 0's 1st AND
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


def load(directory, meta, target, dtype) -> MedusaProposer:
    """The draft kind 'medusa''s loader (eval/draft_dir.py): its head.safetensors, served over `target`."""
    return MedusaProposer(MedusaHeads.load(directory, dtype=dtype, device=target_device(target)), target)
