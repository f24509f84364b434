"""The EAGLE proposer: an EagleHead (eval/heads/eagle.py) drafting over the target's features."""

from __future__ import annotations

import torch

from ..heads import EagleHead
from .base import target_device, Proposer, draw, prefill_input, verified_input


class EagleProposer(Proposer):
    """EAGLE head over the target's features and token embeddings.

    Head slot s holds the head's step for token position s + 1: input [feature_s ⊕ embed(token_{s+1})],
    output ≈ feature_{s+1}, whose logits propose token s + 2. (Slots start at 0 so a head trained
    on plain sequences with positions 0.. sees exactly the same RoPE offsets.)
    """

    name = "eagle"
    uses_features = True

    def __init__(self, head: EagleHead, target):
        p = target.get_output_embeddings().weight
        self.head = head.to(device=p.device, dtype=p.dtype).eval()
        self.embed = target.get_input_embeddings()
        self.d2t = self.head.d2t.to(p.device)  # [Vd] draft row -> target id
        self.vocab_size = target.config.vocab_size

    def _run(self, toks, feats, pos, idx):
        """toks [B, T] token ids at positions pos [B, T]; feats [B, T, H] target features at pos - 1.
        Writes head slots pos - 1; keeps the predicted feature at column idx [B] as the current one."""
        h = self.head(feats.to(self.dtype), self.embed(toks).to(self.dtype), pos - 1, self.caches)  # [B, T, H]
        rows = torch.arange(toks.shape[0], device=toks.device)
        self.cur_h = h[rows, idx]  # [B, H] predicted feature at the current token's position
        self.pos = pos[rows, idx]  # [B] position of the current token
        self.prev_feat = feats[rows, idx][:, None]  # [B, 1, H] true feature at (current position) - 1

    @property
    def dtype(self):
        return self.head.fc.weight.dtype

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.sampling = sampling
        self.caches = self.head.new_caches(len(prompts), max_len)
        toks, pos, idx = prefill_input(prompts, first)  # [B, T] x2, [B]
        T = toks.shape[1]
        self._run(toks, features[:, :T], pos, idx)

    def propose(self, k):
        drafts, qs = [], []
        h = self.cur_h
        for i in range(k):
            tok, q = draw(self.head.logits(h), self.sampling, self.d2t, self.vocab_size)  # [B], [B, V] | None
            drafts.append(tok)
            qs.append(q)
            if i + 1 < k:  # predicted feature ⊕ embed(draft) at the next position
                p = (self.pos + 1 + i)[:, None]  # [B, 1]
                e = self.embed(tok[:, None]).to(self.dtype)
                h = self.head(h[:, None], e, p - 1, self.caches)[:, 0]  # [B, H]
        q = None if self.sampling.greedy else torch.stack(qs, 1)
        return torch.stack(drafts, 1), q

    def accept(self, tokens, start, n_acc, bonus, features=None):
        # Re-run the head over the accepted tokens with the TRUE target features, plus the new current
        # token: inputs at positions start..start+T (T = k + 1 verified tokens, one more for `bonus`):
        #   column j < n_acc + 1: feature_{start+j-1} ⊕ embed(tokens[j])
        #   column n_acc + 1:     feature_{start+n_acc} ⊕ embed(bonus)
        # Columns past that are junk written into slots that later rounds overwrite before reading.
        toks, pos, idx = verified_input(tokens, start, n_acc, bonus)  # [B, T + 1], [B, T + 1], [B]
        prev = self.prev_feat  # [B, 1, H] feature at start - 1
        feats = torch.cat([prev, features.to(prev.dtype)], 1)  # [B, T + 1, H]: feature at pos - 1
        self._run(toks, feats, pos, idx)


def load(directory, meta, target, dtype) -> EagleProposer:
    """The draft kind 'eagle''s loader (eval/draft_dir.py): its head.safetensors, served over `target`."""
    return EagleProposer(EagleHead.load(directory, dtype=dtype, device=target_device(target)), target)
