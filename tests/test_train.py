import json

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from eval.heads import EagleHead
from pipeline.features import cache_features
from pipeline.methods.base import draft_vocab
from pipeline.shards import record_shard, save_shard
from pipeline.train import TrainError, read_log, run_train
from pipeline.train_data import Sequences, collate

from helpers import train_recipe as _recipe
from helpers import TOPK as K, TRAIN_V as V, copy_generate as _copy_gen
from helpers import make_generate as _make_generate, tiny_llama
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, target):
    d = tmp_path_factory.mktemp("run")
    _make_generate(d, target)
    return d


def test_eagle_alignment_learns_next_next_token(tmp_path, target):
    """Head index t reads feat[t] ⊕ emb(tok[t+1]) at pos t+1 and must predict tok[t+2]: training makes
    its argmax agree with the target's next-next token far above chance (1/128)."""
    rows = _make_generate(tmp_path, target, n_rows=16, clen=24, seed=1)
    recipe = _recipe(steps=120, save_every=1000, lr=1e-2, warmup_steps=5,
                     eagle={"unroll": 1, "feature_loss_weight": 0.1})
    seqs = [{"ids": (r["prompt_ids"] + r["completion_ids"]), "P": 6, "tk_ids": r["topk_ids"],
             "tk_lp": r["topk_logprobs"]} for r in rows]

    def agreement(head):
        feats = cache_features(target, seqs, tmp_path / "f.safetensors", "k")
        batch = collate([Sequences(seqs, feats)[i] for i in range(len(seqs))])
        with torch.no_grad():
            ids, feat = batch["ids"], batch["feat"].float()
            L = ids.shape[1]
            h = head(feat[:, :L - 2], target.get_input_embeddings()(ids[:, 1:L - 1]), torch.arange(1, L - 1)[None])
            pred = head.d2t[head.logits(h).argmax(-1)]
        m = batch["has_t"][:, 2:]
        return ((pred == ids[:, 2:]) & m).sum().item() / m.sum().item()

    torch.manual_seed(0)
    before = agreement(EagleHead.from_target(target, 1).float())
    train_dir = run_train(recipe, tmp_path, target=target)
    head = EagleHead.load(train_dir / "checkpoint-000120")
    after = agreement(head)
    print(f"next-next agreement before {before:.2f} after {after:.2f}")
    assert after > 0.6 and after > before + 0.2, (before, after)


def test_changed_training_recipe_does_not_resume_foreign_checkpoints(tmp_path, gen_dir, target):
    """A run dir whose checkpoints come from another training recipe (here: interrupted at step 4 with
    another lr, or finished with fewer steps) trains from step 0 and equals a fresh run; the old
    checkpoints are moved to train/stale-<key>/, not deleted. A change outside training (evaluate)
    resumes: the finished checkpoint is not trained again."""
    fresh, d = _copy_gen(gen_dir, tmp_path / "fresh"), _copy_gen(gen_dir, tmp_path / "d")
    recipe = _recipe(steps=6, save_every=2, method="medusa", medusa={"heads": 2}, datastore=False)
    run_train(recipe, fresh, target=target)
    old = _recipe(steps=4, save_every=2, method="medusa", medusa={"heads": 2}, datastore=False, lr=1e-2)
    run_train(old, d, target=target)
    old_key = json.loads((d / "train/checkpoint-000004/draftsmith_draft.json").read_text())["train_key"]
    run_train(recipe, d, target=target)
    stale = d / "train" / f"stale-{old_key}"
    assert sorted(p.name for p in stale.glob("checkpoint-*")) == ["checkpoint-000002", "checkpoint-000004"]
    assert (stale / "manifest.json").exists()
    for step in (2, 4, 6):
        wa = load_file(str(fresh / f"train/checkpoint-{step:06d}/head.safetensors"))
        wb = load_file(str(d / f"train/checkpoint-{step:06d}/head.safetensors"))
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    meta = json.loads((d / "train/checkpoint-000006/draftsmith_draft.json").read_text())
    assert meta["train_key"] == recipe.train_key() != old_key
    before = (d / "train/checkpoint-000006/head.safetensors").stat().st_mtime_ns
    other_eval = _recipe(steps=6, save_every=2, method="medusa", medusa={"heads": 2}, datastore=False)
    other_eval.evaluate.n_prompts = 3
    assert other_eval.train_key() == recipe.train_key() and other_eval.hash() != recipe.hash()
    run_train(other_eval, d, target=target)
    assert (d / "train/checkpoint-000006/head.safetensors").stat().st_mtime_ns == before
    assert len(list((d / "train").glob("stale-*"))) == 1


