"""The train stage's methods and data modes beyond the EAGLE head: LoRA drafts, raw-text
(undistilled) data, on-policy (GKD) data, int8, Medusa and self-speculative drafts, each through
`run_train` on a tiny target."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pipeline.config import TrainConfig
from pipeline.features import RAW_TEACHER_FILE, score_raw_windows
from pipeline.methods import get_method
from pipeline.methods.draft_lm import build_draft_lm
from pipeline.onpolicy import onpolicy_batch, teacher_topk
from pipeline.train import run_train
from pipeline.train_data import RawText, collate, load_rows, raw_rows

from helpers import train_recipe
from helpers import TRAIN_V as V, copy_generate as _copy_gen, make_generate as _make_generate, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(num_layers=3)  # three layers: self_spec and draft_lm can share two


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, target):
    d = tmp_path_factory.mktemp("run")
    _make_generate(d, target)
    return d


def _recipe(**train):
    return train_recipe(**{"steps": 4, **train})


def test_lora_draft_saves_adapter_and_merged_weights(tmp_path, gen_dir, target):
    from peft import PeftModel

    d = _copy_gen(gen_dir, tmp_path / "r")
    recipe = _recipe(method="draft_lm", draft_lm={"num_layers": 2, "lora_rank": 4, "lora_alpha": 8})
    train_dir = run_train(recipe, d, target=target)
    ck = train_dir / "checkpoint-000004"
    meta = json.loads((ck / "draftsmith_draft.json").read_text())
    assert meta["kind"] == "draft_lm" and meta["lora_rank"] == 4
    assert (ck / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(ck)  # what HF assistant_model loads
    peft = PeftModel.from_pretrained(build_draft_lm(target, 2), str(ck / "adapter"))
    x = torch.tensor([[3, 9, 27, 81 % V, 5]])
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, peft(x).logits, rtol=1e-4, atol=1e-4)
        base = build_draft_lm(target, 2)(x).logits
    assert (merged(x).logits - base).abs().max() > 1e-4  # the adapter was trained, not left at zero
    # only the LoRA matrices trained: the adapter holds them alone, B (zero at the start) moved, and every weight of
    # the merged model outside the adapted modules is the base draft's
    from safetensors.torch import load_file

    saved = load_file(ck / "adapter" / "adapter_model.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)
    assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
    adapted = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in saved}
    base_sd = build_draft_lm(target, 2).state_dict()
    kept = [k for k in merged.state_dict() if k.rsplit(".", 1)[0] not in adapted]
    assert kept and all(torch.equal(merged.state_dict()[k], base_sd[k]) for k in kept)
    assert any(not torch.equal(merged.state_dict()[m + ".weight"], base_sd[m + ".weight"]) for m in adapted)


@pytest.mark.parametrize("method,extra,weights", [
    ("draft_lm", {"draft_lm": {"num_layers": 1, "lora_rank": 4}}, "adapter/adapter_model.safetensors"),
    ("medusa", {"medusa": {"heads": 2}, "draft_vocab_size": 40}, "head.safetensors"),
    ("self_spec", {"self_spec": {"num_layers": 2, "adapter_rank": 4}, "draft_vocab_size": 40}, "adapter.safetensors"),
    ("draft_lm", {"draft_lm": {"num_layers": 1}, "data": "mix", "onpolicy_fraction": 0.5}, "model.safetensors"),
    ("self_spec", {"self_spec": {"num_layers": 2, "adapter_rank": 4}, "draft_vocab_size": 40, "data": "onpolicy"},
     "adapter.safetensors"),
])
def test_resume_equals_uninterrupted(tmp_path, gen_dir, target, method, extra, weights):
    from safetensors.torch import load_file

    a, b = _copy_gen(gen_dir, tmp_path / "a"), _copy_gen(gen_dir, tmp_path / "b")
    recipe = _recipe(method=method, steps=4, save_every=2, **extra)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    run_train(recipe, a, target=target)

    class Crash:
        def log(self, d, step=None):
            if step == 3:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_train(recipe, b, target=target, tracker=Crash())
    run_train(recipe, b, target=target)
    wa = load_file(str(a / "train/checkpoint-000004" / weights))
    wb = load_file(str(b / "train/checkpoint-000004" / weights))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    for k, v in target.state_dict().items():  # self_spec shares the target's weights: never changed
        assert torch.equal(v, before[k]), k
    meta = json.loads((b / "train/checkpoint-000004/draftsmith_draft.json").read_text())
    assert meta["kind"] == method and meta["data"] == recipe.train.data


def test_trained_drafts_decode_exactly(tmp_path, gen_dir, target):
    """Every trained kind loads through load_proposer and decodes exactly like plain greedy (fp32)."""
    from eval.decoder import SpeculativeDecoder
    from eval.proposers import load_proposer

    prompts = [[5, 9, 3, 7], [11, 2, 8, 8, 1, 4]]
    plain = SpeculativeDecoder(target, None).generate(prompts, max_new_tokens=10).sequences
    for method, extra in [("medusa", {"medusa": {"heads": 3}}),
                          ("self_spec", {"self_spec": {"num_layers": 1}, "draft_vocab_size": 40}),
                          ("int8", {}), ("draft_lm", {"draft_lm": {"lora_rank": 4}})]:
        d = _copy_gen(gen_dir, tmp_path / method)
        run_train(_recipe(method=method, steps=2, save_every=2, **extra), d, target=target)
        ck = sorted((d / "train").glob("checkpoint-*"))[-1]
        spec = SpeculativeDecoder(target, load_proposer(str(ck), target), k=3).generate(prompts, max_new_tokens=10)
        assert spec.sequences == plain, method


def test_teacher_topk_matches_the_targets_own_logprobs(target):
    seqs, P = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], [2, 3]
    out = teacher_topk(target, seqs, P, k=5)
    for (ti, tl), sq, p in zip(out, seqs, P):
        assert len(ti) == len(sq) - p
        with torch.no_grad():
            lp = torch.log_softmax(target(torch.tensor([sq])).logits[0].float(), -1)
        for j, pos in enumerate(range(p, len(sq))):
            v, ix = lp[pos - 1].topk(5)
            assert ti[j] == ix.tolist()
            torch.testing.assert_close(torch.tensor(tl[j]), v, rtol=1e-4, atol=1e-4)


def test_onpolicy_batch_scores_the_drafts_own_samples(target, gen_dir):
    r = _recipe()
    rows, _ = load_rows(gen_dir, r.target, r.train.seq_len)
    batch = collate([{"ids": torch.tensor(r["ids"]), "P": r["P"], "tk_ids": torch.tensor(r["tk_ids"]),
                      "tk_lp": torch.tensor(r["tk_lp"])} for r in rows[:3]])
    tc = _recipe(method="draft_lm", data="onpolicy", draft_lm={"num_layers": 1}).train
    method = get_method("draft_lm")
    draft = method.build(tc, target, None, rows, None)
    out = onpolicy_batch(batch, method, draft, target, eos=set(), seed=0)
    assert out["ids"].shape[0] == 3
    for b in range(3):
        P, n = int(out["P"][b]), int(out["valid"][b].sum())
        assert out["ids"][b, :P].tolist() == batch["ids"][b, :P].tolist()  # same prompt
        assert int(out["ids"][b, P]) == int(batch["ids"][b, P])  # the target's first token kept
        assert n == int(batch["valid"][b].sum())  # as long as the original row
        assert out["has_t"][b, P:n].all() and not out["has_t"][b, :P].any()
        # the teacher is the target's distribution on the *sampled* sequence
        (ti, tl), = teacher_topk(target, [out["ids"][b, :n].tolist()], [P], k=out["tk_ids"].shape[-1])
        assert out["tk_ids"][b, P:n].tolist() == ti
        torch.testing.assert_close(out["tk_lp"][b, P:n], torch.tensor(tl))
    # the continuation is the draft's own samples (method.sample with the step's seed), not the stored target
    # completion: after the kept first token, each row's tokens are the draft's draws
    Ps = [int(p) for p in batch["P"][:3]]
    n_new = [int(batch["valid"][b].sum()) - Ps[b] - 1 for b in range(3)]
    drawn = method.sample(draft, target, [batch["ids"][b, :Ps[b]].tolist() for b in range(3)],
                          [int(batch["ids"][b, Ps[b]]) for b in range(3)], max(n_new), 0)
    for b in range(3):
        assert out["ids"][b, Ps[b] + 1:Ps[b] + 1 + n_new[b]].tolist() == list(drawn[b][:n_new[b]])
    assert any(not torch.equal(out["ids"][b], batch["ids"][b]) for b in range(3))
    # seeded: the same step gives the same batch (resume reproduces it)
    again = onpolicy_batch(batch, method, draft, target, eos=set(), seed=0)
    assert torch.equal(again["ids"], out["ids"])


@pytest.mark.parametrize("data", ["onpolicy", "mix"])
def test_onpolicy_training_runs_and_counts_its_steps(tmp_path, gen_dir, target, data):
    """data=onpolicy samples every step; data=mix the steps s whose draw from Random(seed * 1_000_003 + s)
    falls below onpolicy_fraction (seeded by step, so a resumed run draws the same)."""
    d = _copy_gen(gen_dir, tmp_path / "r")
    recipe = _recipe(method="draft_lm", draft_lm={"num_layers": 1}, data=data, onpolicy_fraction=0.5)
    train_dir = run_train(recipe, d, target=target)
    m = json.loads((train_dir / "manifest.json").read_text())
    assert m["data"] == data
    if data == "onpolicy":
        assert m["onpolicy_steps"] == 4
    else:
        want = sum(random.Random(0 * 1_000_003 + s).random() < 0.5 for s in range(4))
        assert want == 2  # seed 0 mixes: steps 1 and 3 on-policy, 0 and 2 generated
        assert m["onpolicy_steps"] == want


def test_raw_rows_are_one_hot_domain_text_without_heldout(real_tokenizer):
    recipe = _recipe(data="raw", seq_len=64)
    text = RawText(recipe.data.source, recipe.data.heldout, recipe.train.seq_len, recipe.seed)
    rows = raw_rows(text, real_tokenizer, 20)
    assert len(rows) == 20
    for r in rows:
        assert r["P"] == 1 and len(r["ids"]) <= 64
        assert [t[0] for t in r["tk_ids"]] == r["ids"][1:]  # the text's own next token
        assert all(lp == [0.0] for lp in r["tk_lp"])  # one-hot
    text = real_tokenizer.decode(rows[0]["ids"])
    assert text.strip()
    with pytest.raises(Exception, match="tokenizer"):
        raw_rows(text, None, 2)


def test_raw_data_trains_eagle_on_raw_text(tmp_path, real_tokenizer):
    """The undistilled baseline end to end: raw windows, features from the target on them."""
    torch.manual_seed(0)
    big = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1,
                                       vocab_size=len(real_tokenizer), tie_word_embeddings=True)).eval()
    _make_generate(tmp_path, big, n_rows=4, clen=4)
    train_dir = run_train(_recipe(data="raw", seq_len=48, steps=2, draft_vocab_size=512), tmp_path, target=big,
                          tokenizer=real_tokenizer)
    m = json.loads((train_dir / "manifest.json").read_text())
    assert m["data"] == "raw" and m["n_sequences"] == 4 and m["steps"] == 2


def test_score_raw_windows_is_the_targets_teacher_forced_forward(tmp_path, target):
    """Each window's teacher is the target's own top-k at every position after the first and its features
    are the target's final-norm hidden states, exactly what a one-window forward gives; cached by key."""
    torch.manual_seed(0)
    wins = [torch.randint(0, V, (n,)).tolist() for n in (12, 7, 12, 3, 9)]  # ragged: padding must not leak
    rows, feats = score_raw_windows(target, wins, 5, tmp_path / "r.safetensors", "key1", batch_size=2)
    assert [r["ids"] for r in rows] == wins
    with torch.no_grad():
        for w, r, f in zip(wins, rows, feats):
            x = torch.tensor([w])
            h = target.model(input_ids=x).last_hidden_state[0]  # [n, H]
            lp, ix = torch.log_softmax(target(input_ids=x).logits[0, :-1].float(), -1).topk(5, -1)
            assert r["P"] == 1 and r["tk_ids"].shape == (len(w) - 1, 5)
            torch.testing.assert_close(f, h, rtol=1e-4, atol=1e-5)
            assert torch.equal(r["tk_ids"], ix)
            torch.testing.assert_close(r["tk_lp"], lp, rtol=1e-4, atol=1e-5)

    def no_tokenizing():
        raise AssertionError("a cached score must not tokenize the raw text again")

    again, _ = score_raw_windows(target, no_tokenizing, 5, tmp_path / "r.safetensors", "key1")
    assert [r["ids"] for r in again] == wins and all(torch.equal(a["tk_ids"], b["tk_ids"]) for a, b in zip(rows, again))
    with pytest.raises(AssertionError, match="tokenize"):  # another key scores again
        score_raw_windows(target, no_tokenizing, 5, tmp_path / "r.safetensors", "key2")


