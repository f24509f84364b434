"""DFlash (train.method=dflash): the draft's state dict and config are speculators' contract, the block the
proposer drafts from its caches equals the training forward's block at the same anchor (after begin and after
accept), the decoder stays exact (greedy) and lossless (sampling) with it, the loss's pieces match their
definitions, and the method trains through the shared loop and exports what vLLM loads as dflash."""

import json

import pytest
import torch

from eval import draft_dir
from eval.decoder import SpeculativeDecoder
from eval.heads import DFlashConfig, DFlashHead, read_head
from eval.heads.dflash import mask_token_for
from eval.proposers import DFlashProposer, HybridProposer, Sampling, load_proposer, to_target_vocab
from pipeline.config import recipe_from_dict
from pipeline.export import export_draft
from pipeline.methods import get_method
from pipeline.methods.dflash import block_logits, choose_anchors, slot_weights, training_mask
from pipeline.options import RecipeError
from pipeline.train import run_train
from pipeline.train_data import Sequences, collate

from helpers import DECODER_V as V, N_NEW, PROMPTS, decoder_llama, e2e_pvalues, greedy_rows, sampling_llama
from helpers import TRAIN_V, copy_generate, make_generate, tiny_llama, train_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 5


@pytest.fixture(scope="module")
def target():
    return decoder_llama(0, layers=4)  # H 48, 4 heads, 2 kv heads; aux layers (0, 2, 3)


def random_head(target, seed=0, draft_ids=None, causal=True, layers=2, block=BLOCK):
    """A fresh draft with every weight drawn (fresh, fc passes the high layer through and the norms are ones)."""
    torch.manual_seed(seed)
    head = DFlashHead.from_target(target, layers, block, 1, draft_ids=draft_ids)
    head.config.causal = causal
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc", "layers", "hidden_norm")):
                p.copy_(p + torch.randn_like(p) * (0.3 if "norm" in name else 0.1))
    return head.eval()


def aux_of(target, ids, layers=(0, 2, 3)):
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layers], -1)


# ---------------------------------------------------------------- the contract


def test_state_dict_and_config_are_speculators_names(tmp_path, target):
    head = random_head(target, draft_ids=torch.arange(0, V, 3))
    keys = set(head.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "embed_tokens.weight"} <= keys
    for i in range(2):
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                  "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                  "post_attention_layernorm"):
            assert f"layers.{i}.{n}.weight" in keys
    assert head.fc.weight.shape == (48, 3 * 48) and head.lm_head.weight.shape == (32, 48)
    assert torch.equal(head.draft_ids, torch.arange(0, V, 3)) and int(head.t2d.sum()) == 32
    head.save(tmp_path / "d")
    meta, state = read_head(tmp_path / "d", "dflash", "a DFlash draft")
    assert meta["head_config"]["block_size"] == BLOCK and meta["head_config"]["aux_layers"] == [0, 2, 3]
    loaded = DFlashHead.load(tmp_path / "d")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items())
    with pytest.raises(ValueError, match="outside the target's 4 layers"):
        DFlashConfig.from_target(target.config, 1, 4, 1, [0, 4])
    with pytest.raises(ValueError, match="anchor and at least one mask"):
        DFlashConfig.from_target(target.config, 1, 1, 1)


def test_mask_token_is_chosen_as_speculators_chooses_it():
    class Tok:
        mask_token_id = pad_token_id = eos_token_id = unk_token_id = None

        def __init__(self, n, **ids):
            self.n = n
            for k, v in ids.items():
                setattr(self, k, v)

        def __len__(self):
            return self.n

    assert mask_token_for(Tok(100, mask_token_id=7, pad_token_id=3), 100) == 7
    assert mask_token_for(Tok(98, pad_token_id=3), 100) == 98  # a spare embedding row
    assert mask_token_for(Tok(100, pad_token_id=3, eos_token_id=2), 100) == 3
    assert mask_token_for(Tok(100, eos_token_id=[2, 5]), 100) == 2
    with pytest.raises(ValueError, match="train.dflash.mask_token_id"):
        mask_token_for(Tok(100), 100)