def test_a_foreign_runs_time_budget_plan_is_set_aside_with_its_checkpoints(tmp_path, gen_dir, target):
    """A run that planned 11 of 14 steps under train.max_minutes, then another training recipe (6 steps, another
    lr) in the same run dir: the old plan moves to train/stale-<key>/ with its checkpoints, and the new recipe
    trains its own 6 steps, equal to a fresh run (the old plan would have stretched it to 11)."""
    from pipeline.train import BUDGET_PROBE_STEPS

    kw = dict(save_every=2, method="medusa", medusa={"heads": 2}, datastore=False)
    fresh, d = _copy_gen(gen_dir, tmp_path / "fresh"), _copy_gen(gen_dir, tmp_path / "d")
    recipe = _recipe(steps=6, **kw)
    run_train(recipe, fresh, target=target)
    old = _recipe(steps=14, lr=1e-2, max_minutes=1e-6, **kw)  # spent at once: plans one step past the probe
    run_train(old, d, target=target)
    assert json.loads((d / "train/budget.json").read_text())["steps"] == BUDGET_PROBE_STEPS + 1
    run_train(recipe, d, target=target)
    stale = d / "train" / f"stale-{old.train_key()}"
    assert (stale / "budget.json").exists() and not (d / "train/budget.json").exists()
    assert json.loads((d / "train/manifest.json").read_text())["steps"] == 6
    assert not (d / "train/checkpoint-000008").exists()
    for step in (2, 4, 6):
        wa = load_file(str(fresh / f"train/checkpoint-{step:06d}/head.safetensors"))
        wb = load_file(str(d / f"train/checkpoint-{step:06d}/head.safetensors"))
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


