"""EAGLE-3 (train.method=eagle3): the head's state dict and config are the draft-directory contract
(speculators' names), the runners' aux features are HF's hidden_states[i], the head's cached steps equal
its uncached forward, the decoder stays exact (greedy) and lossless (sampling) with it, and the method
trains through the shared loop from cached or online features, saving a draft the loader serves."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eval import draft_dir
from eval.decoder import SpeculativeDecoder
from eval.heads import Eagle3Config, Eagle3Head, default_aux_layers, read_head
from eval.proposers import Eagle3Proposer, HybridProposer, load_proposer
from eval.family import aux_bytes_per_token
from eval.hf_forward import HFFallback
from eval.target import LeanLlama
from pipeline.config import Recipe, recipe_from_dict
from pipeline.features import aux_features_file, cache_features
from pipeline.methods import get_method
from pipeline.train import run_train
from pipeline.train_data import Sequences, collate

from helpers import DECODER_V as V, N_NEW, PROMPTS, decoder_llama, e2e_pvalues, first_drafts, greedy_rows
from helpers import sampling_llama
from helpers import TRAIN_V, copy_generate, make_generate, tiny_llama, train_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG_KEYS = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "draft_vocab_size",
               "target_hidden_size", "norm_before_residual", "aux_layers"}


@pytest.fixture(scope="module")
def target():
    return decoder_llama(0, layers=4)  # H 48, 4 heads, 2 kv heads, I 96


def random_head(target, seed=0, draft_ids=None):
    """A fresh head whose fc mixes all three layers (fresh, it passes the high layer through)."""
    torch.manual_seed(seed)
    head = Eagle3Head.from_target(target, draft_ids=draft_ids)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.1)
    return head.eval()


# ---------------------------------------------------------------- the contract


def test_default_aux_layers_are_vllms_and_fit_small_targets():
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layers(6) == [2, 3, 3]
    assert default_aux_layers(4) == [0, 2, 3] and default_aux_layers(2) == [0, 1, 1]
    assert default_aux_layers(1) == [0, 0, 0]
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2)
    assert Eagle3Config.from_target(cfg, [1, 2, 3]).aux_layers == [1, 2, 3]
    with pytest.raises(ValueError, match="outside the target's 4 layers"):
        Eagle3Config.from_target(cfg, [0, 2, 4])
    with pytest.raises(ValueError, match="three target layers"):
        Eagle3Config.from_target(cfg, [0, 2])


def test_state_dict_and_head_config_are_the_contract(tmp_path, target):
    ids = torch.arange(1, V, 2)  # a truncated draft vocabulary
    head = Eagle3Head.from_target(target, draft_ids=ids)
    H, Vd, I, hd = 48, len(ids), 96, 12
    want = {"embed_tokens.weight": (V, H), "fc.weight": (H, 3 * H),
            "layers.0.hidden_norm.weight": (H,), "layers.0.input_layernorm.weight": (H,),
            "layers.0.self_attn.q_proj.weight": (4 * hd, 2 * H), "layers.0.self_attn.k_proj.weight": (2 * hd, 2 * H),
            "layers.0.self_attn.v_proj.weight": (2 * hd, 2 * H), "layers.0.self_attn.o_proj.weight": (H, 4 * hd),
            "layers.0.post_attention_layernorm.weight": (H,),
            "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
            "layers.0.mlp.down_proj.weight": (H, I),
            "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,)}
    sd = head.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(Vd) + sd["d2t"], ids) and torch.equal(head.draft_ids, ids)  # offsets
    assert sd["t2d"].sum() == Vd and sd["t2d"][ids].all()
    assert torch.equal(sd["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert torch.equal(sd["lm_head.weight"], target.lm_head.weight[ids])
    assert not head.embed_tokens.weight.requires_grad
    aux = torch.randn(2, 5, 3 * H)
    assert torch.equal(head.fuse(aux), aux[..., 2 * H:])  # fresh fc passes the high layer through
    head.save(tmp_path, {"target": "tiny"})
    meta, state = read_head(tmp_path, "eagle3", "an EAGLE-3 head")
    assert meta["kind"] == "eagle3" and meta["target"] == "tiny" and set(meta["head_config"]) == CONFIG_KEYS
    c = meta["head_config"]
    assert c["aux_layers"] == [0, 2, 3] and c["norm_before_residual"] is False
    assert (c["vocab_size"], c["draft_vocab_size"], c["target_hidden_size"]) == (V, Vd, H)
    assert set(state) == set(want)
    loaded = Eagle3Head.load(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in sd.items())


# ---------------------------------------------------------------- features from the target's layers


@pytest.mark.parametrize("runner_cls", [LeanLlama, HFFallback])
def test_runner_aux_features_are_hf_hidden_states(target, runner_cls):
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(0))
    nxt = torch.tensor([[7]])
    with torch.no_grad():
        hs = target.model(torch.cat([ids, nxt], 1), output_hidden_states=True).hidden_states
        final = target.model(ids).last_hidden_state
        want = torch.cat([hs[0], hs[2], hs[3]], -1)  # [1, 13, 3H]
        r = runner_cls(target)
        pos = torch.arange(12)[None]
        r.reset(1, 32)
        logits0, f0 = r(ids, pos, 12)
        r.aux_layers = (0, 2, 3)
        r.reset(1, 32)
        logits1, f1 = r(ids, pos, 12)
        _, step = r(nxt, torch.tensor([[12]]), 13)  # a decode step with the cache
        r.aux_layers = None
        r.reset(1, 32)
        logits2, f2 = r(ids, pos, 12)
    torch.testing.assert_close(f1, want[:, :12], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step, want[:, 12:], atol=1e-5, rtol=1e-5)
    assert torch.equal(logits1, logits0) and torch.equal(logits2, logits0)  # logits never change
    assert torch.equal(f2, f0)  # aux_layers=None: the final-norm features, as before
    torch.testing.assert_close(f0, final, atol=1e-5, rtol=1e-5)


def test_fused_bf16_runner_taps_the_residual_stream():
    """The bf16 runner with the elementwise kernels updates x in place (per-layer loop for a prefill,
    ext.layer for a decode step): its aux features must be copies taken as each layer is entered."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    r = LeanLlama(model)
    if r.ew is None:
        pytest.skip("the elementwise kernels did not build here")
    ids = torch.randint(0, 320, (1, 25), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = model.model(ids, output_hidden_states=True).hidden_states
        want = torch.cat([hs[0], hs[1], hs[3]], -1).float()  # [1, 25, 3H]
        r.aux_layers = (0, 1, 3)
        r.reset(1, 32)
        _, pre = r(ids[:, :24], torch.arange(24)[None], 24)  # 24 rows: the per-layer loop
        _, step = r(ids[:, 24:], torch.tensor([[24]]), 25)  # one row: ext.layer where it builds
    assert torch.equal(pre[..., :64], hs[0][:, :24])  # layer 0's input: the embeddings themselves
    for got, w in ((pre.float(), want[:, :24]), (step.float(), want[:, 24:])):
        err = (got - w).abs().max() / w.abs().max()
        assert err < 0.03, err


# ---------------------------------------------------------------- the head and its proposer


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_head_cached_steps_equal_the_uncached_sequence(target, norm_before_residual):
    head = random_head(target)
    head.config.norm_before_residual = head.layers[0].norm_before_residual = norm_before_residual
    with torch.no_grad():
        head.layers[0].hidden_norm.weight.normal_(1, 0.3)  # the two residual rules differ only then
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 48, generator=g) * 3
    emb = head.embed_tokens(torch.randint(0, V, (2, 9), generator=g))
    pos = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        full = head(hidden, emb, pos)  # [2, 9, H]
        caches = head.new_caches(2, 16)
        steps = [head(hidden[:, :4], emb[:, :4], pos[:, :4], caches)]  # a prefill, then one token at a time
        steps += [head(hidden[:, t:t + 1], emb[:, t:t + 1], pos[:, t:t + 1], caches) for t in range(4, 9)]
        other = head.layers[0]
        other.norm_before_residual = not norm_before_residual
        flipped = head(hidden, emb, pos)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(flipped, full)  # the residual rule matters


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_speculative_equals_plain(target, k):
    plain = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences
    for ids in (None, torch.arange(0, V, 2)):
        prop = Eagle3Proposer(random_head(target, draft_ids=ids), target)
        res = SpeculativeDecoder(target, prop, k=k).generate(PROMPTS, max_new_tokens=N_NEW)
        assert res.sequences == plain and res.stats["proposed"] > 0


