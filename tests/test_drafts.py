"""Drafts without a second trained model (eval/drafts.py): the self-speculative draft (the target's own
first layers + an adapter) and the int8 copy of the target; DraftLMProposer's truncated vocabulary."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eval.decoder import SpeculativeDecoder
from eval.drafts import Int8Draft, SelfSpecDraft, int8_draft
from eval.int8 import Int8Linear
from eval.proposers import DraftLMProposer, load_proposer
from eval.target import LeanLlama
from pipeline.methods.self_spec import SelfSpecTrainer, trainable_parameters

from helpers import greedy_topk as _greedy  # the target's greedy continuation with top-8 log-probs

V = 96
PROMPTS = [[1, 5, 9, 3, 5, 9, 4], [7, 7, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4]]
N_NEW = 16
TRUNC = torch.arange(0, V, 3)  # a truncated draft vocabulary: every third id

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0, layers=3):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.1, pad_token_id=0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target():
    return tiny()


@pytest.fixture(scope="module")
def ref(target):
    """Plain greedy decoding of every prompt (the speculative runs must reproduce it)."""
    return SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences


def perturbed(draft, seed=1):
    """A draft whose adapter is not the identity (a fresh one is: `up` starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        draft.adapter.up.weight.copy_(torch.randn(draft.adapter.up.weight.shape, generator=g) * 0.2)
    return draft


def selfspec(target, truncated, layers=1):
    return perturbed(SelfSpecDraft(target, layers, adapter_rank=8, draft_ids=TRUNC if truncated else None))


def _ptrs(module):
    return {p.data_ptr() for p in module.parameters()}


# ------------------------------------------------------------------------------ sharing and training

@pytest.mark.parametrize("truncated", [False, True])
def test_selfspec_shares_the_targets_weights(target, truncated):
    d = SelfSpecDraft(target, 2, adapter_rank=8, draft_ids=TRUNC if truncated else None)
    body = target.model
    assert d.model.embed_tokens.weight.data_ptr() == body.embed_tokens.weight.data_ptr()
    for dl, tl in zip(d.model.layers, body.layers[:2]):
        assert dl is tl
        for (n, p), q in zip(dl.named_parameters(), tl.parameters()):
            assert p.data_ptr() == q.data_ptr(), n
    assert d.model.norm.norm.weight.data_ptr() == body.norm.weight.data_ptr()
    assert len(d.model.layers) == d.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 3
    own = {p.data_ptr() for p in trainable_parameters(d)}
    if truncated:  # the draft's head: rows TRUNC of the target's, the only copied weight
        assert d.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()
        assert torch.equal(d.lm_head.weight, target.lm_head.weight[TRUNC]) and torch.equal(d.d2t, TRUNC)
        assert own == _ptrs(d.adapter) | {d.lm_head.weight.data_ptr()}
    else:
        assert d.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr() and d.d2t is None
        assert own == _ptrs(d.adapter)
    # every draft parameter is either the target's own or trainable; no layer weight was copied
    assert _ptrs(d) <= _ptrs(target) | own and not (own & _ptrs(target))
    # the decoder's runner for the draft fuses nothing (fused q|k|v would be copies)
    prop = DraftLMProposer(d, V, d2t=d.d2t, fuse=False)
    assert isinstance(prop.runner, LeanLlama) and prop.runner.fused == [None, None]
    # train()/eval() and dtype conversions leave the shared modules alone
    d.train()
    assert d.adapter.training and not body.layers[0].training
    d.eval()
    d.double()
    assert d.adapter.down.weight.dtype == torch.float64 and body.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert target.lm_head.weight.dtype == torch.float32
    d.float()


@pytest.mark.parametrize("truncated", [False, True])
def test_selfspec_decode_path_equals_training_forward(target, truncated):
    """LeanLlama over the draft (decode time) computes what the training forward computes."""
    d = selfspec(target, truncated, layers=2)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    runner = DraftLMProposer(d, V, d2t=d.d2t, fuse=False).runner
    runner.reset(2, 16)
    with torch.no_grad():
        lean, _ = runner(ids, torch.arange(12).expand(2, 12), 12)
        train = d(ids, torch.ones_like(ids))
        early = d.logits(target.model.norm(d.hidden(ids)))  # exit after layer 2 without the adapter
    assert train.shape == (2, 12, len(TRUNC) if truncated else V)
    torch.testing.assert_close(lean, train, rtol=1e-5, atol=1e-5)
    assert (train - early).abs().max() > 1e-2  # the adapter is applied


@pytest.fixture(scope="module")
def batch(target):
    from pipeline.train_data import collate

    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(8):
        prompt = torch.randint(0, V, (6,), generator=g).tolist()
        comp, tk_ids, tk_lp = _greedy(target, prompt, 20 + i)  # ragged lengths: right padding
        items.append({"ids": torch.tensor(prompt + comp), "P": 6, "tk_ids": torch.tensor(tk_ids),
                      "tk_lp": torch.tensor(tk_lp)})
    return collate(items)


@pytest.mark.parametrize("truncated", [False, True])
def test_selfspec_training_moves_only_the_adapter(target, batch, truncated):
    """A few optimizer steps on the target's own greedy continuations: the loss falls, the target's
    parameters stay bit-identical and get no gradients."""
    before = {n: p.detach().clone() for n, p in target.state_dict().items()}
    # truncated: the ids the batch uses (its completions are the teacher's top-1s), as draft_vocab picks
    draft = SelfSpecDraft(target, 1, adapter_rank=8, draft_ids=batch["ids"].unique() if truncated else None)
    draft.train()
    trainer = SelfSpecTrainer(draft, SimpleNamespace(divergence="fkl", jsd_beta=0.5, temperature=1.0))
    opt = torch.optim.AdamW(trainable_parameters(draft), lr=1e-2)
    losses = []
    for _ in range(25):
        loss, metrics = trainer(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert set(metrics) == {"div", "acc_0"} and 0 <= metrics["acc_0"] <= 1
    print(f"self_spec loss {losses[0]:.3f} -> {losses[-1]:.3f}, acc_0 {metrics['acc_0']:.2f}")
    assert losses[-1] < 0.7 * losses[0], losses
    after = target.state_dict()
    for n, p in before.items():
        assert torch.equal(p, after[n]), n
    assert all(p.grad is None for p in target.parameters())


def test_selfspec_trainer_alignment(target, batch):
    """div and acc_0 are those of logits at p against the teacher row of token p + 1 (has_t rows)."""
    from pipeline.losses import divergence

    d = selfspec(target, True)
    loss, metrics = SelfSpecTrainer(d, SimpleNamespace(divergence="jsd", jsd_beta=0.3, temperature=1.0))(batch)
    with torch.no_grad():
        lg = d(batch["ids"], batch["valid"].long())
    rows = [(b, p) for b in range(lg.shape[0]) for p in range(lg.shape[1] - 1) if batch["has_t"][b, p + 1]]
    sl = torch.stack([lg[b, p] for b, p in rows])
    ti = torch.stack([batch["tk_ids"][b, p + 1] for b, p in rows])
    tl = torch.stack([batch["tk_lp"][b, p + 1] for b, p in rows])
    want = divergence("jsd", sl, topk_ids=ti, topk_logprobs=tl, d2t=d.d2t, beta=0.3)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    acc = (d.d2t[sl.argmax(-1)] == ti[:, 0]).float().mean()
    assert abs(metrics["acc_0"] - float(acc)) < 1e-6


# ------------------------------------------------------------------------------ exact decoding

@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("truncated", [False, True])
def test_selfspec_greedy_exact(target, ref, k, truncated):
    prop = DraftLMProposer(selfspec(target, truncated), V, d2t=TRUNC if truncated else None, fuse=False)
    dec = SpeculativeDecoder(target, prop, k=k)
    for p, r in zip(PROMPTS, ref):
        assert dec.generate([p], max_new_tokens=N_NEW).sequences == [r], (k, truncated, p)
    res = dec.generate(PROMPTS, max_new_tokens=N_NEW)  # ragged batch of 3
    assert res.sequences == ref, (k, truncated)
    assert res.stats["proposed"] > 0


def test_selfspec_with_every_layer_accepts_everything(target):
    """N = all layers with a fresh (identity) adapter is the target itself: every draft is accepted."""
    d = SelfSpecDraft(target, target.config.num_hidden_layers, adapter_rank=4)
    res = SpeculativeDecoder(target, DraftLMProposer(d, V), k=3).generate(PROMPTS, max_new_tokens=N_NEW)
    assert res.stats["alpha_hat"] == 1.0


def test_selfspec_eos_per_row(target, ref):
    eos = ref[0][5]
    want = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    for truncated in (False, True):
        prop = DraftLMProposer(selfspec(target, truncated), V, d2t=TRUNC if truncated else None, fuse=False)
        res = SpeculativeDecoder(target, prop, k=3).generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=eos)
        assert res.sequences == want, truncated


@pytest.fixture(scope="module")
def int8(target):
    return int8_draft(target)


def test_int8_draft_is_a_close_int8_copy(target, int8):
    assert isinstance(int8, Int8Draft)
    lins = [m for m in int8.modules() if isinstance(m, Int8Linear)]
    assert lins and all(m.weight.dtype == torch.int8 for m in lins)
    assert int8.model.embed_tokens is target.model.embed_tokens  # a lookup: read, not copied
    att = int8.model.layers[0].self_attn
    assert att.q_proj.weight.data_ptr() == att.qkv_proj.weight.data_ptr()  # q/k/v: views of q|k|v
    runner = DraftLMProposer(int8, V).runner
    assert runner.fused[0][0].func is att.qkv_proj  # LeanLlama uses the fused int8 modules as they are
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    runner.reset(2, 20)
    with torch.no_grad():
        q, _ = runner(ids, torch.arange(20).expand(2, 20), 20)
        t = target(ids).logits
    err = (q - t).abs().max() / t.abs().max()
    agree = (q.argmax(-1) == t.argmax(-1)).float().mean()
    assert err < 0.02 and agree > 0.9, (float(err), float(agree))


@pytest.mark.parametrize("k", [1, 3])
def test_int8_greedy_exact(target, ref, int8, k):
    dec = SpeculativeDecoder(target, DraftLMProposer(int8, V), k=k)
    for p, r in zip(PROMPTS, ref):
        assert dec.generate([p], max_new_tokens=N_NEW).sequences == [r], (k, p)
    res = dec.generate(PROMPTS, max_new_tokens=N_NEW)
    assert res.sequences == ref and res.stats["alpha"] > 0.8, res.stats["alpha"]


# ------------------------------------------------------------------------------ truncated vocabulary

def test_truncated_proposals_stay_inside_d2t(target, ref):
    prop = DraftLMProposer(selfspec(target, True), V, d2t=TRUNC, fuse=False)
    seen = []
    orig = prop.propose

    def spy(k):
        d, q = orig(k)
        seen.append((d.clone(), None if q is None else q.clone()))
        return d, q

    prop.propose = spy
    allowed = set(TRUNC.tolist())
    assert SpeculativeDecoder(target, prop, k=3).generate(PROMPTS, max_new_tokens=N_NEW).sequences == ref
    res = SpeculativeDecoder(target, prop, k=3).generate(PROMPTS, max_new_tokens=N_NEW, temperature=1.0, seed=1)
    assert all(len(s) == N_NEW for s in res.sequences)
    assert any(q is None for _, q in seen) and any(q is not None for _, q in seen)
    outside = torch.ones(V, dtype=torch.bool)
    outside[TRUNC] = False
    for d, q in seen:
        assert set(d.flatten().tolist()) <= allowed
        if q is not None:  # a distribution over the target's ids, zero outside d2t
            assert q.shape[-1] == V and torch.all(q[..., outside] == 0)
            torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:2]))


