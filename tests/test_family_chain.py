"""Every stage on a target of each architecture family (tests/families.py), through the pipeline's own
entry points (the CLI's stage functions, on one loaded target per family): generate once per family, then for EACH method that applies train (2 steps) -> evaluate
(trees and the tree-budget fit, fp32 so greedy exactness is exact), and bench the trained heads; each
method that cannot apply is refused in one line naming the architecture and the methods that can."""

import json
import shutil

import pytest
import torch
from eval import bench
from eval.drafts import DraftError, runs_layer_by_layer
from pipeline.cli import main, stage_generate, stage_train
from pipeline.compare import applicable
from pipeline.config import load_recipe
from pipeline.evaluate import run_evaluate
from pipeline.methods import METHODS, check_applies, methods_for
from pipeline.models import load_target

from families import FAMILIES, save_family, tiny_family

LAYER_BY_LAYER = ("self_spec", "int8")  # run the target's own layers: only families the lean forward runs
EVERY_FAMILY = ("medusa", "eagle", "eagle3", "draft_lm")
BUDGET = ["data.max_prompts=12", "data.max_prompt_tokens=48", "generate.max_new_tokens=8", "generate.batch_size=4",
          "generate.batches_per_shard=2", "train.steps=2", "train.save_every=2", "train.batch_size=4",
          "train.seq_len=64", "train.draft_vocab_size=256", "evaluate.n_prompts=1", "evaluate.max_new_tokens=8",
          "evaluate.fp32_prompts=1", "evaluate.fit_prompts=1", "evaluate.tree_budgets=[4,6]",
          "evaluate.baselines=false"]


def _overrides(target, runs, *extra):
    return [f"target={target}", "dtype=float32", "device=cpu", f"runs_dir={runs}", "wandb.mode=disabled", *BUDGET,
            *extra]


def _recipe(target, runs, *extra):
    return load_recipe("recipes/code.yaml", _overrides(target, runs, *extra))


@pytest.fixture(scope="module")
def prompt_sets(tmp_path_factory):
    """Where the first family's generate stage wrote the prompt sets: every family shares the tokenizer, so
    the later ones start from a copy (building them parses the stdlib's sources, seconds a family)."""
    return tmp_path_factory.mktemp("prompts") / "prompts"


@pytest.fixture(scope="module", params=FAMILIES)
def generated(request, tmp_path_factory, real_tokenizer, one_thread, prompt_sets):
    """(family, target directory, runs directory, the tiny model): one tiny target of the family over the
    real tokenizer, and its generate stage (run "gen") that every method's run copies."""
    fam = request.param
    root = tmp_path_factory.mktemp(fam)
    target = save_family(root / "target", fam, real_tokenizer)
    runs = root / "runs"
    gen = runs / "code" / "gen"
    if prompt_sets.exists():
        shutil.copytree(prompt_sets, gen / "prompts")
    model, tok = load_target(str(target), "float32", "cpu")
    stage_generate(_recipe(target, runs), gen, model, tok)
    if not prompt_sets.exists():
        shutil.copytree(gen / "prompts", prompt_sets)
    return fam, target, runs, model, tok


def _run_for(runs, method):
    """A run directory of its own for `method`, holding the family's generate stage and prompt sets."""
    src, dst = runs / "code" / "gen", runs / "code" / method
    shutil.copytree(src / "generate", dst / "generate")
    shutil.copytree(src / "prompts", dst / "prompts")
    return dst