def test_hybrid_and_hf_fallback_stay_exact(target):
    plain = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences
    hyb = HybridProposer(Eagle3Proposer(random_head(target), target), min_match=1, k_ngram=6)
    assert hyb.feature_layers == (0, 2, 3)
    res = SpeculativeDecoder(target, hyb, k=3).generate(PROMPTS, max_new_tokens=N_NEW)
    assert res.sequences == plain and res.stats["tree_rounds"] > 0
    dec = SpeculativeDecoder(target, Eagle3Proposer(random_head(target), target), k=2, lean=False)
    assert isinstance(dec.runner, HFFallback)
    assert [dec.generate([p], max_new_tokens=N_NEW).sequences[0] for p in PROMPTS] == plain


def test_drafts_match_the_uncached_head_over_true_features(target):
    """After every accept, the head's cached state equals a from-scratch run over the TRUE fused target
    features: each round's first draft is the uncached head's argmax at that position."""
    head = random_head(target)
    seq, seen = first_drafts(target, Eagle3Proposer(head, target), PROMPTS[2], 3, N_NEW)
    with torch.no_grad():
        ids = torch.tensor([seq])
        hs = target.model(ids, output_hidden_states=True).hidden_states
        fused = head.fuse(torch.cat([hs[0], hs[2], hs[3]], -1))  # [1, S, H]
        S = len(seq)
        h = head(fused[:, :S - 1], head.embed_tokens(ids[:, 1:]), torch.arange(S - 1)[None])  # slot s: token s+1
        ref = head.draft_ids[head.logits(h).argmax(-1)][0]  # ref[s] proposes token s + 2
    assert len(seen) >= 3
    assert all(d1 == int(ref[n - 1]) for n, d1 in seen)


