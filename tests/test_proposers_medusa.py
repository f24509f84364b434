"""The Medusa proposer (eval/proposers/medusa.py): greedy decoding equals plain decoding (chains, k=auto,
hybrid trees with the heads' runner-up paths), drafts are the heads on the true feature, sampling is
lossless, the packed and int8 copies compute what the heads do, and a promoted hybrid serves with its
fitted budget."""

import pytest
import torch
from transformers import LlamaForCausalLM

from eval.decoder import SpeculativeDecoder
from eval.heads import MedusaHeads
from eval.proposers import HybridProposer, MedusaProposer, NoDraft, Sampling, load_proposer
from helpers import (MEDUSA_NH as NH, PROMPTS as ALL_PROMPTS, TRAIN_V as V, medusa_target,
                     perturbed_recurrent_heads)

PROMPTS = ALL_PROMPTS[:3]
N_NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return medusa_target()


@pytest.fixture(scope="module")
def ref(target):
    """Plain greedy, one prompt at a time."""
    dec = SpeculativeDecoder(target, None)
    return [dec.generate([p], max_new_tokens=N_NEW).sequences[0] for p in PROMPTS]


def _proposers(target, trained_heads):
    trunc = torch.arange(0, V, 2)
    return {
        "trained": MedusaProposer(trained_heads, target),
        "fresh": MedusaProposer(MedusaHeads.from_target(target, NH), target),
        "trunc": MedusaProposer(MedusaHeads.from_target(target, NH, draft_ids=trunc), target),
    }


@pytest.mark.parametrize("k", [1, 2, NH, NH + 2])
def test_greedy_exact_batch1_and_ragged(target, trained, ref, k):
    for name, prop in _proposers(target, trained[0]).items():
        dec = SpeculativeDecoder(target, prop, k=k)
        for p, r in zip(PROMPTS, ref):
            res = dec.generate([p], max_new_tokens=N_NEW)
            assert res.sequences == [r], (name, k, p)
            assert len(res.stats["accept_len_hist"]) == k + 1 and res.stats["proposed"] > 0
        assert dec.generate(PROMPTS, max_new_tokens=N_NEW).sequences == ref, (name, k)


def test_eos_and_max_new_tokens(target, trained, ref):
    eos = ref[0][5]  # a token the first row emits at step 5: every row must stop right after it
    want = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    assert want != ref
    for name, prop in _proposers(target, trained[0]).items():
        for k in (2, NH):
            res = SpeculativeDecoder(target, prop, k=k).generate(PROMPTS, max_new_tokens=N_NEW,
                                                                  eos_token_id=[eos, V + 7])
            assert res.sequences == want, (name, k)
            res = SpeculativeDecoder(target, prop, k=k).generate(PROMPTS, max_new_tokens=5, eos_token_id=eos)
            assert res.sequences == [w[:5] for w in want], (name, k)


def test_k_auto_and_hybrid_exact(target, trained, ref):
    """k="auto" re-begins the proposer from the decoder's feature buffer after plain rounds; a hybrid
    keeps the heads' feature in sync on n-gram rounds."""
    for prop in (MedusaProposer(trained[0], target),
                 HybridProposer(MedusaProposer(trained[0], target), min_match=1, k_ngram=6)):
        assert SpeculativeDecoder(target, prop, k="auto").generate(PROMPTS, max_new_tokens=N_NEW).sequences == ref
        assert SpeculativeDecoder(target, prop, k=NH).generate(PROMPTS, max_new_tokens=N_NEW).sequences == ref


