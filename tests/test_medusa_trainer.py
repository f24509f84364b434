"""The Medusa trainer (pipeline/methods/medusa.py) on a tiny target: heads trained on its own greedy
continuations predict token t + 2 + i, every divergence trains every head, and the decoder's alignment
matches the trainer's (the trained heads' drafts are accepted)."""

import pytest
import torch

from eval.decoder import SpeculativeDecoder
from eval.heads import MedusaHeads
from eval.proposers import MedusaProposer
from helpers import (MEDUSA_NH as NH, TOPK, TRAIN_V as V, fit_steps, medusa_rows, medusa_target,
                     medusa_tc, perturbed_recurrent_heads)
from pipeline.methods.medusa import MedusaTrainer
from pipeline.train_data import collate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return medusa_target()


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
    items = medusa_rows(target, n_rows=3, clen=8, seed=1)
    batch = collate([{**it, "feat": it["feat"].bfloat16()} for it in items])
    heads = MedusaHeads.from_target(target, NH, draft_ids=torch.arange(0, V, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, metrics = MedusaTrainer(heads, medusa_tc(div))(batch)
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
    loss, m = MedusaTrainer(heads, medusa_tc())(collate([item]))
    assert torch.isfinite(loss) and "acc_1" in m and "acc_2" not in m
    # a prompt filling the window: no teacher at all -> zero loss that still backpropagates
    loss, m = MedusaTrainer(heads, medusa_tc())(collate([{**item, "P": 4, "tk_ids": item["tk_ids"][:0],
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
    trainer = MedusaTrainer(heads, medusa_tc())

    def loss_with(row):  # a different teacher distribution for one token (its ids unchanged)
        lp2 = lp.clone()
        lp2[row] = torch.log_softmax(torch.randn(TOPK) * 3, -1)
        return float(trainer(collate([{**item, "tk_lp": lp2}]))[0].detach())

    base = float(trainer(collate([item]))[0].detach())
    assert loss_with(4) == base  # token 5's teacher: no head may read it
    assert loss_with(5) != base  # token 6's teacher: head 0 at t=4


def test_trainer_refuses_recurrent_heads_without_their_embedding(target):
    with pytest.raises(ValueError, match="embedding"):
        MedusaTrainer(perturbed_recurrent_heads(target), medusa_tc())


def test_recurrent_training_raises_accuracy(trained_rec, trained):
    heads, before, after, _ = trained_rec
    print("before", before, "\nafter", after, "\nplain heads", trained[2])
    assert after["acc_0"] > 0.6 and after["acc_0"] > before["acc_0"] + 0.3, (before, after)
    assert after["acc_1"] > before["acc_1"] + 0.2 and after["acc_2"] > before["acc_2"] + 0.2, (before, after)
    assert all(lm.weight.grad is not None for lm in heads.lm_heads) and heads.blocks[0].up.weight.grad is not None


# ------------------------------------------------------------------------------------ trained heads decode

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


def test_heads_sharing_the_targets_lm_head_train_their_blocks_only(target):
    """train.medusa.shared_lm_head (the form vLLM serves over a truncated vocabulary): the method builds
    independent heads reading out through one LM head, the target's rows of the draft vocabulary, frozen;
    training moves the residual blocks alone and still teaches head 0 the token at t + 2."""
    from types import SimpleNamespace

    from pipeline.methods import get_method
    from pipeline.methods.medusa import MedusaOptions
    from pipeline.options import RecipeError

    items = medusa_rows(target)
    opts = MedusaOptions(heads=NH, recurrent=False, shared_lm_head=True, layers=2)
    tc = SimpleNamespace(**vars(medusa_tc()), medusa=opts, draft_vocab_size=V // 2)
    method = get_method("medusa")
    torch.manual_seed(0)
    trainer = method.build(tc, target, None, [{"ids": it["ids"].tolist()} for it in items], None)
    heads, params = trainer.heads, method.trainable_parameters(trainer)
    lm = heads.lm_heads[0].weight
    assert all(h.weight is lm for h in heads.lm_heads) and not lm.requires_grad and all(p is not lm for p in params)
    assert len(heads.d2t) == V // 2 and torch.equal(lm, target.get_output_embeddings().weight[heads.d2t].float())
    before_lm = lm.clone()
    first, metrics = fit_steps(trainer, params, collate(items), 120)
    assert torch.equal(lm, before_lm) and metrics["acc_0"] > first["acc_0"] + 0.2, (first, metrics)
    with pytest.raises(RecipeError, match="train.medusa.shared_lm_head=true is for independent heads"):
        MedusaOptions(recurrent=True, shared_lm_head=True)