# ---------------------------------------------------------------- the loss's pieces


def test_slot_weights_are_speculators_fixed_decay():
    w = slot_weights(5, 4.0)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 0.7788008, 0.6065307, 0.4723665]))


def test_training_mask_sees_the_context_before_the_anchor_and_its_own_block():
    m = training_mask(torch.tensor([[2, -1]]), L=4, block=3, causal=True)[0, 0]  # [6, 4 + 6]
    ctx, blk = m[:, :4].int().tolist(), m[:, 4:].int().tolist()
    assert ctx[:3] == [[1, 1, 0, 0]] * 3 and ctx[3:] == [[0, 0, 0, 0]] * 3  # an unused anchor sees no context
    assert blk[:3] == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert blk[3:] == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    full = training_mask(torch.tensor([[2]]), L=4, block=3, causal=False)[0, 0, :, 4:]
    assert full.all()


def test_anchors_are_distinct_candidates_and_fill_with_minus_one():
    cand = torch.zeros(3, 20, dtype=torch.bool)
    cand[0, 5:15] = True
    cand[1, [3, 9]] = True
    a = choose_anchors(cand, 4, seed=1)
    assert a.shape == (3, 4)
    assert all(cand[0, i] for i in a[0]) and len(set(a[0].tolist())) == 4 and a[0].tolist() == sorted(a[0].tolist())
    assert a[1].tolist() == [-1, -1, 3, 9] and a[2].tolist() == [-1] * 4
    assert torch.equal(a, choose_anchors(cand, 4, seed=1))  # seeded: a resumed run draws the same
    picks = {tuple(choose_anchors(cand, 4, seed=s)[0].tolist()) for s in range(20)}
    assert len(picks) > 10  # and the draw varies with the seed


# ---------------------------------------------------------------- the proposer against the training forward


@pytest.mark.parametrize("causal", [True, False])
def test_proposer_blocks_equal_the_training_forward(target, causal):
    """Sampled at T=1 the proposer's q for each slot is the training forward's softmax at the same anchor:
    after begin (prompt = tokens before the anchor) and after an accept of verified tokens."""
    head = random_head(target, causal=causal, draft_ids=torch.arange(0, V, 2))
    ids = torch.tensor([PROMPTS[2] + [5, 9, 3, 17, 23, 40, 2, 8]])  # [1, 19]
    aux = aux_of(target, ids)
    anchors = torch.tensor([[6, 9]])
    with torch.no_grad():
        ref = block_logits(head, ids, aux, anchors)  # [1, 2, BLOCK, Vd]
    ref_q = Sampling(1.0).probs(to_target_vocab(ref[0, :, 1:], head.draft_ids, V))  # [2, BLOCK-1, V]
    prop = DFlashProposer(head, target)
    a0 = 6
    with torch.no_grad():
        prop.begin([ids[0, :a0].tolist()], ids[0, a0:a0 + 1], 32, Sampling(1.0), aux[:, :a0])
        _, q = prop.propose(BLOCK - 1)
        torch.testing.assert_close(q[0], ref_q[0], atol=1e-5, rtol=1e-4)
        # the target verified [tok 6, 4 drafts] at 6..10 and kept 2 of them: the bonus is tok 9, at 9
        T = BLOCK
        prop.accept(ids[:, a0:a0 + T], torch.tensor([a0]), torch.tensor([2]), ids[:, 9], aux[:, a0:a0 + T])
        _, q = prop.propose(BLOCK - 1)
        torch.testing.assert_close(q[0], ref_q[1], atol=1e-5, rtol=1e-4)
        _, q2 = prop.propose(2)  # fewer slots: causal blocks keep their first ones
    if causal:
        torch.testing.assert_close(q2[0], ref_q[1, :2], atol=1e-5, rtol=1e-4)
    assert prop.block_k == BLOCK - 1 and prop.propose(9)[1].shape[1] == BLOCK - 1


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_speculative_equals_plain(target, k):
    plain = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences
    for ids in (None, torch.arange(0, V, 2)):
        prop = DFlashProposer(random_head(target, draft_ids=ids), target)
        res = SpeculativeDecoder(target, prop, k=k).generate(PROMPTS, max_new_tokens=N_NEW)
        assert res.sequences == plain and res.stats["proposed"] > 0


