"""Token trees (eval/tree.py): the trie, the attention mask, the greedy accept rule against a brute
force, and tree rounds in the decoder that must move the accepted path's K/V into place (fp32,
tiny models: output equal to plain greedy decoding, batch 1 and ragged)."""

import math

import pytest
import torch

from eval.decoder import SpeculativeDecoder
from eval.proposers import Proposer
from eval.tree import Tree, build_trie
from helpers import N_NEW, PROMPTS, DECODER_V as V, decoder_llama as tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_build_trie_shares_prefixes_and_keeps_the_budget():
    toks, par = build_trie([[5, 6, 7], [5, 6, 8], [9], [5, 6, 7]], max_nodes=10)
    assert toks == [5, 6, 7, 8, 9] and par == [0, 1, 2, 2, 0]
    toks, par = build_trie([[5, 6, 7], [9, 1]], max_nodes=4)  # the budget cuts the second candidate
    assert toks == [5, 6, 7, 9] and par == [0, 1, 2, 0]
    assert build_trie([[], []], 4) == ([], [])


def test_tree_tensors_mask_and_paths():
    rows = [build_trie([[5, 6, 7], [5, 8]], 10), build_trie([[3]], 10)]  # row 1 is padded to N = 4
    t = Tree.from_lists(rows, "cpu")
    assert t.tokens.shape == (2, 4) and t.tokens[1].tolist() == [3, 0, 0, 0] and t.parents_host[1] == [0]
    assert t.depth[0].tolist() == [0, 1, 2, 3, 2] and t.max_depth == 3
    n = torch.tensor([3, 1])
    m = t.mask(n, 8)[:, 0]  # [B, N+1, S]
    # row 0, node 4 (token 8 under node 1): committed slots 0..2, then itself and its ancestors 0, 1
    assert m[0, 4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 7]
    assert m[1, 1].nonzero().flatten().tolist() == [0, 1, 2]
    assert m[1, 2].nonzero().flatten().tolist() == [0, 3]  # a padding node: committed + itself only
    assert t.path(0, 4) == [0, 1, 4] and t.path(0, 3) == [0, 1, 2, 3] and t.path(1, 0) == [0]