def test_d2t_needs_vocab_size(target):
    with pytest.raises(ValueError, match="vocab_size"):
        DraftLMProposer(selfspec(target, True), d2t=TRUNC)


# ------------------------------------------------------------------------------ checkpoints and loading

@pytest.mark.parametrize("truncated", [False, True])
def test_selfspec_save_load_round_trip(tmp_path, target, truncated):
    d = selfspec(target, truncated, layers=2)
    d.save(tmp_path, extra={"target": "tiny", "step": 7})
    meta = json.loads((tmp_path / "draftsmith_draft.json").read_text())
    assert meta["kind"] == "self_spec" and meta["num_layers"] == 2 and meta["adapter_rank"] == 8
    assert meta["step"] == 7 and meta["draft_vocab_size"] == (len(TRUNC) if truncated else V)
    assert [p.name for p in tmp_path.iterdir()] != [] and not list(tmp_path.glob("*.bin"))
    e = SelfSpecDraft.load(tmp_path, target)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(e(ids), d(ids), rtol=0, atol=0)
    assert (e.d2t is None) == (not truncated) and e.model.layers[0] is target.model.layers[0]
    with pytest.raises(ValueError, match="own target"):
        SelfSpecDraft.load(tmp_path, LlamaForCausalLM(LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)))


