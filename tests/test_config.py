"""Recipes: every shipped recipe validates; unknown keys and wrong types are named; overrides work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import (RECIPES_DIR, Recipe, RecipeError, TrainConfig, flat_train, help_table, known_domains,
                             load_recipe)
from pipeline.methods import METHODS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_loads(path):
    r = load_recipe(path)
    assert isinstance(r, Recipe)
    assert r.domain == path.stem


def test_code_is_a_known_domain():
    assert "code" in known_domains()


def test_overrides_are_typed():
    r = load_recipe(domain="code", overrides=["train.steps=7", "dtype=float32", "evaluate.near_tie_tol=1"])
    assert r.train.steps == 7 and r.dtype == "float32"
    assert isinstance(r.evaluate.near_tie_tol, float)
    assert load_recipe(domain="code", overrides=["evaluate.tree_budgets=[6, 8]"]).evaluate.tree_budgets == [6, 8]


@pytest.mark.parametrize("override,needle", [
    (["train.stepz=3"], "train.stepz"),
    (["bogus=1"], "bogus"),
    (["train.steps=many"], "train.steps"),
    (["train.method=magic"], "train.method"),
    (["generate.batch_size=0"], "generate.batch_size"),
    (["data.chat=3"], "data.chat"),
    (["evaluate.tree_budgets=8"], "evaluate.tree_budgets"),
    (["evaluate.tree_budgets=[4, x]"], "evaluate.tree_budgets[1]"),
    (["evaluate.tree_budgets=[]"], "evaluate.tree_budgets"),
    (["evaluate.tree_budgets=[0, 6]"], "evaluate.tree_budgets"),
    (["train.temperature=0"], "train.temperature"),
    (["train.max_minutes=-1"], "train.max_minutes"),
    (["generate.max_minutes=.nan"], "generate.max_minutes"),
    (["report.batch_turns=0"], "report.batch_turns"),
    (["train.method=draft_lm", "train.data=onpolicy", "train.temperature=0.7"], "TRL's GKDTrainer"),
])
def test_bad_keys_and_types_are_named(override, needle):
    with pytest.raises(RecipeError, match=re.escape(needle)):
        load_recipe(domain="code", overrides=override)


@pytest.mark.parametrize("run_id", ["latest", "champion", "registry", "traffic", "monitor", "a/b", ".hidden", ""])
def test_run_ids_that_would_clash_with_the_domains_own_files_are_refused(run_id):
    with pytest.raises(RecipeError, match=re.escape(f"run_id={run_id!r} must be a plain directory name")) as e:
        load_recipe(domain="code", overrides=[f"run_id={run_id}"])
    assert "pick another --run-id" in str(e.value) and "\n" not in str(e.value)
    assert load_recipe(domain="code", overrides=["run_id=my-run.2"]).run_id == "my-run.2"


def test_unknown_domain_lists_known_ones():
    with pytest.raises(RecipeError, match="known domains: .*code"):
        load_recipe(domain="nope")


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("domain: x\ntrain:\n  lr: 0.1\n  colour: red\n")
    with pytest.raises(RecipeError, match=r"train\.colour"):
        load_recipe(p)


def test_hash_ignores_run_id_but_not_values():
    a = load_recipe(domain="code")
    b = load_recipe(domain="code", overrides=["run_id=abc"])
    c = load_recipe(domain="code", overrides=["train.steps=1"])
    assert a.hash() == b.hash() != c.hash()


def test_every_field_has_help():
    assert all(h for _, _, h in help_table())


def test_defaults_are_the_code_recipe():
    """recipe-help prints the defaults: they must be what recipes/code.yaml runs."""
    assert Recipe() == load_recipe(RECIPES_DIR / "code.yaml")


def test_help_lists_each_methods_section():
    keys = {k for k, _, _ in help_table()}
    assert {"train.medusa.heads", "train.medusa.recurrent", "train.eagle.unroll", "train.eagle.num_layers",
            "train.draft_lm.lora_rank", "train.draft_lm.init_from", "train.self_spec.adapter_rank"} <= keys
    assert not {"train.medusa_heads", "train.num_layers", "train.lora_rank"} & keys
    sections = {k.split(".")[1] for k in keys if k.startswith("train.") and k.count(".") == 2}
    assert sections == {name for name, m in METHODS.items() if m.config is not None}


@pytest.mark.parametrize("override,needle", [
    (["train.eagle.unroll=3"], "train.eagle.unroll is for train.method=eagle, not 'medusa'; remove it"),
    (["train.method=draft_lm", "train.self_spec.num_layers=2"],
     "train.self_spec.num_layers is for train.method=self_spec, not 'draft_lm'; remove it"),
    (["train.method=eagle", "train.medusa.heads=2"], "train.medusa.heads is for train.method=medusa, not 'eagle'"),
])
def test_a_key_of_another_method_is_refused(override, needle):
    with pytest.raises(RecipeError, match=re.escape(needle)) as e:
        load_recipe(domain="code", overrides=override)
    assert "\n" not in str(e.value)


def test_a_recipe_file_with_another_methods_section_is_refused(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("domain: x\ntrain:\n  method: eagle\n  eagle:\n    unroll: 3\n  medusa:\n    heads: 2\n")
    with pytest.raises(RecipeError, match=re.escape("train.medusa.heads is for train.method=medusa, not 'eagle'")):
        load_recipe(p)


def test_overriding_the_method_drops_the_files_sections_for_its_old_method():
    r = load_recipe(domain="code", overrides=["train.method=eagle", "train.eagle.unroll=3"])
    assert r.train.method == "eagle" and r.train.eagle.unroll == 3
    assert r.train.medusa == TrainConfig().medusa  # code.yaml's medusa keys were for method=medusa


@pytest.mark.parametrize("overrides", [[], ["train.method=eagle", "train.eagle.unroll=3"], ["train.method=int8"]])
def test_to_dict_reads_back_as_the_same_recipe(tmp_path, overrides):
    """run_dir/recipe.yaml (to_dict) loads as the recipe it came from: only the method's own section."""
    import yaml

    r = load_recipe(domain="code", overrides=overrides)
    d = r.to_dict()
    assert {k for k in d["train"] if k in METHODS} == ({r.train.method} & {"eagle", "medusa"})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(d))
    assert load_recipe(tmp_path / "r.yaml") == r


