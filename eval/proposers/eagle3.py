"""The EAGLE-3 proposer: an Eagle3Head (eval/heads/eagle3.py) drafting over three of the target's layers."""

from __future__ import annotations

import torch

from ..heads import Eagle3Head
from .base import target_device, Proposer, draw, prefill_input, verified_input


class Eagle3Proposer(Proposer):
    """EAGLE-3 head over the target's aux features (the residual streams entering `feature_layers`,
    which the decoder asks its runner for) and the head's own token embeddings.

    Slots as EagleProposer's: head slot s holds the step for token position s + 1, input
    [hidden_s ⊕ embed(token_{s+1})], whose logits propose token s + 2. hidden_s is fc(aux features at
    s) where the target has verified position s, and the head's own previous output (pre-norm, no fc)
    while drafting, as vLLM does. accept() re-runs the verified positions with the true fused features.
    """

    name = "eagle3"
    uses_features = True

    def __init__(self, head: Eagle3Head, target):
        p = target.get_output_embeddings().weight
        self.head = head.to(device=p.device, dtype=p.dtype).eval()
        self.feature_layers = tuple(head.config.aux_layers)
        self.draft_ids = self.head.draft_ids  # [Vd] draft row -> target id
        self.vocab_size = target.config.vocab_size

    @property
    def dtype(self):
        return self.head.fc.weight.dtype

    def _run(self, toks, hidden, pos, idx):
        """toks [B, T] token ids at positions pos [B, T]; hidden [B, T, H] fused target features at pos - 1.
        Writes head slots pos - 1; keeps the output at column idx [B] as the current one."""
        h = self.head(hidden, self.head.embed_tokens(toks), pos - 1, self.caches)  # [B, T, H]
        rows = torch.arange(toks.shape[0], device=toks.device)
        self.cur_h = h[rows, idx]  # [B, H] the head's output at the current token's position
        self.pos = pos[rows, idx]  # [B] position of the current token
        self.prev = hidden[rows, idx][:, None]  # [B, 1, H] fused target feature at (current position) - 1

    def _fuse(self, features):
        """The decoder's aux features [B, T, 3H] -> fused [B, T, H]."""
        return self.head.fuse(features.to(self.dtype))

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.sampling = sampling
        self.caches = self.head.new_caches(len(prompts), max_len)
        toks, pos, idx = prefill_input(prompts, first)  # [B, T] x2, [B]
        T = toks.shape[1]
        self._run(toks, self._fuse(features[:, :T]), pos, idx)

    def propose(self, k):
        drafts, qs = [], []
        h = self.cur_h
        for i in range(k):
            tok, q = draw(self.head.logits(h), self.sampling, self.draft_ids, self.vocab_size)  # [B], [B, V] | None
            drafts.append(tok)
            qs.append(q)
            if i + 1 < k:  # the head's own output ⊕ embed(draft) at the next position
                p = (self.pos + 1 + i)[:, None]  # [B, 1]
                h = self.head(h[:, None], self.head.embed_tokens(tok[:, None]), p - 1, self.caches)[:, 0]  # [B, H]
        q = None if self.sampling.greedy else torch.stack(qs, 1)
        return torch.stack(drafts, 1), q

    def accept(self, tokens, start, n_acc, bonus, features=None):
        # As EagleProposer.accept, with fused features: the verified tokens and the bonus one at
        # positions start..start+T, column j reading the fused target feature at start + j - 1.
        toks, pos, idx = verified_input(tokens, start, n_acc, bonus)  # [B, T + 1], [B, T + 1], [B]
        hidden = torch.cat([self.prev, self._fuse(features)], 1)  # [B, T + 1, H]
        self._run(toks, hidden, pos, idx)


def load(directory, meta, target, dtype) -> Eagle3Proposer:
    """The draft kind 'eagle3''s loader (eval/draft_dir.py): its head.safetensors, served over `target`."""
    return Eagle3Proposer(Eagle3Head.load(directory, dtype=dtype, device=target_device(target)), target)