@torch.no_grad()
def test_alternatives_are_the_heads_runners_up_and_keep_the_tree_exact(target, trained, ref):
    """alternatives(m) after a greedy propose: Medusa's sparse-tree paths from each head's top-3 (head 0's
    2nd + head 1's 1st, head 0's 1st + head 1's 2nd, head 0's 3rd), in that order; a hybrid that adds
    them to its tree still decodes exactly what plain decoding does and accepts at least as much."""
    heads = trained[0]
    prop = MedusaProposer(heads, target)
    feats = target.model(torch.tensor([PROMPTS[2]])).last_hidden_state  # [1, S, H]
    prop.begin([PROMPTS[2]], torch.tensor([0]), 64, Sampling(), features=feats)
    chain = prop.propose(NH)[0][0].tolist()
    top = heads.d2t[heads.logits(heads(feats[0, -1])).topk(3, -1).indices].tolist()  # [NH, 3]
    assert chain == [t[0] for t in top]
    assert prop.alternatives(3) == [[[top[0][1], top[1][0]], [top[0][0], top[1][1]], [top[0][2]]]]
    assert prop.alternatives(1) == [[[top[0][1], top[1][0]]]]
    prop.propose(1)  # one head: no second head to pair with
    assert prop.alternatives(3) == [[[top[0][1]], [top[0][2]]]]
    taus = {}
    for a in (0, 3):
        hyb = HybridProposer(MedusaProposer(heads, target), min_match=2, max_nodes=16, alt_branches=a)
        for prompts in (PROMPTS, [PROMPTS[0]]):  # ragged, then batch 1
            res = SpeculativeDecoder(target, hyb, k=2).generate(prompts, max_new_tokens=N_NEW)
            assert res.sequences == ref[: len(prompts)], a
        # batch 1 with room for every candidate: added nodes displace none, so no round accepts less
        hyb.max_nodes = 64
        taus[a] = [SpeculativeDecoder(target, hyb, k=2).generate([p], max_new_tokens=N_NEW).stats["tau"]
                   for p in PROMPTS]
    assert all(t3 >= t0 for t0, t3 in zip(taus[0], taus[3])), taus


@torch.no_grad()
def _decode_recording(prop, target):
    """Decode PROMPTS with `prop` at K=NH -> (result, the drafts of every round, n_acc of every round)."""
    rounds, accepts = [], []
    propose, accept = prop.propose, prop.accept
    prop.propose = lambda k: rounds.append(propose(k)[0].clone()) or (rounds[-1], None)
    prop.accept = lambda tokens, start, n_acc, bonus, features=None: (
        accepts.append(n_acc.clone()), accept(tokens, start, n_acc, bonus, features))
    return SpeculativeDecoder(target, prop, k=NH).generate(PROMPTS, max_new_tokens=N_NEW), rounds, accepts


def test_drafts_are_the_heads_on_the_true_feature(target, trained):
    """Every round, draft i of row b is head i's argmax on the target feature at (current position - 1),
    recomputed from scratch on the final sequence: the proposer's begin/accept pick the right feature."""
    heads = trained[0]
    res, rounds, accepts = _decode_recording(MedusaProposer(heads, target), target)
    for b, p in enumerate(PROMPTS):
        seq = torch.tensor([p + res.sequences[b]])
        feats = target.model(seq).last_hidden_state[0]  # [S, H]
        want = heads.d2t[heads.logits(heads(feats)).argmax(-1)]  # [S, NH]: row t drafts tokens t+2..
        n, checked = len(p), 0
        for drafts, n_acc in zip(rounds, accepts):
            if n_acc[b] < 0:
                break
            assert drafts[b].tolist() == want[n - 1].tolist(), (b, n)
            n += int(n_acc[b]) + 1
            checked += 1
        assert checked >= 3


# ------------------------------------------------------------------------------------ sampling

def test_propose_sampling_and_truncated_vocab(target):
    ids = torch.arange(1, V, 3)
    heads = MedusaHeads.from_target(target, NH, draft_ids=ids)
    prop = MedusaProposer(heads, target)
    feats = torch.randn(2, 6, 32)
    g = torch.Generator().manual_seed(0)
    prop.begin([[1, 2, 3], [4, 5, 6, 7, 8, 9]], torch.tensor([1, 2]), 32, Sampling(1.0, generator=g), feats)
    inside = torch.zeros(V, dtype=torch.bool)
    inside[ids] = True
    for _ in range(20):
        d, q = prop.propose(NH + 3)  # more than the heads: one draft per head
        assert d.shape == (2, NH) and q.shape == (2, NH, V) and inside[d].all()
        torch.testing.assert_close(q.sum(-1), torch.ones(2, NH))
        assert (q[..., ~inside] == 0).all() and (q.gather(-1, d[..., None]) > 0).all()
    prop.sampling = Sampling(0.0)
    d, q = prop.propose(2)
    assert q is None and d.shape == (2, 2) and inside[d].all()
    # greedy drafts are head i's argmax on the feature that produced `first` (index len(prompt) - 1)
    want = ids[heads.logits(heads(feats[[0, 1], [2, 5]])).argmax(-1)]
    assert d.tolist() == want[:, :2].tolist()