def test_a_moved_key_says_where_it_went():
    with pytest.raises(RecipeError, match=re.escape("medusa_heads moved to train.medusa.heads")):
        load_recipe(domain="code", overrides=["train.medusa_heads=2"])


def test_train_method_is_one_of_the_registry():
    for name in METHODS:
        assert load_recipe(domain="code", overrides=[f"train.method={name}"]).train.method == name
    with pytest.raises(RecipeError, match=re.escape(str(sorted(METHODS)))):
        load_recipe(domain="code", overrides=["train.method=magic"])
    with pytest.raises(RecipeError, match="token-level draft .train.method=draft_lm or self_spec., not 'medusa'"):
        load_recipe(domain="code", overrides=["train.data=onpolicy"])


def test_section_values_are_checked_by_name():
    with pytest.raises(RecipeError, match=re.escape("train.medusa.heads=0 must be > 0")):
        load_recipe(domain="code", overrides=["train.medusa.heads=0"])
    with pytest.raises(RecipeError, match=re.escape("train.draft_lm.lora_rank=-1")):
        load_recipe(domain="code", overrides=["train.method=draft_lm", "train.draft_lm.lora_rank=-1"])


def test_hashes_see_the_flat_train_layout():
    """Recipe.hash and train_key read the train section in the flat layout it had before the method
    sections (run directories made before resume): the method's num_layers, the sections' keys renamed."""
    r = load_recipe(domain="code", overrides=["train.method=self_spec", "train.self_spec.num_layers=6",
                                              "train.self_spec.adapter_rank=128"])
    flat = flat_train(r.train)
    assert {k: flat[k] for k in ("num_layers", "adapter_rank", "medusa_heads", "medusa_recurrent", "unroll",
                                 "lora_rank", "init_from")} == {
        "num_layers": 6, "adapter_rank": 128, "medusa_heads": 3, "medusa_recurrent": True, "unroll": 2,
        "lora_rank": 0, "init_from": "target"}
    assert not set(flat) & set(METHODS)
    assert flat_train(Recipe().train)["num_layers"] == 1  # medusa has none: the old default
    other = load_recipe(domain="code", overrides=["train.method=self_spec", "train.self_spec.num_layers=5",
                                                  "train.self_spec.adapter_rank=128"])
    assert other.hash() != r.hash()


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cli_unknown_domain_one_line_error():
    r = _cli("distill", "--domain", "klingon")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "known domains" in r.stderr and "code" in r.stderr


