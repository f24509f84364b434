import pytest
import torch
import torch.nn.functional as F

from pipeline.losses import DIVERGENCES, divergence, forward_kl, jsd, reverse_kl, total_variation

N, V = 6, 11


def _logits(seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, V, generator=g) * scale


def _ref(name, s, t, beta=0.5):
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    if name == "fkl":
        return F.kl_div(ls, lt, reduction="batchmean", log_target=True)
    if name == "rkl":
        return F.kl_div(lt, ls, reduction="batchmean", log_target=True)
    if name == "tv":
        return 0.5 * (ls.exp() - lt.exp()).abs().sum(-1).mean()
    m = (beta * lt.exp() + (1 - beta) * ls.exp()).log()
    return (beta * F.kl_div(m, lt, reduction="batchmean", log_target=True)
            + (1 - beta) * F.kl_div(m, ls, reduction="batchmean", log_target=True))


@pytest.mark.parametrize("name", list(DIVERGENCES))
def test_full_matches_reference(name):
    s, t = _logits(0), _logits(1)
    got = divergence(name, s, t, beta=0.3)
    torch.testing.assert_close(got, _ref(name, s, t, beta=0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(DIVERGENCES))
def test_topk_with_k_equal_v_is_full(name):
    s, t = _logits(2), _logits(3)
    lp, ids = F.log_softmax(t, -1).topk(V, -1)
    got = divergence(name, s, topk_ids=ids, topk_logprobs=lp)
    torch.testing.assert_close(got, divergence(name, s, t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(DIVERGENCES))
def test_topk_coarsening_reference(name):
    """k < V: same as the full formula on the explicit (top-k ids + rest) partition."""
    s, t = _logits(4), _logits(5)
    k = 4
    lt_full = F.log_softmax(t, -1)
    lp, ids = lt_full.topk(k, -1)
    got = divergence(name, s, topk_ids=ids, topk_logprobs=lp)
    ls_full = F.log_softmax(s, -1)
    rest = torch.ones(N, V, dtype=torch.bool).scatter(1, ids, False)

    def coarse(l):
        return torch.cat([l.gather(1, ids), torch.logsumexp(l.masked_fill(~rest, -float("inf")), -1, keepdim=True)], -1)

    # buckets are already normalised log-probs, so they act as logits
    torch.testing.assert_close(got, _ref(name, coarse(ls_full), coarse(lt_full)), rtol=1e-4, atol=1e-6)
    if name != "tv":  # coarsening can only lose information (data processing inequality)
        assert got <= divergence(name, s, t) + 1e-6


@pytest.mark.parametrize("name", list(DIVERGENCES))
def test_zero_when_equal(name):
    t = _logits(6)
    assert divergence(name, t.clone(), t).abs() < 1e-6
    lp, ids = F.log_softmax(t, -1).topk(3, -1)
    assert divergence(name, t.clone(), topk_ids=ids, topk_logprobs=lp).abs() < 1e-6


@pytest.mark.parametrize("name", list(DIVERGENCES))
def test_gradients_finite(name):
    t = _logits(7, scale=20.0)  # peaked teacher: tiny tail
    s = _logits(8).requires_grad_(True)
    lp, ids = F.log_softmax(t, -1).topk(V, -1)
    for kw in ({"topk_ids": ids, "topk_logprobs": lp}, {"topk_ids": ids[:, :3], "topk_logprobs": lp[:, :3]}):
        s.grad = None
        divergence(name, s, **kw).backward()
        assert torch.isfinite(s.grad).all()
    s.grad = None
    divergence(name, s.bfloat16(), t).backward()
    assert torch.isfinite(s.grad).all()


def test_truncated_draft_vocab():
    """Draft rows = target ids d2t; out-of-vocab teacher ids fall into the rest bucket."""
    t = _logits(9)
    d2t = torch.tensor([0, 2, 3, 5, 7, 8, 10])
    s = _logits(10)[:, : len(d2t)]
    lt_full = F.log_softmax(t, -1)
    lp, ids = lt_full.topk(4, -1)
    got = forward_kl(s, topk_ids=ids, topk_logprobs=lp, d2t=d2t)
    # reference on the student embedded in the full vocabulary with -inf off the draft vocab
    s_full = torch.full((N, V), -float("inf"))
    s_full[:, d2t] = s
    ls_full = F.log_softmax(s_full, -1)
    in_vocab = torch.zeros(V, dtype=torch.bool)
    in_vocab[d2t] = True
    ref = []
    for r in range(N):
        keep = [int(i) for i in ids[r] if in_vocab[i]]
        pt = torch.cat([lt_full[r, keep].exp(), (1 - lt_full[r, keep].exp().sum())[None]])
        other = [i for i in range(V) if i not in keep]
        ps = torch.cat([ls_full[r, keep].exp(), ls_full[r, other].exp().sum()[None]])
        ref.append((pt * (pt.log() - ps.log())).sum())
    torch.testing.assert_close(got, torch.stack(ref).mean(), rtol=1e-4, atol=1e-6)
    # full teacher logits + d2t: teacher renormalised over the draft vocab
    got_full = forward_kl(s, t, d2t=d2t)
    ref_full = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t[:, d2t], -1), reduction="batchmean", log_target=True)
    torch.testing.assert_close(got_full, ref_full, rtol=1e-5, atol=1e-6)