def test_sampling_run_is_valid_and_seeded(target, trained):
    trunc = MedusaProposer(MedusaHeads.from_target(target, NH, draft_ids=torch.arange(0, V, 2)), target)
    for prop in (MedusaProposer(trained[0], target), trunc):
        dec = SpeculativeDecoder(target, prop, k=NH)
        a = dec.generate(PROMPTS, max_new_tokens=12, temperature=1.0, seed=3)
        b = dec.generate(PROMPTS, max_new_tokens=12, temperature=1.0, seed=3)
        assert a.sequences == b.sequences
        assert all(len(s) == 12 and all(0 <= t < V for t in s) for s in a.sequences)
        assert a.stats["proposed"] > 0


@pytest.mark.parametrize("bug", [False, True])
def test_speculative_sampling_matches_target(bug, monkeypatch):
    """The end-to-end chi-square check of tests/test_sampling.py with Medusa drafts (k=2): the first
    two sampled tokens follow the target's exact marginals; and with the classic bug (resampling from
    p after a rejection) the same check fails, so it has the power to see a wrong q."""
    import eval.decoder as D
    from helpers import e2e_pvalues, sampling_llama as tiny, wrong_residual

    if bug:
        monkeypatch.setattr(D, "residual", wrong_residual)
    t = tiny(0)
    pv, stats = e2e_pvalues(t, MedusaProposer(MedusaHeads.from_target(t, 2), t), dict(temperature=1.0))
    assert stats["proposed"] > 0 and 0 < stats["alpha"] < 1
    assert (min(pv) < 1e-6) if bug else (min(pv) > 1e-4), pv


# ------------------------------------------------------------------------------------ recurrent heads

@pytest.mark.parametrize("k", [1, 2, NH + 2, "auto"])
def test_recurrent_greedy_exact(target, trained_rec, ref, k):
    props = {"trained": MedusaProposer(trained_rec[0], target),
             "trunc": MedusaProposer(perturbed_recurrent_heads(target, 1, torch.arange(0, V, 2)), target),
             "hybrid": HybridProposer(MedusaProposer(trained_rec[0], target), min_match=2, max_nodes=16)}
    for name, prop in props.items():
        dec = SpeculativeDecoder(target, prop, k=k)
        for p, r in zip(PROMPTS, ref):
            assert dec.generate([p], max_new_tokens=N_NEW).sequences == [r], (name, k, p)
        assert dec.generate(PROMPTS, max_new_tokens=N_NEW).sequences == ref, (name, k)


@torch.no_grad()
def test_recurrent_drafts_read_the_current_token_and_the_drafts(target, trained_rec):
    """Every round, recomputed from scratch on the final sequence: draft 0 is head 0's argmax on the
    feature at (current position - 1) and the current token, draft i head i's argmax on head i-1's
    state and draft i-1."""
    heads = trained_rec[0]
    emb = target.get_input_embeddings()
    res, rounds, accepts = _decode_recording(MedusaProposer(heads, target), target)
    for b, p in enumerate(PROMPTS):
        seq = p + res.sequences[b]
        feats = target.model(torch.tensor([seq])).last_hidden_state[0]  # [S, H]
        n, checked = len(p), 0
        for drafts, n_acc in zip(rounds, accepts):
            if n_acc[b] < 0:
                break
            s, tok, want = feats[n - 1], seq[n], []
            for i in range(NH):
                s = heads.step(i, s, emb(torch.tensor(tok)))
                tok = int(heads.d2t[heads.lm_heads[i](s).argmax()])
                want.append(tok)
            assert drafts[b].tolist() == want, (b, n)
            n += int(n_acc[b]) + 1
            checked += 1
        assert checked >= 3