@pytest.mark.parametrize("method", ["medusa", "draft_lm"])
def test_raw_windows_mix_adds_scored_raw_text_but_not_to_the_datastore(tmp_path, real_tokenizer, method):
    """train.raw_windows: the generated rows plus n raw windows scored by the target; the datastore keeps
    only the target's own completions."""
    from eval.datastore import Datastore

    torch.manual_seed(0)
    big = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1,
                                       vocab_size=len(real_tokenizer), tie_word_embeddings=True)).eval()
    gen = _make_generate(tmp_path, big, n_rows=4, clen=4)
    section = {"medusa": {"heads": 2}} if method == "medusa" else {}
    recipe = _recipe(method=method, raw_windows=6, seq_len=48, steps=2, draft_vocab_size=512, datastore=True, **section)
    train_dir = run_train(recipe, tmp_path, target=big, tokenizer=real_tokenizer)
    m = json.loads((train_dir / "manifest.json").read_text())
    assert m["n_sequences"] == 4 + 6 and m["steps"] == 2
    assert (train_dir / RAW_TEACHER_FILE).exists()
    store = Datastore.load(train_dir / "checkpoint-000002")
    assert store.n_tokens == sum(len(r["completion_ids"]) for r in gen)  # the completions, no raw text


def test_raw_windows_is_not_for_the_raw_baseline():
    from pipeline.config import RecipeError

    with pytest.raises(RecipeError, match="raw_windows"):
        TrainConfig(data="raw", raw_windows=4)
    with pytest.raises(RecipeError, match="raw_windows"):
        TrainConfig(raw_windows=-1)