def test_accept_greedy_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        B, Vs = 3, 4  # few ids: branches often agree with the argmax
        rows = []
        for _b in range(B):
            cands = [torch.randint(0, Vs, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                     for _c in range(int(torch.randint(1, 4, (1,), generator=g)))]
            rows.append(build_trie(cands, 8))
        t = Tree.from_lists(rows, "cpu")
        logits = torch.randn(B, t.depth.shape[1], Vs, generator=g)
        arg = logits.argmax(-1)
        dec = t.accept_greedy(arg.tolist())
        for b, (toks, par) in enumerate(rows):
            # brute force: walk down from the root, following the child equal to the argmax
            node, depth = 0, 0
            while True:
                kids = [j for j, p in enumerate(par, start=1) if p == node and toks[j - 1] == int(arg[b, node])]
                if not kids:
                    break
                node, depth = kids[0], depth + 1
            assert dec[b] == (node, depth, int(arg[b, node]))


class OracleTree(Proposer):
    """Knows each row's reference output. Its tree puts a candidate that goes wrong at depth 2 FIRST
    and the right continuation second, so the accepted path leaves the first branch and its K/V must
    move (a stale cache would change later tokens), plus a wrong single token."""

    trees = True
    max_nodes = 32  # the decoder sizes its cache for trees up to this many nodes

    def __init__(self, refs):
        self.refs = refs

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.i = [0] * len(prompts)  # index in ref of each row's current token

    def _truth(self, b, k):
        t = self.refs[b][self.i[b] + 1: self.i[b] + 1 + k]
        return t + [0] * (k - len(t))  # past the reference's end: anything

    def propose(self, k):
        return torch.tensor([self._truth(b, k) for b in range(len(self.i))]), None

    def propose_tree(self, k):
        rows = []
        for b in range(len(self.i)):
            t = self._truth(b, k)
            wrong = t[:1] + [(x + 1) % V for x in t[1:]]
            rows.append(build_trie([wrong, t, [(t[0] + 2) % V]], 4 * k))
        return rows

    def accept(self, tokens, start, n_acc, bonus, features=None):
        for b, a in enumerate(n_acc.tolist()):
            if a >= 0:
                self.i[b] += a + 1


@pytest.fixture(scope="module")
def target():
    return tiny(0)


@pytest.fixture(scope="module")
def ref(target):
    return SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences


@pytest.mark.parametrize("k", [1, 3, 5])
def test_tree_rounds_move_the_accepted_path(target, ref, k):
    for prompts, refs in (([PROMPTS[0]], ref[:1]), (PROMPTS, ref)):  # batch 1 and ragged
        res = SpeculativeDecoder(target, OracleTree(refs), k=k).generate(prompts, max_new_tokens=N_NEW)
        assert res.sequences == refs, k
        # every round accepts all k (the right branch is always there): N_NEW tokens in few forwards
        assert res.stats["target_forwards"] <= 1 + math.ceil((N_NEW - 1) / (k + 1)), res.stats
        assert res.stats["alpha_hat"] > 0.9
        assert res.stats["tree_rounds"] == res.stats["rounds"]  # every round after prefill was a tree


def test_trees_off_when_asked_and_on_the_hf_path(target, ref):
    """tree=False verifies chains; the HF path (lean=False) verifies trees as the lean runner does."""
    dec = SpeculativeDecoder(target, OracleTree(ref[:1]), k=3, tree=False)
    assert not dec.tree
    res = dec.generate([PROMPTS[0]], max_new_tokens=N_NEW)
    assert res.sequences == ref[:1] and res.stats["tree_rounds"] == 0
    for prompts, refs in (([PROMPTS[0]], ref[:1]), (PROMPTS, ref)):  # batch 1 and ragged
        dec = SpeculativeDecoder(target, OracleTree(refs), k=3, lean=False)
        assert dec.tree and dec.runner.path == "hf"
        res = dec.generate(prompts, max_new_tokens=N_NEW)
        assert res.sequences == refs and res.stats["tree_rounds"] == res.stats["rounds"]


class FixedChain(Proposer):
    """A model proposer that always drafts 1, 2, 3, ..."""

    calls = 0

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.B = len(prompts)

    def propose(self, k):
        self.calls += 1
        return torch.arange(1, k + 1).expand(self.B, k), None

    def accept(self, tokens, start, n_acc, bonus, features=None):
        pass


def test_hybrid_tree_budget_is_shared_by_the_batch():
    from eval.proposers import HybridProposer, Sampling

    rep = [7, 8, 9, 10, 11, 12, 13, 7, 8]  # "7 8" repeats: a lookup proposes 9 10 11 12 13 7 8 ...
    for B, want in ((1, 16), (2, 8), (4, 4), (8, 4)):
        hyb = HybridProposer(FixedChain(), max_nodes=16, strong_match=0)  # the model's chain in every round
        hyb.begin([rep] * B, torch.full((B,), 9), 64, Sampling())
        rows = hyb.propose_tree(4)
        assert len(rows) == B
        assert all(len(toks) <= want for toks, _ in rows), (B, [len(t) for t, _ in rows])
        assert rows[0][0][:1] == [10]  # the lookup (a 3-token match) comes first
        if B == 1:  # room for the lookup, the model's chain and the second lookup
            assert 1 in rows[0][0] and len(rows[0][0]) > 8


def test_hybrid_strong_lookup_rounds_skip_the_model():
    """A suffix that recurs >= strong_match tokens makes the round lookups alone: the longest match's
    continuation first, as long as the node budget, and no model call; a weaker match keeps the model."""
    from eval.proposers import HybridProposer, Sampling

    loop = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51] * 2  # the output repeats a 12-token run
    other = [5, 40, 41, 60, 61, 62]  # "40 41" also occurs followed by 60: a shorter (2-token) match
    hyb = HybridProposer(FixedChain(), max_nodes=10, strong_match=3, long_ngram=8)
    hyb.begin([other + loop[:-1]], torch.tensor([loop[-1]]), 128, Sampling())
    (toks, parents), = hyb.propose_tree(2)
    assert hyb.model.calls == 0 and hyb.lookup_rounds == 1
    assert toks[:10] == loop[:10] and parents[:10] == list(range(10))  # one 10-node chain: the budget
    # a 2-token match only: the model's chain joins the tree
    hyb2 = HybridProposer(FixedChain(), max_nodes=10, strong_match=3)
    hyb2.begin([[7, 8, 9, 1, 7]], torch.tensor([8]), 64, Sampling())
    (toks2, _), = hyb2.propose_tree(2)
    assert hyb2.model.calls == 1 and hyb2.lookup_rounds == 0
    assert toks2[:2] == [9, 1] and 1 in toks2[2:] and 2 in toks2
    # a batch: the round is lookups alone only when every row matches strongly
    hyb3 = HybridProposer(FixedChain(), max_nodes=10, strong_match=3)
    hyb3.begin([other + loop[:-1], [7, 8, 9, 1, 7]], torch.tensor([loop[-1], 8]), 128, Sampling())
    hyb3.propose_tree(2)
    assert hyb3.model.calls == 1 and hyb3.lookup_rounds == 0
    # ... once the weak row has finished (accept's n_acc -1), its frozen history no longer decides for the other
    hyb3.accept(torch.tensor([[loop[-1], 0, 0], [8, 0, 0]]), torch.tensor([len(other) + 23, 5]),
                torch.tensor([0, -1]), torch.tensor([loop[0], 0]))
    hyb3.propose_tree(2)
    assert hyb3.model.calls == 1 and hyb3.lookup_rounds == 1


