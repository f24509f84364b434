"""Lossless speculative sampling over token trees (eval.decoder.verify_tree_sample): the decoder's output
distribution equals plain sampling's when the hybrid's tree is verified at temperature > 0.

As tests/test_sampling.py does for chains, with chi-square goodness-of-fit tests of >= 10^4 draws:
- the accept rule alone, on fixed per-node distributions, over a tree with duplicated sibling tokens
  and a branch outside the nucleus;
- end to end through SpeculativeDecoder on a tiny model, at T = 0.7 and 1.0 with top-p < 1: the first
  three generated tokens' marginals against the target's exact ones (token 3 is reached through
  depth-2 nodes), with trees of deterministic branches (duplicated siblings included), and the hybrid
  over a draft LM, whose model branches are drafted greedily for the tree or sampled from its q;
- the accept rule with a sampled chain among lookups (merged into their nodes where the tokens agree);
and the same tests FAIL when the residual after a rejection is dropped (p_res left unchanged). A sampled
chain verified with its q accepts deeper than the same tokens verified as one-hot drafts (both lossless).
"""

import pytest
import torch

import eval.decoder as D
from eval.decoder import SpeculativeDecoder, verify_tree_sample
from eval.proposers import DraftLMProposer, HybridProposer, Proposer, Sampling
from eval.tree import Tree, build_trie, trie_path
from helpers import SAMPLING_PROMPT as PROMPT, SAMPLING_V as V, chi2_pvalue, e2e_pvalues, exact_marginals, wrong_residual
from helpers import sampling_llama as tiny

pytestmark = pytest.mark.usefixtures("one_thread")

WARPS = {"t0.7": dict(temperature=0.7, top_p=0.9), "t1.0": dict(temperature=1.0, top_p=0.8, top_k=16)}


# ---------------------------------------------------------------- the accept rule alone

# Nodes 1..9 under the root 0: root children 1 (a), 2 (b), 3 (a again: a duplicated sibling), 4 (c);
# under node 1: 5 (x), 6 (x again), 7 (y); under node 2: 8 (x); under node 5: 9 (z).
RULE_PARENTS = [0, 0, 0, 0, 1, 1, 1, 2, 5]


def _rule_case(warp, seed=0):
    """Per-node target distributions p [N+1, Vs] (a node's p is its path's: duplicated nodes share it) and
    the tree's tokens: a and x the modes of their parents' p, b the runner-up, c and y outside the nucleus."""
    g = torch.Generator().manual_seed(seed)
    Vs = 8
    s = Sampling(**warp)
    logits = torch.randn(10, Vs, generator=g) * 1.5
    logits[3], logits[6] = logits[1], logits[5]  # duplicated nodes: the same context, the same p
    p = s.probs(logits)  # [N+1, Vs]
    order = lambda i: p[i].argsort(descending=True).tolist()  # noqa: E731
    a, b, c = order(0)[0], order(0)[1], order(0)[-1]
    x, y = order(1)[0], order(1)[-1]
    z = order(5)[0]
    tokens = [a, b, a, c, x, x, y, order(2)[0], z]
    assert p[0, c] == 0 and p[1, y] == 0  # cut by top-p/top-k: never accepted
    return p, tokens


def _rule_pvalues(warp, n=20000):
    p, tokens = _rule_case(warp)
    tree = Tree.from_lists([(tokens, RULE_PARENTS)] * n, "cpu")
    s = Sampling(**warp, generator=torch.Generator().manual_seed(1))
    P = p.expand(n, -1, -1)
    dec = verify_tree_sample(lambda r, j: P[r, j], tree, s)
    # the emitted tokens: the accepted path's, then the token after it
    emitted = [[tokens[j - 1] for j in tree.path(0, node)[1:]] + [nxt] for node, _, nxt in dec]
    first = torch.tensor([e[0] for e in emitted])
    pv = [chi2_pvalue(first, p[0])]
    # given the first token was a child's token, the second one follows that child's p
    for node in (1, 2):
        second = torch.tensor([e[1] for e in emitted if len(e) > 1 and e[0] == tokens[node - 1]])
        assert second.numel() > 500
        pv.append(chi2_pvalue(second, p[node]))
    third = torch.tensor([e[2] for e in emitted if len(e) > 2 and e[:2] == [tokens[0], tokens[4]]])
    assert third.numel() > 500
    pv.append(chi2_pvalue(third, p[5]))
    depths = [d for _, d, _ in dec]
    assert 0 in depths and 3 in depths  # rejections at the root and walks to the deepest node
    return pv


