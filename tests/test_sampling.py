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
from transformers import LlamaConfig, LlamaForCausalLM

import eval.decoder as D
from eval.decoder import SpeculativeDecoder, verify_sample
from eval.heads import EagleHead
from eval.proposers import DraftLMProposer, EagleProposer, HybridProposer, NgramProposer, Sampling

V = 24
PROMPT = [3, 7, 3, 7, 3]


pytestmark = pytest.mark.usefixtures("one_thread")


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to `probs` [V]; cells with expected count < 5 pooled."""
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    exp = probs.double() * n
    small = exp < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    if (counts[~keep] > 0).any():
        return 0.0  # a sample where the target puts no mass
    counts, exp = counts[keep], exp[keep]
    stat = ((counts - exp) ** 2 / exp).sum()
    df = max(counts.numel() - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def wrong_residual(p, q):
    return p  # the bug: resample from p after a rejection


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
    # position i is reached when the first i tokens were accepted drafts; given that, token i ~ p_i
    return [chi2_pvalue(emitted[n_acc >= i, i], p[i]) for i in range(3)]


@pytest.mark.parametrize("one_hot", [False, True])
def test_accept_rule_matches_target(one_hot):
    assert min(_rule_pvalues(one_hot)) > 1e-4


@pytest.mark.parametrize("one_hot", [False, True])
def test_accept_rule_with_wrong_residual_fails(one_hot, monkeypatch):
    monkeypatch.setattr(D, "residual", wrong_residual)
    assert min(_rule_pvalues(one_hot)) < 1e-6


# ---------------------------------------------------------------- end to end

def tiny(seed, layers=2, hidden=32, heads=4, kv=2, init=0.3):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                      initializer_range=init)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target():
    return tiny(0)


def exact_marginals(target, s: Sampling):
    """p(x1) and p(x2) = sum_x1 p(x1) p(x2 | x1) under the warped target."""
    with torch.no_grad():
        p1 = s.probs(target(torch.tensor([PROMPT])).logits[0, -1])  # [V]
        ctx = torch.cat([torch.tensor(PROMPT).expand(V, -1), torch.arange(V)[:, None]], 1)  # [V, L+1]
        p2 = (p1[:, None] * s.probs(target(ctx).logits[:, -1])).sum(0)  # [V]
    return p1, p2


def e2e_pvalues(target, proposer, warp, draws=10000, calls=2):
    dec = SpeculativeDecoder(target, proposer, k=2)
    outs = []
    for seed in range(calls):
        res = dec.generate([PROMPT] * (draws // calls), max_new_tokens=2, seed=seed, **warp)
        outs.append(torch.tensor(res.sequences))
    out = torch.cat(outs)  # [draws, 2]
    p1, p2 = exact_marginals(target, Sampling(**warp))
    return [chi2_pvalue(out[:, 0], p1), chi2_pvalue(out[:, 1], p2)], res.stats


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
