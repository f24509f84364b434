"""Lossless speculative sampling: the decoder's output distribution equals the target's.

Two levels, each with >= 10^4 draws and a chi-square goodness-of-fit test:
- the per-round accept rule (`verify_sample`) against fixed p and q, position by position;
- end to end through `SpeculativeDecoder` on tiny models (draft LM, n-gram with one-hot q, EAGLE),
  the marginals of the first two generated tokens against the target's exact distributions.
And the same tests must FAIL when the residual is deliberately wrong (sampling from p instead of
normalize(max(0, p - q)) after a rejection), so they have the power to catch the classic bug.
"""

import pytest
import torch

import eval.decoder as D
from eval.decoder import SpeculativeDecoder, verify_sample
from eval.heads import EagleHead
from eval.proposers import DraftLMProposer, EagleProposer, HybridProposer, NgramProposer, Sampling

from helpers import SAMPLING_PROMPT as PROMPT, SAMPLING_V as V, chi2_pvalue, e2e_pvalues, wrong_residual
from helpers import sampling_llama as tiny


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- the sampler itself

@pytest.mark.cpu_paths  # the kernels' cdf_sample, and eval.cpu.cdf_search on the generic path
def test_inverse_cdf_sampler_draws_each_id_with_its_weight():
    """Sampling.sample (eval.proposers.base.inverse_cdf_sample) against the weights it is given: a ragged vocabulary
    (not a multiple of its 256-id blocks) with mass in the first, a middle and the padded last block, zeros
    between (never drawn), weights not summing to 1, all the mass on the last id, and a tail of ids below fp32's
    rounding of a running sum (an fp32 cumsum drops them), each by chi-square or exactly; seeded draws repeat."""
    from eval.proposers.base import inverse_cdf_sample

    g = torch.Generator().manual_seed(0)
    V, n = 1000, 20000
    w = torch.zeros(V)
    w[[0, 3, 255, 256, 600, 999]] = torch.tensor([0.5, 1.0, 2.0, 0.25, 3.0, 1.25])  # sums to 8, block edges
    x = inverse_cdf_sample(w.expand(n, V), g)
    assert set(x.unique().tolist()) <= {0, 3, 255, 256, 600, 999}
    assert chi2_pvalue(x, w / w.sum()) > 1e-4
    last = torch.zeros(2, 3, V)
    last[..., V - 1] = 1.0
    assert (inverse_cdf_sample(last, g) == V - 1).all() and inverse_cdf_sample(last, g).shape == (2, 3)
    tail = torch.full((49152,), 1e-8)  # below half an fp32 ulp of a running sum near 1
    tail[:8] = (1 - 1e-8 * (49152 - 8)) / 8  # ~0.49% of the mass on 49144 ids of 1e-8 each
    share, n_tail = 49144e-8, 12000
    far = sum((inverse_cdf_sample(tail.expand(4000, -1), g) >= 8).sum().item() for _ in range(n_tail // 4000))
    assert abs(far - share * n_tail) < 4 * (share * n_tail) ** 0.5, far  # within 4 sigma of its share
    a = inverse_cdf_sample(w.expand(64, V), torch.Generator().manual_seed(5))
    assert torch.equal(a, inverse_cdf_sample(w.expand(64, V), torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("warp", [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.7, top_p=0.8),
                                  dict(temperature=0.0)])
def test_a_draw_over_the_draft_vocabulary_is_the_draw_over_its_target_logits(warp):
    """draw(logits, s, ids, V) over a truncated draft vocabulary against draw() over to_target_vocab's [.., V]
    logits (-inf outside ids): the same q at every target id (0 outside ids), the same greedy token, and
    sampled tokens that are draft ids drawn by q (chi-square over the 8 ids)."""
    from eval.proposers import draw, to_target_vocab

    g = torch.Generator().manual_seed(3)
    V, ids = 40, torch.tensor([2, 5, 7, 11, 19, 23, 31, 38])
    logits = torch.randn(3, 2, len(ids), generator=g) * 2  # [B, k, Vd]
    s = Sampling(**warp, generator=torch.Generator().manual_seed(0))
    tok, q = draw(logits, s, ids, V)
    want_tok, want_q = draw(to_target_vocab(logits, ids, V), Sampling(**warp))
    assert tok.shape == (3, 2) and set(tok.flatten().tolist()) <= set(ids.tolist())
    if s.greedy:
        assert q is None and torch.equal(tok, want_tok)
        return
    assert q.shape == (3, 2, V) and torch.allclose(q, want_q, atol=1e-6)
    draws, _ = draw(logits[0, 0].expand(20000, -1), s, ids, V)
    assert chi2_pvalue(draws, q[0, 0]) > 1e-4


# ---------------------------------------------------------------- the accept rule alone

def _rule_draws(n=20000, k=3, one_hot=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    Vs = 8
    p = torch.rand(k + 1, Vs, generator=g).pow(3)
    p = p / p.sum(-1, keepdim=True)  # [k+1, V] fixed target distributions (context-free model)
    q = torch.rand(k, Vs, generator=g).pow(3)
    q = q / q.sum(-1, keepdim=True)  # [k, V] draft distributions, far from p
    s = Sampling(1.0, generator=g)
    if one_hot:
        drafts = p[:k].argmax(-1).expand(n, k).contiguous()  # deterministic drafts (q one-hot): each p's mode
        qq = None
    else:
        drafts = torch.multinomial(q, n, replacement=True, generator=g).T.contiguous()  # [n, k]
        qq = q.expand(n, k, Vs)
    n_acc, nxt = verify_sample(p.expand(n, k + 1, Vs), qq, drafts, s)
    # emitted tokens of the round: drafts[:n_acc] then nxt
    emitted = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)
    emitted[torch.arange(n), n_acc] = nxt
    return p, n_acc, emitted


def _rule_pvalues(one_hot):
    p, n_acc, emitted = _rule_draws(one_hot=one_hot)
    # position i is reached when the first i tokens were accepted drafts; given that, token i ~ p_i, the
    # bonus token (i = k, after every draft was accepted) included
    k = emitted.shape[1] - 1
    assert (n_acc == k).sum() > 300  # enough rounds reach the bonus to test it
    return [chi2_pvalue(emitted[n_acc >= i, i], p[i]) for i in range(k + 1)]


@pytest.mark.parametrize("one_hot", [False, True])
def test_accept_rule_matches_target(one_hot):
    assert min(_rule_pvalues(one_hot)) > 1e-4


@pytest.mark.parametrize("one_hot", [False, True])
def test_accept_rule_with_wrong_residual_fails(one_hot, monkeypatch):
    monkeypatch.setattr(D, "residual", wrong_residual)
    assert min(_rule_pvalues(one_hot)) < 1e-6


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def target():
    return tiny(0)


WARPS = {"t1": dict(temperature=1.0), "warped": dict(temperature=0.7, top_k=12, top_p=0.9)}


def proposer(kind, target):
    if kind == "draft_lm":
        return DraftLMProposer(tiny(1, layers=1, init=0.3), V)
    if kind == "ngram":
        return NgramProposer()
    if kind == "hybrid":  # one-hot lookup rounds mixed with sampled draft-LM rounds
        return HybridProposer(DraftLMProposer(tiny(1, layers=1, init=0.3), V), min_match=1)
    return EagleProposer(EagleHead.from_target(target), target)


@pytest.mark.parametrize("kind,warp", [("draft_lm", "t1"), ("draft_lm", "warped"), ("ngram", "t1"), ("eagle", "t1"),
                                       ("hybrid", "warped")])
def test_speculative_sampling_matches_target(target, kind, warp):
    pv, stats = e2e_pvalues(target, proposer(kind, target), WARPS[warp])
    assert stats["proposed"] > 0 and 0 < stats["alpha"] < 1  # drafts were both accepted and rejected
    assert min(pv) > 1e-4, pv


def test_plain_sampling_matches_target(target):
    pv, _ = e2e_pvalues(target, None, WARPS["warped"])
    assert min(pv) > 1e-4, pv


@pytest.mark.parametrize("kind", ["draft_lm", "ngram"])
def test_wrong_residual_fails_end_to_end(target, kind, monkeypatch):
    monkeypatch.setattr(D, "residual", wrong_residual)
    pv, _ = e2e_pvalues(target, proposer(kind, target), WARPS["t1"])
    assert min(pv) < 1e-6, pv


def test_sampling_is_seeded(target):
    dec = SpeculativeDecoder(target, proposer("draft_lm", target), k=3)
    a = dec.generate([PROMPT] * 4, max_new_tokens=8, temperature=1.0, seed=5).sequences
    b = dec.generate([PROMPT] * 4, max_new_tokens=8, temperature=1.0, seed=5).sequences
    c = dec.generate([PROMPT] * 4, max_new_tokens=8, temperature=1.0, seed=6).sequences
    assert a == b and a != c