def test_speculative_sampling_is_lossless():
    t = sampling_llama(0)  # 2 layers: aux layers (0, 1, 1)
    torch.manual_seed(1)
    head = Eagle3Head.from_target(t)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.2)
    pv, stats = e2e_pvalues(t, Eagle3Proposer(head, t), dict(temperature=1.0))
    assert stats["proposed"] > 0 and 0 < stats["alpha"] < 1
    assert min(pv) > 1e-4, pv


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def train_target():
    return tiny_llama(num_layers=4)  # H 32, aux layers (0, 2, 3)


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, train_target):
    d = tmp_path_factory.mktemp("run")
    make_generate(d, train_target, n_rows=16)
    return d


@pytest.fixture(scope="module")
def rows(train_target):
    return greedy_rows(train_target, TRAIN_V)


def _batch(rows, feats=None):
    ds = Sequences(rows, feats)
    return collate([ds[i] for i in range(len(ds))])


def test_cache_is_reused_by_key_and_sized_as_estimated(tmp_path, train_target, rows):
    path = tmp_path / aux_features_file((0, 2, 3))
    assert path.name == "features-aux-0-2-3.safetensors"
    a = cache_features(train_target, rows, path, "k1", layers=(0, 2, 3))
    assert [tuple(f.shape) for f in a] == [(len(r["ids"]), 96) for r in rows]
    n_tokens = sum(len(r["ids"]) for r in rows)
    assert sum(f.numel() * f.element_size() for f in a) == n_tokens * aux_bytes_per_token(train_target)
    other = tiny_llama(num_layers=4)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(2)  # other weights, other features
    again = cache_features(other, rows, path, "k1", layers=(0, 2, 3))  # same key: read back, not computed
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    fresh = cache_features(other, rows, path, "k2", layers=(0, 2, 3))
    assert not all(torch.equal(x, y) for x, y in zip(a, fresh))


def test_online_features_give_the_cached_loss(tmp_path, train_target, rows):
    method = get_method("eagle3")
    tc = train_recipe(method="eagle3", draft_vocab_size=40, eagle3={"feature_loss_weight": 0.1}).train
    module = method.build(tc, train_target, None, rows, None)
    layers = method.layers(tc, train_target)
    feats = cache_features(train_target, rows, tmp_path / "f.safetensors", "k", layers=layers)
    cached, m_c = method.loss(module, _batch(rows, feats))
    online, m_o = method.loss(module, _batch(rows))  # no "feat": a target forward now
    torch.testing.assert_close(online, cached, atol=1e-5, rtol=1e-5)
    assert m_c.keys() == m_o.keys() >= {"acc_0", "acc_1", "acc_2", "div", "feat_loss"}


def test_features_auto_caches_when_it_fits(train_target, capsys):
    method = get_method("eagle3")
    auto = train_recipe(method="eagle3").train
    assert method.feature_cache(auto, train_target, 1000) == (0, 2, 3)
    assert "-> cache" in capsys.readouterr().out
    assert method.feature_cache(train_recipe(method="eagle3", eagle3={"max_cache_gb": 0.0001}).train,
                                train_target, 10**6) is None  # 0.384 GB > 0.0001 GB: online
    out = capsys.readouterr().out
    assert "384 bytes/token" in out and "-> online" in out
    assert method.feature_cache(train_recipe(method="eagle3", eagle3={"features": "online"}).train,
                                train_target, 10) is None


