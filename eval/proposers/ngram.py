"""Prompt lookup (n-gram) proposals: no model, no training."""

from __future__ import annotations

import torch

from .base import Proposer


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_ngram..1) in
    prompt + generated text and propose the tokens that followed it. No model, no training."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.hist = [list(p) + [int(t)] for p, t in zip(prompts, first.tolist())]
        self.live = [True] * len(prompts)  # per row: still decoding (accept() freezes a finished row's history)
        self.device = first.device

    def _lookup(self, h: list[int], k: int) -> list[int]:
        found = self.candidates(h, k, 1)
        return found[0][0] if found else []

    def candidates(self, h: list[int], k: int, m: int, min_n: int | None = None,
                   max_n: int | None = None) -> list[tuple[list[int], int]]:
        """Up to m distinct continuations (at most k tokens) of the last n tokens of h, for n from
        max_n (default: max_ngram) down to min_n (default: min_ngram), longest n first and the latest
        occurrence first within one n -> [(continuation, n), ...].

        One pass over the earlier occurrences of h's last token, each scored by how far its match
        extends backwards (capped at max_n), instead of one scan of h per n: the same answer, and a
        long max_n (HybridProposer's strong matches) costs no more scans."""
        max_n, min_n = max_n or self.max_ngram, min_n or self.min_ngram
        end = len(h) - 1
        last = h[end]
        scored = []  # (n, position of the occurrence's last token)
        for i in [i for i in range(end - 1, -1, -1) if h[i] == last]:  # latest first
            n = 1
            while n < max_n and i - n >= 0 and h[i - n] == h[end - n]:
                n += 1
            if n >= min_n:
                scored.append((n, i))
        scored.sort(key=lambda t: -t[0])  # stable: latest first within one n
        out: list[tuple[list[int], int]] = []
        for n, i in scored:
            cont = h[i + 1:i + 1 + k]
            if all(cont != c for c, _ in out):
                out.append((cont, n))
                if len(out) >= m:
                    break
        return out

    def propose(self, k):
        found = [self._lookup(h, k) for h in self.hist]
        self.found = [bool(f) for f in found]  # per row: did the lookup match (read by HybridProposer)
        width = max((len(f) for f in found), default=0)
        if width == 0:
            return torch.empty(len(self.hist), 0, dtype=torch.long, device=self.device), None
        # Rows with shorter (or no) matches are padded with their last token; they are verified and
        # most likely rejected, which costs nothing extra in a batched verify.
        rows = [f + [(f or h)[-1]] * (width - len(f)) for f, h in zip(found, self.hist)]
        return torch.tensor(rows, dtype=torch.long, device=self.device), None  # q one-hot

    def accept(self, tokens, start, n_acc, bonus, features=None):
        for b, (a, t) in enumerate(zip(n_acc.tolist(), bonus.tolist())):
            self.live[b] = a >= 0
            if a >= 0:
                self.hist[b] += tokens[b, 1:a + 1].tolist() + [t]
