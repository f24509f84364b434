"""Medusa heads (Cai et al., 2024): training learns the t + 2 + i alignment, the proposer keeps the
decoder exact (greedy: token for token; sampling: the target's distribution), checkpoints round-trip,
and a truncated draft vocabulary only ever proposes its own ids. Tiny fp32 models."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eval.decoder import SpeculativeDecoder
from eval.draft_dir import FILE as HEAD_FILE
from eval.heads import EagleHead
from eval.medusa import MedusaHeads, MedusaProposer
from eval.proposers import HybridProposer, NoDraft, Sampling
from pipeline.medusa_train import MedusaTrainer
from pipeline.train import _collate

V, TOPK, NH = 128, 8, 3  # vocabulary, teacher top-k, Medusa heads
PROMPTS = [[1, 5, 9, 3, 5, 9, 4], [7, 7, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4]]
N_NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    """tests/test_train.py's tiny target with a sharper LM head: at initializer_range 0.2 its next-token
    distributions are nearly flat (top-1 ~0.1), so the order of the top tokens is noise the heads
    cannot learn; scaled x3 (untied) the top-1 has ~0.5 of the mass, like a real model's."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=256, initializer_range=0.2,
                      tie_word_embeddings=False)
    t = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        t.lm_head.weight.mul_(3.0)
    return t


@torch.no_grad()
def _rows(target, n_rows=16, clen=24, seed=0):
    """The target's own greedy continuations of random prompts (3..8 tokens; `clen` tokens or up to
    the config's EOS, id 2, which HF generate stops at), with its top-k teacher
    at every completion token and its features (final-norm hidden states) at every position, in the
    item format of pipeline.train._Seqs (+ "feat")."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n_rows):
        P = int(torch.randint(3, 9, (1,), generator=g))
        prompt = torch.randint(0, V, (1, P), generator=g)
        ids = target.generate(prompt, max_new_tokens=clen, do_sample=False, pad_token_id=0)  # [1, n]
        feat = target.model(ids).last_hidden_state[0]  # [n, H]
        lp = torch.log_softmax(target.lm_head(feat).float(), -1)  # row p: distribution of token p + 1
        v, ix = lp[P - 1:-1].topk(TOPK, -1)  # teacher of tokens P..n-1
        items.append({"ids": ids[0], "P": P, "tk_ids": ix, "tk_lp": v, "feat": feat})
    return items


def _tc(divergence="fkl"):
    return SimpleNamespace(divergence=divergence, jsd_beta=0.5)


def _embed(target):
    return torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().clone(), freeze=True)


def _train(target, recurrent: bool):
    """Heads trained on the target's greedy continuations: (heads, metrics before, metrics after, items)."""
    items = _rows(target)
    batch = _collate(items)
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, NH, recurrent=recurrent)
    trainer = MedusaTrainer(heads, _tc(), _embed(target) if recurrent else None)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        loss, metrics = trainer(batch)
        first = first or metrics
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = trainer(batch)[1]
    return heads.eval(), first, last, items


@pytest.fixture(scope="module")
def trained(target):
    """Independent heads trained by _train: (heads, metrics before, metrics after, items)."""
    return _train(target, recurrent=False)


# ------------------------------------------------------------------------------------ training

def test_training_raises_accuracy(trained):
    heads, before, after, _ = trained
    print("before", before, "\nafter", after)
    assert after["acc_0"] > 0.6 and after["acc_0"] > before["acc_0"] + 0.3, (before, after)
    assert after["acc_1"] > before["acc_1"] + 0.2, (before, after)
    assert after["div"] < before["div"]


@torch.no_grad()
def test_trained_heads_predict_t_plus_2_plus_i(trained):
    """Independent of the trainer's indexing: head i on the feature at position t agrees with the
    greedy token at t + 2 + i, and far less with the token at t + 1 + i (the off-by-one)."""
    heads, _, _, items = trained
    for i in range(2):
        right = wrong = total = 0
        for it in items:
            ids, P = it["ids"], it["P"]
            n = len(ids)
            t = torch.arange(P - 1, n - 2 - i)  # features whose token t+2+i is a completion token
            pred = heads.d2t[heads.head_logits(it["feat"][t], i).argmax(-1)]
            right += int((pred == ids[t + 2 + i]).sum())
            wrong += int((pred == ids[t + 1 + i]).sum())
            total += len(t)
        assert right / total > 0.5 and right > 1.5 * wrong, (i, right, wrong, total)