@pytest.mark.parametrize("features", ["cache", "online"])
def test_training_lowers_the_loss_and_serves_exactly(tmp_path, gen_dir, train_target, rows, features):
    recipe = train_recipe(method="eagle3", steps=30, save_every=30, lr=1e-2, warmup_steps=2, draft_vocab_size=64,
                          eagle3={"features": features})
    run = copy_generate(gen_dir, tmp_path / "run")
    train_dir = run_train(recipe, run, target=train_target)
    assert (train_dir / aux_features_file((0, 2, 3))).exists() == (features == "cache")
    ckpt = train_dir / "checkpoint-000030"
    meta = draft_dir.read_meta(ckpt)
    assert meta["kind"] == "eagle3" and meta["target"] == "tiny" and meta["step"] == 30
    assert meta["train_key"] == recipe.train_key() and meta["target_config"]["num_hidden_layers"] == 4
    assert meta["head_config"]["aux_layers"] == [0, 2, 3] and meta["head_config"]["draft_vocab_size"] == 64

    method, tc = get_method("eagle3"), recipe.train
    gen_rows = [{"ids": r["ids"], "P": r["P"], "tk_ids": r["tk_ids"], "tk_lp": r["tk_lp"]} for r in rows]
    trained = method.build(tc, train_target, None, gen_rows, ckpt)
    fresh = method.build(tc, train_target, None, gen_rows, None)
    torch.manual_seed(0)
    fresh.head = Eagle3Head.from_target(train_target, draft_ids=trained.head.draft_ids).float()  # same vocabulary
    with torch.no_grad():
        before, _ = method.loss(fresh, _batch(rows))
        after, _ = method.loss(trained, _batch(rows))
    assert after < 0.8 * before, (before, after)

    loaded = Eagle3Head.load(ckpt)  # the round trip: identical weights and logits
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.logits(x), trained.head.logits(x), atol=0, rtol=0)
    prop = load_proposer(str(ckpt), train_target)
    assert isinstance(prop, Eagle3Proposer)
    prompts = [r["ids"][:5] for r in rows]
    plain = SpeculativeDecoder(train_target, None).generate(prompts, max_new_tokens=N_NEW).sequences
    res = SpeculativeDecoder(train_target, prop, k=3).generate(prompts, max_new_tokens=N_NEW)
    assert res.sequences == plain and res.stats["accepted"] > 0


# ---------------------------------------------------------------- the recipe


def test_recipes_of_other_methods_keep_their_hash():
    """The eagle3 section enters the recipe hash and train_key only for method=eagle3: run directories of
    every other recipe resume (the values were computed on main before the section existed)."""
    default = Recipe()
    assert (default.hash(), default.train_key()) == ("6e56496bbbb8a0a8", "a9bc2e49f74e318f")
    eagle = recipe_from_dict({"train": {"method": "eagle"}})
    assert (eagle.hash(), eagle.train_key()) == ("a9cf9312baa64d91", "10a5b63a295e7089")
    e3 = recipe_from_dict({"train": {"method": "eagle3"}})
    e3b = recipe_from_dict({"train": {"method": "eagle3", "eagle3": {"unroll": 2}}})
    assert len({e3.hash(), e3b.hash(), default.hash(), eagle.hash()}) == 4
    online = recipe_from_dict({"train": {"method": "eagle3", "eagle3": {"features": "online", "max_cache_gb": 1}}})
    assert (online.hash(), online.train_key()) == (e3.hash(), e3.train_key())  # where features come from: resumes


def test_eagle3_options_are_checked():
    from pipeline.options import RecipeError

    with pytest.raises(RecipeError, match="train.eagle3.features"):
        recipe_from_dict({"train": {"method": "eagle3", "eagle3": {"features": "disk"}}})
    with pytest.raises(RecipeError, match="train.eagle3.aux_layers"):
        recipe_from_dict({"train": {"method": "eagle3", "eagle3": {"aux_layers": [1, 2]}}})
    with pytest.raises(RecipeError, match="is for train.method=eagle3"):
        recipe_from_dict({"train": {"method": "eagle", "eagle3": {"unroll": 2}}})