def test_the_last_one_hot_child_holding_the_mass_left_is_accepted(monkeypatch):
    """p's whole mass on two one-hot children, 0.9 and 0.1 in fp32: their fp32 sum rounds to 1.0, so after the
    first child's rejection the mass left reads 2e-8 more than the second child's p. With a uniform just below 1
    the second child would be rejected too, leaving an all-zero residual that draws id 0 (no mass there); it is
    accepted instead, and the token after it comes from its own p."""
    V = 8
    p = torch.zeros(3, V)
    p[0, 2], p[0, 5] = 0.9, 0.1  # the root: all its mass on the children's tokens
    p[1:, 6] = 1.0  # after either child
    assert float(p[0].sum()) == 1.0 and 1.0 - float(p[0, 2]) > float(p[0, 5])  # the rounding the case needs
    tree = Tree.from_lists([([2, 5], [0, 0])], "cpu")
    rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.full(a, 1 - 2 ** -24, dtype=kw.get("dtype")))
    (node, depth, nxt), = verify_tree_sample(lambda r, j: p[j], tree, Sampling(1.0, generator=torch.Generator()))
    monkeypatch.setattr(torch, "rand", rand)
    assert (node, depth, nxt) == (2, 1, 6)


@pytest.mark.parametrize("warp", list(WARPS))
def test_tree_accept_rule_matches_target(warp):
    assert min(_rule_pvalues(WARPS[warp])) > 1e-4


@pytest.mark.parametrize("warp", list(WARPS))
def test_tree_accept_rule_without_the_residual_fails(warp, monkeypatch):
    monkeypatch.setattr(D, "residual_one_hot", wrong_residual)  # p_res left unchanged after a one-hot rejection
    assert min(_rule_pvalues(WARPS[warp])) < 1e-6


# A sampled chain among one-hot lookups: per draw, x1 ~ q1 and x2 ~ q2[x1] (draft distributions unlike the
# target's p1, p2[x1]) joined by build_trie with a lookup [a, y] before it and [b] after it, so x1 often
# merges into a lookup's node; the chain's nodes carry their q (Tree.q_host).