def test_mask_and_reduction():
    s, t = _logits(11), _logits(12)
    per = reverse_kl(s, t, reduction="none")
    assert per.shape == (N,)
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    torch.testing.assert_close(reverse_kl(s, t, mask=mask), per[mask].mean())
    assert jsd(s, t, beta=0.5) <= torch.log(torch.tensor(2.0))
    assert 0 <= total_variation(s, t) <= 1
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence("xx", s, t)


@pytest.mark.parametrize("name", list(DIVERGENCES))
@pytest.mark.parametrize("T", [0.7, 1.3])
def test_temperature_compares_the_served_distributions(name, T):
    """At temperature T both sides are what sampling at T serves: full logits / T, and the top-k with k = V
    tempered exactly (no tail); tv at T is 1 minus speculative sampling's acceptance at T."""
    from pipeline.losses import temper_topk

    s, t = _logits(0), _logits(1)
    want = _ref(name, s / T, t / T)
    assert torch.allclose(divergence(name, s, t, temperature=T), want, atol=1e-5)
    lt = F.log_softmax(t, -1)
    ids = lt.argsort(-1, descending=True)
    got = divergence(name, s, topk_ids=ids, topk_logprobs=lt.gather(-1, ids), temperature=T)
    assert torch.allclose(got, want, atol=1e-4)
    if name == "tv":
        accept = torch.minimum(F.softmax(s / T, -1), F.softmax(t / T, -1)).sum(-1).mean()
        assert torch.allclose(1 - got, accept, atol=1e-4)
    # a real top-k (k < V): tempered over the top-k and a tail taken at the k-th probability
    k = 4
    tl = temper_topk(lt.gather(-1, ids[:, :k]), T)
    tail = 1 - tl.exp().sum(-1)
    assert (tail > 0).all() and torch.all(tl[:, :-1] >= tl[:, 1:])
    if T < 1:  # sharper: the top-1 gains, and the tail's tempered mass bounds the true one from above
        assert torch.all(tl[:, 0] > lt.gather(-1, ids[:, :1])[:, 0])
        assert torch.all(tail >= F.softmax(t / T, -1).gather(-1, ids[:, k:]).sum(-1) - 1e-6)


def test_temperature_one_changes_nothing_and_must_be_positive():
    s, t = _logits(0), _logits(1)
    assert torch.equal(divergence("fkl", s, t, temperature=1.0), divergence("fkl", s, t))
    with pytest.raises(ValueError, match="must be > 0"):
        divergence("tv", s, t, temperature=0.0)