def test_load_proposer_new_kinds(tmp_path, target, ref):
    d = selfspec(target, True)
    d.save(tmp_path / "ss")
    prop = load_proposer(str(tmp_path / "ss"), target)
    assert isinstance(prop, DraftLMProposer) and isinstance(prop.model, SelfSpecDraft)
    assert torch.equal(prop.d2t, TRUNC)
    assert all(f is None for f in prop.runner.fused)  # the loader declares the shared layers: no fused copies
    assert SpeculativeDecoder(target, prop, k=2).generate(PROMPTS, max_new_tokens=N_NEW).sequences == ref
    assert load_proposer(d, target).d2t is not None  # a draft module passed directly keeps its d2t
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "draftsmith_draft.json").write_text('{"kind": "int8"}')
    for spec in (tmp_path / "q", "int8"):
        prop = load_proposer(spec, target)
        assert isinstance(prop, DraftLMProposer) and isinstance(prop.model, Int8Draft), spec
        assert SpeculativeDecoder(target, prop, k=2).generate([PROMPTS[0]], max_new_tokens=N_NEW).sequences == ref[:1]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "draftsmith_draft.json").write_text('{"kind": "nope"}')
    with pytest.raises(ValueError, match="unknown draft kind"):
        load_proposer(tmp_path / "x", target)