def test_every_applicable_method_trains_evaluates_and_benches(generated, tmp_path):
    fam, target, runs, model, tok = generated
    manifest = json.loads((runs / "code" / "gen" / "generate" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["engine"] == "draftsmith-decoder", manifest["engine"]
    methods = methods_for(model)
    assert set(EVERY_FAMILY) <= set(methods)
    assert set(LAYER_BY_LAYER) <= set(methods) or not set(LAYER_BY_LAYER) & set(methods)
    for m in methods:
        run, recipe = _run_for(runs, m), _recipe(target, runs, f"train.method={m}")
        stage_train(recipe, run, model, tok)
        metrics = run_evaluate(recipe, run, model, tok)  # the evaluate stage less its report's plots
        assert metrics["draft_method"].split("+")[0] == m and metrics["exactness_rule"] == "exact", (fam, m)
        assert metrics["greedy_exact"] is True and metrics["fp32_exact"] is True, (fam, m)
        fit = json.loads(next((run / "eval").glob("*.tree-budget.json")).read_text())
        assert fit["fits"] and all(f["max_nodes"] in (4, 6) for f in fit["fits"].values()), (fam, m)
        assert (run / "best" / "draftsmith_draft.json").exists(), (fam, m)
    out = tmp_path / "bench.json"
    heads = runs / "code" / "medusa" / "best"
    rc = bench.main(["--target", str(target), "--draft", str(heads), "--also", f"{runs / 'code' / 'eagle' / 'best'}@2",
                     "--prompts", str(runs / "code" / "gen" / "prompts" / "heldout.jsonl"), "--n-prompts", "1",
                     "--max-new-tokens", "8", "--k", "2", "--dtype", "float32", "--device", "cpu", "--json", str(out)])
    assert rc == 0, f"{fam}: bench failed"
    res = json.loads(out.read_text())
    assert res["greedy_exact"] is True and res["speculative"]["tokens_per_s"] > 0, fam


@pytest.mark.parametrize("method", LAYER_BY_LAYER)
def test_layer_by_layer_methods_apply_or_are_refused_in_one_line(generated, method, capsys):
    """self_spec and int8 reuse the target's layers in the lean forward: on a family it runs they apply
    (the chain test trains them); on any other the train stage refuses them in one line naming the
    architecture and the methods that can, before writing a checkpoint."""
    fam, target, runs, model, _ = generated
    if runs_layer_by_layer(model):
        check_applies(method, model)  # no refusal
        assert applicable(["eagle", method], model, chosen=True) == ["eagle", method]
        return
    assert applicable(["eagle", method], model, chosen=False) == ["eagle"]  # compare's default list leaves it out
    with pytest.raises(DraftError, match=f"compare variant {method} "):  # and refuses it when named
        applicable(["eagle", method], model, chosen=True)
    run = _run_for(runs, f"refuse-{method}")
    capsys.readouterr()
    assert main(["train", "--recipe", "recipes/code.yaml", *_overrides(target, runs, f"train.method={method}"),
                 "--run-id", run.name]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("draftsmith: error")]
    arch = f"{model.config.model_type} ({type(model).__name__})"
    others = [n for n, m in METHODS.items() if not m.layer_by_layer]
    assert len(err) == 1 and f"train.method={method}" in err[0] and arch in err[0], err
    assert all(n in err[0].split(": use ")[1] for n in others), err
    assert not list((run / "train").glob("checkpoint-*"))


@pytest.mark.parametrize("fam", FAMILIES)
def test_draft_lm_copies_any_family_and_heads_read_its_norm(fam):
    """draft_lm's "the target's first layers" on every family: all of them give the target's own logits,
    fewer give a model of the same class; the EAGLE heads' norm computes the target's final norm where
    that is an RMSNorm (Gemma's 1 + w included), and a LayerNorm target says why it cannot."""
    import torch.nn as nn

    from eval.family import final_norm, layer_list, rms_norm_gain
    from eval.heads import EagleHead
    from pipeline.methods.draft_lm import build_draft_lm

    model = tiny_family(fam, 64, layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(build_draft_lm(model, 3).eval()(ids).logits, model(ids).logits, atol=1e-5)
    two = build_draft_lm(model, 2)
    assert type(two) is type(model) and len(layer_list(two)[1]) == 2
    prefix, layers = layer_list(model)
    assert dict(model.named_modules())[prefix] is layers
    norm = final_norm(model)
    if isinstance(norm, nn.LayerNorm):
        g, why = rms_norm_gain(model)
        assert g is None and "LayerNorm" in why
        return
    with torch.no_grad():
        norm.weight.normal_()  # a trained gain, not the init's ones (or Gemma's zeros)
        head = EagleHead.from_target(model)
        x = torch.randn(4, model.config.hidden_size)
        assert torch.allclose(head.norm(x), norm(x), atol=1e-4)
