"""The hybrid proposer: prompt and datastore lookups next to a model proposer, as one token tree per
round (eval/tree.py), greedy or sampled."""

from __future__ import annotations

from ..tree import build_trie, trie_path
from .base import Proposer, Sampling
from .ngram import NgramProposer


class HybridProposer(Proposer):
    """n-gram prompt lookup and a model proposer together. Code repeats its prompt and itself, where a
    lookup proposes long runs for free; the model covers what has not been seen yet.

    Tree rounds (eval/tree.py), greedy or sampled: one tree per round over, in priority order, lookups
    matching >= `min_match` tokens (of up to `k_ngram` tokens), the model's chain of k, its runner-up
    paths (`alt_branches`, for a model with alternatives: Medusa's sparse tree), the datastore's most
    frequent continuations (`store_branches`), then shorter matches; max_nodes / B nodes per row (the
    budget is the batch's verify), at least k (so more than max_nodes in all where B * k exceeds it), and
    the order decides what a full budget drops.
    When every row's suffix recurs >= `strong_match` tokens (matches ranked up to `long_ngram`), the
    round is lookups alone: up to `strong_branches` continuations as long as the budget, no model
    call (SuffixDecoding's rule, Oliaro et al., 2024; 0 turns it off).
    Under sampling, the model's branches are either deterministic (`sampled_chain` False: its argmax chain
    and runner-ups, its `sampling` swapped for greedy during the call, one-hot proposals like the
    lookups') or its chain sampled from its q (`sampled_chain` True: no runner-ups; each chain node
    carries its q and is tried first among its siblings). eval.decoder.verify_tree_sample accepts
    either exactly; which pays at which temperature: docs/reference/trees.md.
    Chain rounds (SpeculativeDecoder(tree=False)): the lookup when it matches >= `min_match` tokens
    for every row, else the model's chain (sampled from its q under sampling).

    The model sees every verified token whoever proposed it (accept() always runs), so its cache and
    features stay in sync. Why these defaults, and how `max_nodes` is fitted per machine
    (eval.replay.fit_budget): docs/reference/trees.md."""

    name = "hybrid"
    trees = True

    def __init__(self, model: Proposer, min_match: int = 2, k_ngram: int | None = 8, max_ngram: int = 3,
                 branches: int = 2, max_nodes: int = 10, datastore=None, store_branches: int = 2,
                 alt_branches: int = 3, strong_match: int = 3, long_ngram: int = 8, strong_branches: int = 3,
                 sampled_chain: bool = False):
        self.model = model
        self.sampled_chain = sampled_chain
        self.alt_branches = alt_branches if model.has_alternatives else 0
        if self.alt_branches:
            model.with_alternatives = True  # it will be asked for them every tree round
        self.datastore, self.store_branches = datastore, store_branches
        self.ngram = NgramProposer(max_ngram=max_ngram, min_ngram=min_match)
        self.min_match, self.branches, self.max_nodes = min_match, branches, max_nodes
        self.strong_match, self.long_ngram, self.strong_branches = strong_match, long_ngram, strong_branches
        self.uses_features, self.feature_layers = model.uses_features, model.feature_layers
        self.k_ngram = k_ngram
        self.from_ngram = 0  # chain rounds proposed by the lookup (for stats)
        self.from_model = 0
        self.lookup_rounds = 0  # tree rounds the strong lookups filled alone (for stats)

    @property
    def max_k(self) -> int:
        """The longest run a round may propose: a lookup's k_ngram, or a strong match's whole budget."""
        return max(self.k_ngram or 0, self.max_nodes if self.strong_match else 0)

    def propose_tree(self, k):
        """-> per row (tokens, parents) of a trie over the lookups' continuations and the model's chain."""
        # The node budget is for the whole batch's verify forward, whose cost grows with its rows
        # (docs/reference/verify-cost.md): each row gets max_nodes / B nodes (at least k), spent in
        # priority order.
        B = len(self.ngram.hist)
        budget = max(self.max_nodes // B, min(k, self.max_nodes))
        kn = self.k_ngram or k
        m = max(self.branches, self.strong_branches if self.strong_match else 0)
        # down to 1-token matches: in a tree a weak lookup only costs nodes the budget allows
        max_n = max(self.long_ngram, self.ngram.max_ngram) if self.strong_match else self.ngram.max_ngram
        found = [self.ngram.candidates(h, max(kn, budget), m, min_n=1, max_n=max_n)
                 for h in self.ngram.hist] if self.branches else [[]] * B
        stored = [self.datastore.candidates(h, kn, self.store_branches) if self.datastore else []
                  for h in self.ngram.hist]
        # a finished row's frozen history decides nothing for the rows still decoding
        if self.strong_match and all(f and f[0][1] >= self.strong_match for f, on in zip(found, self.ngram.live) if on):
            # Every row's suffix recurs (>= strong_match tokens): the output is repeating itself, where
            # a lookup is right far more often than the draft. The round is lookups alone, the budget
            # spent on the strong matches' continuations (up to `budget` tokens, longest match first),
            # and the model is not run (it still sees the verified tokens in accept()).
            self.lookup_rounds += 1
            self.model.drafted_elsewhere()
            return [build_trie([c for c, n in f if n >= self.strong_match][:self.strong_branches]
                               + [c for c, _ in st] + [c[:kn] for c, n in f if n < self.strong_match], budget)
                    for f, st in zip(found, stored)]
        drafts, alts, q = self._model_branches(k, B)  # [B, k], per row its runner-up paths, q [B, k, V] or None
        self.model.drafted_elsewhere()  # the accepted path may be a lookup's
        rows = []
        # host sync: the model's chain joins the host-built tree
        for b, (f, st, chain, alt) in enumerate(zip(found, stored, drafts.tolist(), alts)):
            f = [(c[:kn], n) for c, n in f[:self.branches]]
            cands = [c for c, n in f if n >= self.min_match] + [chain] + alt + [c for c, _ in st] \
                + [c for c, n in f if n < self.min_match]
            toks, pars = build_trie(cands, budget)
            if q is None:
                rows.append((toks, pars))
            else:  # the sampled chain's nodes, each with the q its token was drawn from
                rows.append((toks, pars, {j: q[b, d] for d, j in enumerate(trie_path(toks, pars, chain))}))
        return rows

    def _model_branches(self, k: int, B: int):
        """The model's chain of k [B, k], its runner-up paths, and the chain's q [B, k, V] where it was
        sampled (`sampled_chain` under sampling: no runner-ups), else None: deterministic however the
        round samples, the model drafting greedily for this call."""
        m, sampling = self.model, self.sampling
        if self.sampled_chain and not sampling.greedy:
            drafts, q = m.propose(k)
            return drafts, [[]] * B, q
        m.sampling = self._greedy
        try:
            drafts, q = m.propose(k)
            alts = m.alternatives(self.alt_branches) if self.alt_branches else [[]] * B
        finally:
            m.sampling = sampling
        if q is not None:
            raise RuntimeError(f"{type(m).__name__}.propose sampled its drafts under a greedy `sampling`: a tree "
                               f"round needs deterministic branches (Proposer.sampling)")
        return drafts, alts, None

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.sampling, self._greedy = sampling, Sampling(0.0)
        self.ngram.begin(prompts, first, max_len, sampling)
        self.model.begin(prompts, first, max_len, sampling, features)

    def propose(self, k):
        drafts, q = self.ngram.propose(self.k_ngram or k)
        # Batch rows share one verify forward: use the lookup only when it found a run for every row still decoding.
        if drafts.shape[1] > 0 and all(f for f, on in zip(self.ngram.found, self.ngram.live) if on):
            self.model.drafted_elsewhere()
            self.from_ngram += 1
            return drafts, q
        self.from_model += 1
        return self.model.propose(k)

    def accept(self, tokens, start, n_acc, bonus, features=None):
        self.ngram.accept(tokens, start, n_acc, bonus)
        self.model.accept(tokens, start, n_acc, bonus, features)