@pytest.mark.parametrize("div", ["fkl", "rkl", "jsd", "tv"])
def test_trainer_divergences_bf16_and_truncated(target, div):
    """Every divergence gives a finite loss with gradients into every head, under bf16 autocast with
    bf16 features (how the train stage runs it) and a truncated draft vocabulary."""
    items = _rows(target, n_rows=3, clen=8, seed=1)
    batch = _collate([{**it, "feat": it["feat"].bfloat16()} for it in items])
    heads = MedusaHeads.from_target(target, NH, draft_ids=torch.arange(0, V, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, metrics = MedusaTrainer(heads, _tc(div))(batch)
    loss.backward()
    assert torch.isfinite(loss) and set(metrics) >= {"acc_0", "acc_1", "acc_2", "div"}
    assert all(lm.weight.grad is not None and lm.weight.grad.abs().sum() > 0 for lm in heads.lm_heads)
    assert all(b[0].linear.weight.grad is not None for b in heads.blocks)


def test_trainer_short_window_and_no_teacher(target):
    heads = MedusaHeads.from_target(target, NH)
    H = target.config.hidden_size
    # 4 tokens: only heads 0 and 1 have a token t+2+i inside the window
    tk = torch.randint(0, V, (3, TOPK))
    tk[:, 0] = torch.tensor([2, 3, 4])  # greedy: each token is its teacher's top-1
    item = {"ids": torch.tensor([1, 2, 3, 4]), "P": 1, "tk_ids": tk,
            "tk_lp": torch.full((3, TOPK), -3.0), "feat": torch.randn(4, H)}
    loss, m = MedusaTrainer(heads, _tc())(_collate([item]))
    assert torch.isfinite(loss) and "acc_1" in m and "acc_2" not in m
    # a prompt filling the window: no teacher at all -> zero loss that still backpropagates
    loss, m = MedusaTrainer(heads, _tc())(_collate([{**item, "P": 4, "tk_ids": item["tk_ids"][:0],
                                                     "tk_lp": item["tk_lp"][:0]}]))
    loss.backward()
    assert float(loss.detach()) == 0.0 and "acc_0" not in m


def test_trainer_trains_head_i_only_after_greedy_tokens(target):
    """Head i at feature t trains only where tokens t+1..t+1+i are the target's top-1 (what it meets at
    decode time): in a raw-text row whose token 4 is not the target's choice, the teacher of token 5 is
    read by no head (head 0 at t=3, head 1 at t=2 and head 2 at t=1 all pass through token 4), while
    the teacher of token 6 still trains head 0 at t=4."""
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, NH)
    H = target.config.hidden_size
    ids = torch.arange(10, 20)  # [L=10], P=1: teachers for tokens 1..9 at rows 0..8
    tk = torch.randint(0, V, (9, TOPK))
    tk[:, 0] = ids[1:]
    tk[3, 0] = 99  # token 4 is not the target's top-1
    lp = torch.log_softmax(torch.randn(9, TOPK), -1)
    item = {"ids": ids, "P": 1, "tk_ids": tk, "tk_lp": lp, "feat": torch.randn(10, H)}
    trainer = MedusaTrainer(heads, _tc())

    def loss_with(row):  # a different teacher distribution for one token (its ids unchanged)
        lp2 = lp.clone()
        lp2[row] = torch.log_softmax(torch.randn(TOPK) * 3, -1)
        return float(trainer(_collate([{**item, "tk_lp": lp2}]))[0].detach())

    base = float(trainer(_collate([item]))[0].detach())
    assert loss_with(4) == base  # token 5's teacher: no head may read it
    assert loss_with(5) != base  # token 6's teacher: head 0 at t=4


# ------------------------------------------------------------------------------------ the module

def test_shapes_and_identity_start(target):
    heads = MedusaHeads.from_target(target, NH)
    f = torch.randn(2, 5, target.config.hidden_size)
    h = heads(f)
    assert h.shape == (2, 5, NH, 32) and heads(f, 2).shape == (2, 5, 2, 32)
    lg = heads.logits(h)
    assert lg.shape == (2, 5, NH, V)
    # fresh heads: identity blocks + the target's LM head, so every head starts as the target's LM head
    torch.testing.assert_close(lg[:, :, 1], target.lm_head(f))
    torch.testing.assert_close(heads.head_logits(f, 2), lg[:, :, 2])


def test_save_load_roundtrip(tmp_path, target):
    ids = torch.tensor([0, 3, 4, 10, 50, 127])
    heads = MedusaHeads.from_target(target, NH, draft_ids=ids)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    heads.save(tmp_path / "m", extra={"step": 7, "target": "tiny"})
    back = MedusaHeads.load(tmp_path / "m")
    f = torch.randn(4, 32)
    torch.testing.assert_close(back.logits(back(f)), heads.logits(heads(f)), rtol=0, atol=0)
    assert back.d2t.tolist() == ids.tolist() and back.num_heads == NH
    meta = json.loads((tmp_path / "m" / HEAD_FILE).read_text())
    assert meta["kind"] == "medusa" and meta["step"] == 7 and meta["medusa_config"]["draft_vocab_size"] == 6
    assert MedusaHeads.load(tmp_path / "m", dtype=torch.bfloat16).lm_heads[0].weight.dtype == torch.bfloat16
    EagleHead.from_target(target).save(tmp_path / "e")
    with pytest.raises(ValueError, match="not medusa"):
        MedusaHeads.load(tmp_path / "e")
    with pytest.raises(ValueError, match="not an eagle"):
        EagleHead.load(tmp_path / "m")


# ------------------------------------------------------------------------------------ decoding

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


def test_trained_heads_are_accepted(target, trained):
    """The decoder's alignment matches the trainer's: on the prompts they were trained on, the trained
    heads' drafts are accepted at every depth (the untrained heads' are not)."""
    items = trained[3][:6]
    prompts = [it["ids"][: it["P"]].tolist() for it in items]
    want = [it["ids"][it["P"]:].tolist() for it in items]  # greedy continuations: 24 tokens or up to EOS
    stats = {}
    for name, heads in (("trained", trained[0]), ("fresh", MedusaHeads.from_target(target, NH))):
        res = SpeculativeDecoder(target, MedusaProposer(heads, target), k=NH).generate(prompts, max_new_tokens=24,
                                                                                 eos_token_id=target.config.eos_token_id)
        assert res.sequences == want
        stats[name] = res.stats
    s, s0 = stats["trained"], stats["fresh"]
    print(s["accept_per_pos"], s["tau"], s0["accept_per_pos"], s0["tau"])
    assert min(s["accept_per_pos"]) > 0.5 and s["tau"] > 2.0 and s["tau"] > s0["tau"] + 0.8


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
def test_drafts_are_the_heads_on_the_true_feature(target, trained):
    """Every round, draft i of row b is head i's argmax on the target feature at (current position - 1),
    recomputed from scratch on the final sequence: the proposer's begin/accept pick the right feature."""
    heads = trained[0]
    prop = MedusaProposer(heads, target)
    rounds, accepts = [], []
    propose, accept = prop.propose, prop.accept
    prop.propose = lambda k: rounds.append(propose(k)[0].clone()) or (rounds[-1], None)
    prop.accept = lambda tokens, start, n_acc, bonus, features=None: (
        accepts.append(n_acc.clone()), accept(tokens, start, n_acc, bonus, features))
    res = SpeculativeDecoder(target, prop, k=NH).generate(PROMPTS, max_new_tokens=N_NEW)
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

@pytest.fixture(scope="module")
def trained_rec(target):
    """Recurrent heads trained like `trained`: (heads, metrics before, metrics after, items)."""
    return _train(target, recurrent=True)


def _perturbed_rec(target, seed=0, draft_ids=None):
    """Fresh recurrent heads with random blocks (fresh ones are the identity: drafts would not depend
    on the tokens they read)."""
    torch.manual_seed(seed)
    heads = MedusaHeads.from_target(target, NH, draft_ids=draft_ids, recurrent=True)
    with torch.no_grad():
        for blk in heads.blocks:
            blk.down.weight.normal_(0, 0.3)
    return heads.eval()


def test_recurrent_identity_start_and_roundtrip(tmp_path, target):
    """Fresh recurrent heads are the target's LM head whatever tokens they read; the config survives a
    save/load; the trainer refuses recurrent heads without the embedding they read."""
    heads = MedusaHeads.from_target(target, NH, recurrent=True)
    f, e = torch.randn(5, 32), torch.randn(5, NH, 32)
    st = heads.states(f, e)  # [5, NH, H]
    assert st.shape == (5, NH, 32)
    torch.testing.assert_close(heads.logits(st)[:, 2], target.lm_head(f))
    heads = _perturbed_rec(target)
    heads.save(tmp_path / "r")
    back = MedusaHeads.load(tmp_path / "r")
    assert back.recurrent and json.loads((tmp_path / "r" / HEAD_FILE).read_text())["medusa_config"]["recurrent"]
    torch.testing.assert_close(back.logits(back.states(f, e)), heads.logits(heads.states(f, e)), rtol=0, atol=0)
    assert not torch.allclose(heads.states(f, e), heads.states(f, e + 1))  # the tokens matter
    with pytest.raises(ValueError, match="embedding"):
        MedusaTrainer(heads, _tc())


def test_recurrent_training_raises_accuracy(trained_rec, trained):
    heads, before, after, _ = trained_rec
    print("before", before, "\nafter", after, "\nplain heads", trained[2])
    assert after["acc_0"] > 0.6 and after["acc_0"] > before["acc_0"] + 0.3, (before, after)
    assert after["acc_1"] > before["acc_1"] + 0.2 and after["acc_2"] > before["acc_2"] + 0.2, (before, after)
    assert all(lm.weight.grad is not None for lm in heads.lm_heads) and heads.blocks[0].up.weight.grad is not None


@pytest.mark.parametrize("k", [1, 2, NH + 2, "auto"])
def test_recurrent_greedy_exact(target, trained_rec, ref, k):
    props = {"trained": MedusaProposer(trained_rec[0], target),
             "trunc": MedusaProposer(_perturbed_rec(target, 1, torch.arange(0, V, 2)), target),
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
    prop = MedusaProposer(heads, target)
    rounds, accepts = [], []
    propose, accept = prop.propose, prop.accept
    prop.propose = lambda k: rounds.append(propose(k)[0].clone()) or (rounds[-1], None)
    prop.accept = lambda tokens, start, n_acc, bonus, features=None: (
        accepts.append(n_acc.clone()), accept(tokens, start, n_acc, bonus, features))
    res = SpeculativeDecoder(target, prop, k=NH).generate(PROMPTS, max_new_tokens=N_NEW)
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


def test_recurrent_trained_heads_are_accepted(target, trained_rec, trained):
    """On the prompts they were trained on, the trained recurrent heads' drafts are accepted at every
    depth, more than fresh heads' and at least as much as the plain heads trained alike."""
    items = trained_rec[3][:6]
    prompts = [it["ids"][: it["P"]].tolist() for it in items]
    want = [it["ids"][it["P"]:].tolist() for it in items]
    stats = {}
    for name, heads in (("rec", trained_rec[0]), ("plain", trained[0]),
                        ("fresh", MedusaHeads.from_target(target, NH, recurrent=True))):
        res = SpeculativeDecoder(target, MedusaProposer(heads, target), k=NH).generate(
            prompts, max_new_tokens=24, eos_token_id=target.config.eos_token_id)
        assert res.sequences == want
        stats[name] = res.stats
    print({k: (s["tau"], s["accept_per_pos"]) for k, s in stats.items()})
    s = stats["rec"]
    assert min(s["accept_per_pos"]) > 0.5 and s["tau"] > stats["fresh"]["tau"] + 0.8
    assert s["tau"] >= stats["plain"]["tau"]


@torch.no_grad()
def test_recurrent_alternatives_follow_head0_runner_up(target):
    """The first runner-up path is head 0's 2nd choice followed by head 1's best GIVEN that token (not
    head 1's best after head 0's 1st, as for independent heads)."""
    heads = _perturbed_rec(target, 2)
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


@torch.no_grad()
@pytest.mark.parametrize("int8", [False, True])
def test_proposer_packed_matmuls_match_the_heads_in_bf16(target, int8):
    """The proposer runs the heads through packed copies (on CPU bf16, the project's small-row kernel):
    they must compute what MedusaHeads computes, up to bf16 summation order; with int8=True (the
    default) through weight-only int8 copies, up to their rounding (a step of max |w_row| / 127)."""
    t16 = LlamaForCausalLM(target.config).eval()
    t16.load_state_dict(target.state_dict())
    t16 = t16.to(torch.bfloat16)
    heads = _perturbed_rec(target, seed=3)
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
    from eval.proposers import load_proposer

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