@torch.no_grad()
def test_recurrent_alternatives_follow_head0_runner_up(target):
    """The first runner-up path is head 0's 2nd choice followed by head 1's best GIVEN that token (not
    head 1's best after head 0's 1st, as for independent heads)."""
    heads = perturbed_recurrent_heads(target, 2)
    emb = target.get_input_embeddings()
    prop = MedusaProposer(heads, target)
    feats = target.model(torch.tensor([PROMPTS[2]])).last_hidden_state  # [1, S, H]
    prop.begin([PROMPTS[2]], torch.tensor([7]), 64, Sampling(), features=feats)
    chain = prop.propose(2)[0][0].tolist()
    s0 = heads.step(0, feats[0, -1], emb(torch.tensor(7)))
    top0 = heads.d2t[heads.lm_heads[0](s0).topk(3).indices].tolist()
    after = [heads.d2t[heads.lm_heads[1](heads.step(1, s0, emb(torch.tensor(t)))).topk(2).indices].tolist()
             for t in top0[:2]]
    want = [[[top0[1], after[1][0]], [top0[0], after[0][1]], [top0[2]]]]
    assert chain == [top0[0], after[0][0]]
    assert prop.alternatives(3) == want  # head 1 after the 2nd choice computed on demand
    prop.with_alternatives = True  # as a hybrid sets it: both head-1 rows in propose()'s one call
    assert prop.propose(2)[0][0].tolist() == chain and prop.alternatives(3) == want


@pytest.mark.parametrize("bug", [False, True])
def test_recurrent_speculative_sampling_matches_target(bug, monkeypatch):
    """As test_speculative_sampling_matches_target, with recurrent heads: draft i is drawn from q_i given
    drafts 0..i-1, and that q is what verify_sample receives."""
    import eval.decoder as D
    from helpers import e2e_pvalues, sampling_llama as tiny, wrong_residual

    if bug:
        monkeypatch.setattr(D, "residual", wrong_residual)
    t = tiny(0)
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(t, 2, recurrent=True)
    with torch.no_grad():
        for blk in heads.blocks:
            blk.down.weight.normal_(0, 0.5)
    pv, stats = e2e_pvalues(t, MedusaProposer(heads, t), dict(temperature=1.0))
    assert stats["proposed"] > 0 and 0 < stats["alpha"] < 1
    assert (min(pv) < 1e-6) if bug else (min(pv) > 1e-4), pv


# ------------------------------------------------------------------------------------ copies and serving

@torch.no_grad()
@pytest.mark.parametrize("int8", [False, True])
def test_proposer_packed_matmuls_match_the_heads_in_bf16(target, int8):
    """The proposer runs the heads through packed copies (on CPU bf16, the project's small-row kernel):
    they must compute what MedusaHeads computes, up to bf16 summation order; with int8=True (the
    default) through weight-only int8 copies, up to their rounding (a step of max |w_row| / 127)."""
    t16 = LlamaForCausalLM(target.config).eval()
    t16.load_state_dict(target.state_dict())
    t16 = t16.to(torch.bfloat16)
    heads = perturbed_recurrent_heads(target, seed=3)
    prop = MedusaProposer(heads, t16, int8=int8)
    h = prop.heads  # bf16 now
    s, e = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    tol = dict(atol=0.15, rtol=0.05) if int8 else dict(atol=0.05, rtol=0.02)
    for i in range(NH):
        want = h.step(i, s, e)
        got = prop._step(i, s, e)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        torch.testing.assert_close(prop._lm[i](got).float(), h.lm_heads[i](got).float(), **tol)
    assert MedusaProposer(heads, t16).int8 and not MedusaProposer(heads, t16, int8=False).int8


def test_a_promoted_hybrid_serves_with_its_fitted_tree_budget(target, tmp_path):
    """best/draftsmith_draft.json's "serve" (evaluate's fitted node budget) is applied on load, so the
    promoted draft serves as it was measured; a setting the decoder does not know is refused."""
    V = target.config.vocab_size
    heads = MedusaHeads.from_target(target, num_heads=2, draft_ids=torch.arange(V))
    heads.save(tmp_path / "best", {"proposer": "hybrid", "serve": {"max_nodes": 6}})
    assert load_proposer(str(tmp_path / "best"), target).max_nodes == 6
    assert load_proposer(f"hybrid-nostore:{tmp_path / 'best'}", target).max_nodes == 6
    heads.save(tmp_path / "plain", {"proposer": "hybrid"})
    assert load_proposer(str(tmp_path / "plain"), target).max_nodes == HybridProposer(NoDraft()).max_nodes
    heads.save(tmp_path / "bad", {"proposer": "hybrid", "serve": {"max_nodez": 6}})
    with pytest.raises(ValueError, match="serve.max_nodez"):
        load_proposer(str(tmp_path / "bad"), target)