def test_hybrid_stays_exact(target):
    plain = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences
    hyb = HybridProposer(DFlashProposer(random_head(target), target), min_match=1, k_ngram=6)
    assert hyb.feature_layers == (0, 2, 3)
    res = SpeculativeDecoder(target, hyb, k=3).generate(PROMPTS, max_new_tokens=N_NEW)
    assert res.sequences == plain and res.stats["tree_rounds"] > 0


def test_speculative_sampling_is_lossless():
    t = sampling_llama(0)  # 2 layers: aux layers (0, 1, 1)
    torch.manual_seed(1)
    head = DFlashHead.from_target(t, 1, 4, 1)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.2)
    pv, stats = e2e_pvalues(t, DFlashProposer(head, t), dict(temperature=1.0))
    assert stats["proposed"] > 0 and 0 < stats["alpha"] < 1
    assert min(pv) > 1e-4, pv


# ---------------------------------------------------------------- training and export


@pytest.fixture(scope="module")
def train_target():
    return tiny_llama(num_layers=4)  # H 32, aux layers (0, 2, 3)


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, train_target):
    d = tmp_path_factory.mktemp("run")
    make_generate(d, train_target, n_rows=16)
    return d


def test_training_lowers_the_loss_serves_exactly_and_exports(tmp_path, gen_dir, train_target):
    recipe = train_recipe(method="dflash", steps=30, save_every=30, lr=1e-2, warmup_steps=2, draft_vocab_size=64,
                          dflash={"block_size": 4, "max_anchors": 8, "mask_token_id": 1})
    run = copy_generate(gen_dir, tmp_path / "run")
    train_dir = run_train(recipe, run, target=train_target)
    ckpt = train_dir / "checkpoint-000030"
    meta = draft_dir.read_meta(ckpt)
    assert meta["kind"] == "dflash" and meta["step"] == 30 and meta["train_key"] == recipe.train_key()
    hc = meta["head_config"]
    assert hc["block_size"] == 4 and hc["mask_token_id"] == 1 and hc["num_layers"] == 2
    assert hc["aux_layers"] == [0, 2, 3] and hc["draft_vocab_size"] == 64

    method, tc = get_method("dflash"), recipe.train
    rows = greedy_rows(train_target, TRAIN_V)
    batch = collate([Sequences(rows)[i] for i in range(len(rows))])
    trained = method.build(tc, train_target, None, rows, ckpt)
    fresh = method.build(tc, train_target, None, rows, None)
    with torch.no_grad():
        before, _ = method.loss(fresh, batch)
        after, metrics = method.loss(trained, batch)
    assert after < 0.8 * before, (before, after)
    assert set(metrics) == {"acc_0", "acc_1", "acc_2", "div"}
    norms = [layer.self_attn.k_norm.weight for layer in trained.head.layers]
    assert all(torch.equal(w, norms[0]) for w in norms) and not torch.equal(norms[0], torch.ones_like(norms[0]))
    lm = train_target.get_output_embeddings().weight[trained.head.draft_ids]
    assert torch.equal(trained.head.lm_head.weight, lm)  # frozen copies of the target's rows: speculators' default

    prop = load_proposer(str(ckpt), train_target)
    assert isinstance(prop, DFlashProposer)
    prompts = [r["ids"][:5] for r in rows]
    plain = SpeculativeDecoder(train_target, None).generate(prompts, max_new_tokens=N_NEW).sequences
    res = SpeculativeDecoder(train_target, prop, k=3).generate(prompts, max_new_tokens=N_NEW)
    assert res.sequences == plain and res.stats["accepted"] > 0

    from safetensors import safe_open

    out = tmp_path / "export"
    train_target.save_pretrained(tmp_path / "target")
    export_draft(str(ckpt), "speculators-dflash", out, k=3, verifier=str(tmp_path / "target"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashSpeculator"]
    assert cfg["aux_hidden_state_layer_ids"] == [0, 2, 3] and cfg["mask_token_id"] == 1 and cfg["block_size"] == 4
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["sliding_window_non_causal"] is False and cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "embed_tokens.weight" not in keys and {"d2t", "t2d", "lm_head.weight", "fc.weight"} <= keys


def test_dflash_options_are_checked():
    with pytest.raises(RecipeError, match="train.dflash.block_size"):
        recipe_from_dict({"train": {"method": "dflash", "dflash": {"block_size": 1}}})
    with pytest.raises(RecipeError, match="train.dflash.features"):
        recipe_from_dict({"train": {"method": "dflash", "dflash": {"features": "disk"}}})
    with pytest.raises(RecipeError, match="train.dflash.mask_token_id"):
        recipe_from_dict({"train": {"method": "dflash", "dflash": {"mask_token_id": -5}}})
    a = recipe_from_dict({"train": {"method": "dflash"}})
    b = recipe_from_dict({"train": {"method": "dflash", "dflash": {"block_size": 16}}})
    online = recipe_from_dict({"train": {"method": "dflash", "dflash": {"features": "online"}}})
    assert a.hash() != b.hash() and (online.hash(), online.train_key()) == (a.hash(), a.train_key())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "gpt2"])