def _brute_candidates(h, k, m, max_n, min_n):
    """The per-n scans NgramProposer.candidates replaces: n from max_n down, latest occurrence first."""
    out = []
    for n in range(min(max_n, len(h) - 1), min_n - 1, -1):
        for s in range(len(h) - n - 1, -1, -1):
            if h[s:s + n] == h[-n:]:
                cont = h[s + n:s + n + k]
                if all(cont != c for c, _ in out):
                    out.append((cont, n))
                    if len(out) >= m:
                        return out
    return out


def test_ngram_candidates_match_per_n_scans():
    import random

    from eval.proposers import NgramProposer

    rng, ng = random.Random(0), NgramProposer()
    for _ in range(3000):
        h = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]  # a 4-token alphabet: many matches
        k, m, max_n = rng.randrange(1, 6), rng.randrange(1, 4), rng.randrange(1, 9)
        min_n = rng.randrange(1, max_n + 1)
        assert ng.candidates(h, k, m, min_n=min_n, max_n=max_n) == _brute_candidates(h, k, m, max_n, min_n)
    assert ng.candidates([1, 2, 3, 9, 1, 2, 3], 2, 1) == [([9, 1], 3)]  # default max_ngram 3


def test_serve_settings_are_checked_and_applied():
    """A promoted hybrid's "serve" settings: a positive int budget and a bool sampled chain, set on the proposer;
    anything else is refused in one line naming the setting."""
    from eval.proposers import HybridProposer, NoDraft, serve_with

    hyb = serve_with(HybridProposer(NoDraft()), {"max_nodes": 6, "sampled_chain": True}, "best/draftsmith_draft.json")
    assert hyb.max_nodes == 6 and hyb.sampled_chain is True
    for bad in ({"max_nodes": 0}, {"max_nodes": True}, {"sampled_chain": 1}, {"branches": 2}):
        with pytest.raises(ValueError, match=rf"best/draftsmith_draft.json: serve.{next(iter(bad))}="):
            serve_with(HybridProposer(NoDraft()), bad, "best/draftsmith_draft.json")
