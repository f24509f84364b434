"""Recipes: every shipped recipe validates; unknown keys and wrong types are named; overrides work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import RECIPES_DIR, Recipe, RecipeError, help_table, known_domains, load_recipe

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
])
def test_bad_keys_and_types_are_named(override, needle):
    with pytest.raises(RecipeError, match=re.escape(needle)):
        load_recipe(domain="code", overrides=override)


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
