"""Our decoder's twin of the vLLM datastore proposer (`--format vllm-proposer`): the same lookup
(pipeline/engines/draftsmith_vllm/lookup.py) over the same export directory, as a chain Proposer, so that
verify-export reads the export's acceptance in our decoder and in vLLM with one lookup."""

from __future__ import annotations

import torch

from eval.proposers.base import Proposer

from .engines.draftsmith_vllm.lookup import SuffixLookup, load_export


class LookupProposer(Proposer):
    """Per row, up to k tokens from SuffixLookup.propose over the prompt and the output so far."""

    name = "vllm-proposer"

    def __init__(self, lookup: SuffixLookup):
        self.lookup = lookup

    @classmethod
    def from_export(cls, directory) -> "LookupProposer":
        return cls(load_export(directory))

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.hist = [list(p) + [int(t)] for p, t in zip(prompts, first.tolist())]
        self.device = first.device

    def propose(self, k):
        found = [self.lookup.propose(h, k) for h in self.hist]
        width = max((len(f) for f in found), default=0)
        if width == 0:
            return torch.empty(len(self.hist), 0, dtype=torch.long, device=self.device), None
        # shorter rows padded with their last token (verified and most likely rejected), as NgramProposer does
        rows = [f + [(f or h)[-1]] * (width - len(f)) for f, h in zip(found, self.hist)]
        return torch.tensor(rows, dtype=torch.long, device=self.device), None

    def accept(self, tokens, start, n_acc, bonus, features=None):
        for b, (a, t) in enumerate(zip(n_acc.tolist(), bonus.tolist())):
            if a >= 0:
                self.hist[b] += tokens[b, 1:a + 1].tolist() + [t]