def test_eagle_resume_equals_uninterrupted(tmp_path, gen_dir, target):
    a, b = _copy_gen(gen_dir, tmp_path / "a"), _copy_gen(gen_dir, tmp_path / "b")
    recipe = _recipe(steps=6, save_every=2, draft_vocab_size=40, eagle={"unroll": 2})
    run_train(recipe, a, target=target)

    class Crash:
        def log(self, d, step=None):
            if step == 5:
                raise KeyboardInterrupt

        def finish(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        run_train(recipe, b, target=target, tracker=Crash())
    assert sorted(p.name for p in (b / "train").glob("checkpoint-*")) == ["checkpoint-000002", "checkpoint-000004"]
    run_train(recipe, b, target=target)
    wa = load_file(str(a / "train/checkpoint-000006/head.safetensors"))
    wb = load_file(str(b / "train/checkpoint-000006/head.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    m = json.loads((b / "train/manifest.json").read_text())
    assert m["checkpoints"] == ["checkpoint-000002", "checkpoint-000004", "checkpoint-000006"]
    assert m["method"] == "eagle" and m["draft_vocab_size"] == 40 and m["tokens_per_s"] > 0
    meta = json.loads((b / "train/checkpoint-000006/draftsmith_draft.json").read_text())
    assert meta["kind"] == "eagle" and meta["step"] == 6 and meta["target"] == "tiny"
    head = EagleHead.load(b / "train/checkpoint-000006")
    assert head.lm_head.weight.dtype == torch.float32 and len(head.d2t) == 40
    assert not list((b / "train").glob(".checkpoint-*"))  # no temp dirs left behind
    # train/log.jsonl: one record per step; the crashed run's step 5 was dropped with its lost progress
    log_a, log_b = read_log(a / "train"), read_log(b / "train")
    assert [r["step"] for r in log_b] == [1, 2, 3, 4, 5, 6] and log_a == log_b
    assert log_b[-1]["loss"] == m["final_loss"] and log_b[-1]["lr"] == 0.0


def test_draft_vocab_is_most_frequent_sorted():
    rows = [{"ids": [5, 5, 5, 7, 7, 9, 1]}]
    assert draft_vocab(rows, 16, 3).tolist() == [1, 5, 7]  # 5 (x3), 7 (x2), then the lowest id of the ties
    assert draft_vocab(rows, 16, 0).tolist() == list(range(16))


def test_draft_lm_trains_and_loads(tmp_path, gen_dir, target):
    from transformers import AutoModelForCausalLM

    d = _copy_gen(gen_dir, tmp_path / "r")
    recipe = _recipe(method="draft_lm", steps=4, save_every=2, draft_lm={"num_layers": 1}, divergence="jsd")
    train_dir = run_train(recipe, d, target=target)
    ck = train_dir / "checkpoint-000004"
    assert json.loads((ck / "draftsmith_draft.json").read_text())["kind"] == "draft_lm"
    m = AutoModelForCausalLM.from_pretrained(ck)
    assert m.config.num_hidden_layers == 1
    out = m(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, V) and torch.isfinite(out).all()


def test_clear_errors(tmp_path, gen_dir, target):
    with pytest.raises(TrainError, match="generate"):
        run_train(_recipe(), tmp_path / "nothing", target=target)
    # shards from another target
    d = _copy_gen(gen_dir, tmp_path / "x")
    r = _recipe()
    r.target = "other"
    with pytest.raises(TrainError, match="generated by target"):
        run_train(r, d, target=target)
    # token ids beyond the target's vocabulary: another tokenizer
    big = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    with pytest.raises(TrainError, match="vocabulary"):
        run_train(_recipe(), _copy_gen(gen_dir, tmp_path / "y"), target=big)
    # empty data
    e = tmp_path / "e" / "generate"
    ent = save_shard(e, 0, Dataset.from_list([{"id": "0", "prompt_ids": [1] * 40, "completion_ids": [2],
                                               "topk_ids": [[2] * K], "topk_logprobs": [[-1.0] * K]}]))
    record_shard(e, 0, ent, header={"complete": True, "target": "tiny"})
    with pytest.raises(TrainError, match="no trainable rows"):
        run_train(_recipe(), tmp_path / "e", target=target)


def test_cosine_lr_is_transformers_schedule():
    """The loop's schedule (a total that a time budget may lower) is transformers' cosine with warm-up."""
    from transformers import get_cosine_schedule_with_warmup

    from pipeline.train import cosine_lr

    for warmup, total in ((20, 900), (0, 7), (5, 5), (20, 11)):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        ref = get_cosine_schedule_with_warmup(opt, min(warmup, total), total)
        for step in range(total + 2):
            assert cosine_lr(step, warmup, total) == pytest.approx(ref.lr_lambdas[0](step), abs=1e-12), (warmup, step)


def test_a_time_budget_plans_the_steps_that_fit_and_a_resume_keeps_them(tmp_path, gen_dir, target):
    """train.max_minutes: after BUDGET_PROBE_STEPS timed steps the run plans the last step the budget fits
    (train/budget.json, the manifest's "budget"), checkpoints there, and a rerun, even without the budget,
    finds it finished. A budget not reached changes no weight."""
    from pipeline.train import BUDGET_PROBE_STEPS

    kw = dict(steps=14, save_every=7, method="medusa", medusa={"heads": 2}, datastore=False)
    plain, roomy, tight = (_copy_gen(gen_dir, tmp_path / n) for n in ("plain", "roomy", "tight"))
    run_train(_recipe(max_minutes=0.0, **kw), plain, target=target)
    run_train(_recipe(max_minutes=600.0, **kw), roomy, target=target)
    for step in (7, 14):
        wa = load_file(str(plain / f"train/checkpoint-{step:06d}/head.safetensors"))
        wb = load_file(str(roomy / f"train/checkpoint-{step:06d}/head.safetensors"))
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    assert json.loads((roomy / "train/budget.json").read_text())["steps"] == 14

    recipe = _recipe(max_minutes=1e-6, **kw)  # spent before the first step: the plan is one step past the probe
    assert recipe.train_key() == _recipe(max_minutes=0.0, **kw).train_key()
    run_train(recipe, tight, target=target)
    last = BUDGET_PROBE_STEPS + 1
    plan = json.loads((tight / "train/budget.json").read_text())
    assert plan["steps"] == last and plan["train_steps"] == 14 and plan["planned_at"] == BUDGET_PROBE_STEPS
    m = json.loads((tight / "train/manifest.json").read_text())
    assert m["steps"] == last and m["checkpoints"] == ["checkpoint-000007", f"checkpoint-{last:06d}"]
    assert m["budget"] == plan and [r["step"] for r in read_log(tight / "train")] == list(range(1, last + 1))
    from pipeline.report import budget_section
    assert budget_section(tight)[-1].startswith(f"- train: {last} of 14 steps at ") and not budget_section(roomy)
    before = (tight / f"train/checkpoint-{last:06d}/head.safetensors").stat().st_mtime_ns
    run_train(_recipe(max_minutes=0.0, **kw), tight, target=target)  # the recorded plan stands
    assert (tight / f"train/checkpoint-{last:06d}/head.safetensors").stat().st_mtime_ns == before
    assert not (tight / "train/checkpoint-000014").exists()