def test_layers_start_as_copies_of_the_targets_last_layers(family):
    """init=target: draft layer i is the target's layer N - L + i (every projection, the norm gains, Qwen3's
    q_norm and k_norm; hidden_norm as the first copied layer's input norm). A family whose layers are shaped
    otherwise (Gemma 2's four norms, Phi-3's fused projections, GPT-2) is told why and left unchanged."""
    from families import tiny_family

    target = tiny_family(family, 64, layers=4)
    with torch.no_grad():  # gains of their own, so a copy is told from a fresh norm's ones
        for name, p in target.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
    head = DFlashHead.from_target(target, 2, 4, 1)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    why = head.copy_layers_from(target)
    if family not in ("llama", "qwen3"):
        assert why and all(torch.equal(v, before[k]) for k, v in head.state_dict().items()), why
        return
    assert why == ""
    src = target.model.layers[2:]
    for mine, theirs in zip(head.layers, src):
        for name, p in mine.named_parameters():
            q = dict(theirs.named_parameters()).get(name)
            if name.endswith("_proj.weight"):
                assert torch.equal(p, q.float()), name
            elif q is not None:  # a norm: its gain, probed (x / rms(x) * w, the eps aside)
                torch.testing.assert_close(p, q.float(), rtol=1e-5, atol=0)
            else:
                assert family == "llama" and name.endswith(("q_norm.weight", "k_norm.weight")), name
                assert torch.equal(p, torch.ones_like(p))
    torch.testing.assert_close(head.hidden_norm.weight, src[0].input_layernorm.weight, rtol=1e-5, atol=0)


def test_init_target_on_a_target_it_cannot_copy_is_one_line_and_auto_falls_back(capsys):
    from families import tiny_family

    target = tiny_family("gpt2", TRAIN_V, layers=4)
    rows = greedy_rows(tiny_llama(num_layers=4), TRAIN_V)
    method = get_method("dflash")
    for init in ("target", "auto", "random"):
        tc = train_recipe(method="dflash", draft_vocab_size=64, dflash={"block_size": 4, "mask_token_id": 1,
                                                                        "init": init}).train
        if init == "target":
            with pytest.raises(RecipeError, match=r"train.dflash.init=target: .*gpt2.*; use train.dflash.init=random"):
                method.build(tc, target, None, rows, None)
            continue
        method.build(tc, target, None, rows, None)
        out = capsys.readouterr().out
        assert ("the layers start random (" in out) == (init == "auto"), out
    with pytest.raises(RecipeError, match="train.dflash.init"):
        recipe_from_dict({"train": {"method": "dflash", "dflash": {"init": "copy"}}})