def test_int8_needs_no_training(tmp_path, target):
    train_dir = run_train(_recipe(method="int8"), tmp_path, target=target)
    m = json.loads((train_dir / "manifest.json").read_text())
    assert m["checkpoints"] == ["checkpoint-000000"] and m["method"] == "int8"
    meta = json.loads((train_dir / "checkpoint-000000" / "draftsmith_draft.json").read_text())
    assert meta["kind"] == "int8"
    assert run_train(_recipe(method="int8"), tmp_path, target=target) == train_dir  # idempotent


def test_onpolicy_needs_a_token_level_draft():
    from pipeline.config import RecipeError

    with pytest.raises(RecipeError, match="token-level draft"):
        TrainConfig(method="eagle", data="onpolicy")
    with pytest.raises(RecipeError, match="train.data"):
        TrainConfig(data="web")


def test_a_warm_start_from_a_draft_of_another_shape_is_named(tmp_path, gen_dir, target):
    """init_from a draft whose weights do not fit the recipe's (Medusa heads over another draft vocabulary) is a
    WarmStartError naming the draft, which retrain turns into training from scratch; a draft that fits warm-starts."""
    from pipeline.train import WarmStartError

    first = run_train(_recipe(method="medusa", medusa={"heads": 2}, draft_vocab_size=40),
                      _copy_gen(gen_dir, tmp_path / "a"), target=target) / "checkpoint-000004"
    with pytest.raises(WarmStartError, match=f"the draft {first} does not fit this recipe's medusa draft"):
        run_train(_recipe(method="medusa", medusa={"heads": 2}, draft_vocab_size=60), _copy_gen(gen_dir, tmp_path / "b"),
                  target=target, init_from=first)
    warm = run_train(_recipe(method="medusa", medusa={"heads": 2}, draft_vocab_size=40), _copy_gen(gen_dir, tmp_path / "c"),
                     target=target, init_from=first)
    assert json.loads((warm / "checkpoint-000004" / "draftsmith_draft.json").read_text())["init_from"] == str(first)