def test_cli_unknown_recipe_key(tmp_path):
    r = _cli("distill", "--recipe", "recipes/code.yaml", "train.nope=1", f"runs_dir={tmp_path}")
    assert r.returncode == 2 and "train.nope" in r.stderr and r.stderr.strip().count("\n") == 0


def test_cli_key_of_another_method_one_line_error(tmp_path):
    r = _cli("train", "--recipe", "recipes/code.yaml", "train.eagle.unroll=3", f"runs_dir={tmp_path}")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "train.eagle.unroll is for train.method=eagle, not 'medusa'" in r.stderr


def test_cli_missing_target_path(tmp_path):
    r = _cli("distill", "--recipe", "recipes/code.yaml", f"target={tmp_path}/no-such-model", f"runs_dir={tmp_path}")
    assert r.returncode == 2 and "does not exist" in r.stderr and r.stderr.strip().count("\n") == 0


def test_cli_overrides_after_options(tmp_path):
    """`--run-id X a.b=c` and `a.b=c --run-id X` mean the same; a stray word is still an error."""
    r = _cli("train", "--recipe", "recipes/code.yaml", f"runs_dir={tmp_path}", "--run-id", "r1", "train.stepz=1")
    assert r.returncode == 2 and "train.stepz" in r.stderr
    r = _cli("train", "--recipe", "recipes/code.yaml", "--run-id", "r1", "oops")
    assert r.returncode == 2 and "oops" in r.stderr


def test_cli_prompt_source_with_no_prompts(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = _cli("generate", "--recipe", "recipes/code.yaml", f"data.source={empty}", f"runs_dir={tmp_path}",
             "--run-id", "x")
    errors = [line for line in r.stderr.splitlines() if line.startswith("draftsmith: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr
    assert "empty.jsonl" in errors[0] and "no prompts" in errors[0]


def test_keys_added_to_a_later_section_leave_its_hash_alone():
    """retrain.min_prompts/min_tokens came after runs were keyed: a recipe that set another retrain key keeps
    the hash it had before them (8a909ce8cdddf714 at 9d11806), and setting them away from their defaults
    changes it."""
    r = load_recipe(domain="code", overrides=["retrain.min_gain=0.05"])
    assert r.hash() == "8a909ce8cdddf714"
    assert load_recipe(domain="code", overrides=["retrain.min_gain=0.05", "retrain.min_prompts=4"]).hash() != r.hash()


def test_time_budgets_enter_no_key():
    """generate.max_minutes and train.max_minutes limit time on this machine: a run resumes across a changed
    budget (its stages record the cut they made), so neither enters the recipe hash, the train key or the
    generate hash."""
    from pipeline.generate import generate_hash

    a = load_recipe(domain="code")
    b = load_recipe(domain="code", overrides=["generate.max_minutes=0", "train.max_minutes=90"])
    assert (a.hash(), a.train_key(), generate_hash(a)) == (b.hash(), b.train_key(), generate_hash(b))
    assert a.generate.max_minutes == 16 and a.train.max_minutes == 13  # recipes/code.yaml's


def test_a_datastore_export_without_a_datastore_is_refused_at_load():
    """export.formats=[vllm-proposer] exports the draft's datastore: with train.datastore=false there is none, so
    the recipe is refused before any stage runs, naming both keys."""
    with pytest.raises(RecipeError, match="vllm-proposer.*train.datastore=false.*train.datastore=true"):
        load_recipe(domain="code", overrides=["export.formats=[vllm-proposer]", "train.datastore=false"])
    assert load_recipe(domain="code", overrides=["export.formats=[vllm-proposer]", "train.datastore=true"])