def _sampled_case(warp, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    Vs, s = 8, Sampling(**warp)
    p1 = s.probs(torch.randn(Vs, generator=g) * 1.5)  # [Vs] the target after the prompt
    p2 = s.probs(torch.randn(Vs, Vs, generator=g) * 1.5)  # [Vs(x1), Vs] the target after x1
    q1 = torch.softmax(torch.randn(Vs, generator=g), -1)  # the draft: full support, unlike p
    q2 = torch.softmax(torch.randn(Vs, Vs, generator=g), -1)
    a, b = p1.argsort(descending=True)[:2].tolist()
    x1 = torch.multinomial(q1, n, replacement=True, generator=g)  # [n]
    x2 = torch.multinomial(q2[x1], 1, generator=g)[:, 0]  # [n]
    rows, ps = [], []
    for u, v in zip(x1.tolist(), x2.tolist()):
        toks, pars = build_trie([[a, p2[a].argmax().item()], [u, v], [b]], 8)
        nodes = trie_path(toks, pars, [u, v])
        rows.append((toks, pars, {nodes[0]: q1, nodes[1]: q2[u]}))
        # the target at each node: its path's distribution (depth-2 nodes: any, the check stops at token 2)
        ps.append(torch.stack([p1] + [p2[t] if par == 0 else torch.full((Vs,), 1 / Vs)
                                      for t, par in zip(toks, pars)] + [p1] * (5 - len(toks))))  # padded to 5 nodes
    return p1, p2, rows, torch.stack(ps)


def _sampled_pvalues(warp, n=20000):
    p1, p2, rows, p = _sampled_case(warp, n)
    tree = Tree.from_lists(rows, "cpu")
    s = Sampling(**warp, generator=torch.Generator().manual_seed(1))
    dec = verify_tree_sample(lambda r, j: p[r, j], tree, s)
    emitted = [[rows[i][0][j - 1] for j in tree.path(i, node)[1:]] + [nxt] for i, (node, _, nxt) in enumerate(dec)]
    pv = [chi2_pvalue(torch.tensor([e[0] for e in emitted]), p1)]
    for t in p1.argsort(descending=True)[:2].tolist():  # the second token, given the first
        second = torch.tensor([e[1] for e in emitted if len(e) > 1 and e[0] == t])  # t is a child: accepted
        assert second.numel() > 500
        pv.append(chi2_pvalue(second, p2[t]))
    assert {d for _, d, _ in dec} == {0, 1, 2}
    return pv


@pytest.mark.parametrize("warp", list(WARPS))
def test_tree_accept_rule_with_a_sampled_chain_matches_target(warp):
    assert min(_sampled_pvalues(WARPS[warp])) > 1e-4


@pytest.mark.parametrize("warp", list(WARPS))
def test_a_sampled_chains_q_raises_acceptance(warp):
    """A sampled token verified as a one-hot draft is lossless too (any token chosen apart from the
    verifier's draws is), but accepted with p(x) instead of min(1, p(x)/q(x)): with its q the tree accepts
    deeper on the same draws."""
    _, _, rows, p = _sampled_case(WARPS[warp], 20000)
    depth = {}
    for name, rr in (("q", rows), ("one-hot", [r[:2] for r in rows])):
        s = Sampling(**WARPS[warp], generator=torch.Generator().manual_seed(1))
        dec = verify_tree_sample(lambda r, j: p[r, j], Tree.from_lists(rr, "cpu"), s)
        depth[name] = sum(d for _, d, _ in dec) / len(dec)
    assert depth["q"] > depth["one-hot"] + 0.05, depth


def test_tree_accept_rule_with_a_sampled_chain_without_the_residual_fails(monkeypatch):
    monkeypatch.setattr(D, "residual", wrong_residual)  # only the sampled nodes' residual wrong
    assert min(_sampled_pvalues(WARPS["t1.0"])) < 1e-6


# ---------------------------------------------------------------- end to end

class OracleBranches(Proposer):
    """Deterministic trees from the target's own ranking at the row's history (a function of the verified
    tokens only, so lossless to verify as one-hot drafts): root children [2nd, 1st, 2nd again, last];
    under the 1st: [its 1st, its 1st again, its 2nd]; under the 2nd: [the token before the current one]
    (a lookup-like guess). Duplicated siblings, a branch outside the nucleus, accepts at depth 1 and 2."""

    trees = True
    max_nodes = 8

    def __init__(self, target):
        self.target = target

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.hist = [p + [t] for p, t in zip(prompts, first.tolist())]

    def _ranked(self, seqs):
        """[n] token lists -> [n, V] token ids, most likely next first (the target's logits after each)."""
        L = torch.tensor([len(x) for x in seqs])
        ids = torch.zeros(len(seqs), int(L.max()), dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)  # right padding: causal, the last real position is unaffected
        logits = self.target(ids).logits[torch.arange(len(seqs)), L - 1]  # [n, V]
        return logits.argsort(-1, descending=True)

    def propose_tree(self, k):
        r0 = self._ranked(self.hist).tolist()
        r1 = self._ranked([h + [r[0]] for h, r in zip(self.hist, r0)]).tolist()
        rows = []
        for h, a, b in zip(self.hist, r0, r1):
            tokens = [a[1], a[0], a[1], a[-1], b[0], b[0], b[1], h[-2]]
            rows.append((tokens, [0, 0, 0, 0, 2, 2, 2, 1]))
        return rows

    def propose(self, k):
        raise AssertionError("a tree proposer in a tree decoder: every round is a tree round")

    def accept(self, tokens, start, n_acc, bonus, features=None):
        for h, row, a, bn in zip(self.hist, tokens.tolist(), n_acc.tolist(), bonus.tolist()):
            if a >= 0:
                h.extend(row[1:a + 1] + [bn])


@pytest.fixture(scope="module")
def target():
    return tiny(0)


def tree_proposer(kind, target):
    if kind == "oracle":
        return OracleBranches(target)
    # lookups over the prompt's 3 7 3 7 repeats, and the draft LM's argmax chain ("hybrid") or its chain
    # sampled from q ("hybrid-sampled"): one trie per round
    return HybridProposer(DraftLMProposer(tiny(1, layers=1, init=0.3), V), min_match=1,
                          sampled_chain=kind == "hybrid-sampled")


@pytest.mark.parametrize("kind", ["oracle", "hybrid", "hybrid-sampled"])
@pytest.mark.parametrize("warp", list(WARPS))
def test_tree_sampling_matches_target(target, kind, warp):
    # the prefill's token, a K = 2 tree's depth-1 and depth-2 nodes and the token after a depth-2 node
    pv, stats = e2e_pvalues(target, tree_proposer(kind, target), WARPS[warp], k=2)
    assert stats["tree_rounds"] == stats["rounds"] > 0, stats  # sampled, through trees
    assert 0 < stats["alpha"] < 1, stats  # drafts were both accepted and rejected
    if kind == "oracle":
        assert stats["accept_len_hist"][2] > 0, stats  # ... down to depth 2
    assert min(pv) > 1e-4, pv


def test_tree_sampling_without_the_residual_fails(target, monkeypatch):
    monkeypatch.setattr(D, "residual_one_hot", wrong_residual)  # the oracle's branches are one-hot drafts
    pv, _ = e2e_pvalues(target, tree_proposer("oracle", target), WARPS["t0.7"], k=2)
    assert min(pv) < 1e-6, pv


def test_tree_sampling_is_seeded(target):
    dec = SpeculativeDecoder(target, tree_proposer("oracle", target), k=2)
    a, b, c = (dec.generate([PROMPT] * 4, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=sd).sequences
               for sd in (5, 5, 6))
    assert a == b and a != c
