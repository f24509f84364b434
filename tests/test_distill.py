"""End to end through the CLI: a tiny target built from a config, then the real embedded target
with a tiny budget (generate -> train -> evaluate), checking the files a user relies on."""

import json
from pathlib import Path

import pytest

from pipeline.cli import main

METRIC_KEYS = {"domain", "target", "draft_method", "checkpoint", "k", "alpha", "tau", "tokens_per_s_plain",
               "tokens_per_s_spec", "speedup", "greedy_exact", "n_prompts", "max_new_tokens"}

from helpers import TINY_BUDGET


def _wandb_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def test_distill_tiny_target_end_to_end(tiny_target, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = ["distill", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={tmp_path}", "wandb.mode=offline", *TINY_BUDGET]
    assert main(args) == 0
    latest = tmp_path / "code" / "latest"
    assert latest.is_symlink()
    m = json.loads((latest / "metrics.json").read_text())
    assert METRIC_KEYS <= set(m)
    assert m["greedy_exact"] is True, "fp32 speculative output must equal plain greedy output"
    assert m["n_prompts"] == 2 and m["max_new_tokens"] == 12
    assert 0.0 <= m["alpha"] <= 1.0 and m["tau"] >= 1.0
    assert (latest / "best" / "draftsmith_draft.json").exists()
    assert (latest / "report.md").exists() and (latest / "acceptance_per_position.png").exists()
    # Real W&B offline run files, one per stage, holding what was logged.
    files = _wandb_files(latest)
    assert len(files) == 3
    blob = b"".join(f.read_bytes() for f in files)
    for key in (b"alpha", b"tau", b"speedup", b"loss"):
        assert key in blob
    # The promoted draft loads in the decoder with the target alone.
    from eval.proposers import load_proposer
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    prop = load_proposer(str(latest / "best"), target)
    # The best checkpoint was served as a hybrid with and without its datastore, and the faster form
    # promoted as measured: best/ carries the datastore exactly when the promoted form used it.
    names = [c["name"] for c in m["checkpoints"]]
    assert any(n.endswith("+ngram") for n in names) and any(n.endswith("+ngram-nostore") for n in names)
    nostore = m["checkpoint"].endswith("+ngram-nostore")
    assert (latest / "best" / "datastore.npy").exists() == (not nostore)
    assert m["draft_method"].endswith("+ngram+datastore") == (getattr(prop, "datastore", None) is not None)
    assert m["ngram_k"] == 8  # the n-gram baseline at its own K, not the draft's
    # The hybrid's tree budget was fitted on this machine among the recipe's budgets, and a promoted
    # hybrid serves from best/ with the fitted one.
    fits = list((latest / "eval").glob("*.tree-budget.json"))
    assert len(fits) == 1
    fit = json.loads(fits[0].read_text())
    n_val = len((latest / "prompts" / "val.jsonl").read_text().splitlines())
    assert (fit["prompts"], fit["n_prompts"]) == (("val", min(2, n_val)) if n_val else ("train", 2))
    for f in fit["fits"].values():
        assert sorted(int(n) for n in f["budgets"]) == [4, 6, 8, 10, 12]
        assert str(f["max_nodes"]) == max(f["budgets"], key=lambda n: f["budgets"][n]["est_speedup"])
    if "+ngram" in m["checkpoint"]:
        promoted = [f for f in fit["fits"].values() if f["budgets"] == m["tree_budget_fit"]["budgets"]]
        assert m["max_nodes"] == prop.max_nodes == promoted[0]["max_nodes"]
        assert f"at most **{m['max_nodes']} nodes**" in (latest / "report.md").read_text()
    else:  # a bare checkpoint won: it serves no trees
        assert m["max_nodes"] is None and m["tree_budget_fit"] is None

    # Running the same command again on a finished run starts a new run (the old one is kept).
    first = latest.resolve().name
    import time

    time.sleep(1.1)
    assert main(args + ["train.steps=2"]) == 0
    assert latest.resolve().name != first and (tmp_path / "code" / first / "metrics.json").exists()


@pytest.mark.integration
def test_distill_real_embedded_target_tiny_budget(tmp_path, monkeypatch):
    """The real SmolLM2-135M target, a handful of prompts and steps: every stage runs for real."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = ["distill", "--recipe", "recipes/code.yaml", f"runs_dir={tmp_path}", "wandb.mode=offline",
            *TINY_BUDGET, "data.max_prompts=16", "train.draft_vocab_size=2048"]
    assert main(args) == 0
    latest = tmp_path / "code" / "latest"
    m = json.loads((latest / "metrics.json").read_text())
    assert METRIC_KEYS <= set(m)
    assert m["target"] == "embedded:smollm2-135m-instruct"
    assert m["fp32_exact"] is True
    assert m["greedy_exact"] is True
    assert len(_wandb_files(latest)) == 3
    gen = json.loads((latest / "generate" / "manifest.json").read_text())
    assert gen["complete"] and sum(s["rows"] for s in gen["shards"].values()) > 0


def test_interrupted_distill_resumes_the_same_run(tiny_target, tmp_path, monkeypatch):
    """Ctrl-C during training: exit 130 with a resume hint, nothing removed; the same command
    continues the same run, keeping the generated shards as they were."""
    import pipeline.cli as cli

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    args = ["distill", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={tmp_path}", "wandb.mode=disabled", *TINY_BUDGET]
    real_train = cli.stage_train

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "stage_train", interrupted)
    assert main(args) == 130
    run = (tmp_path / "code" / "latest").resolve()
    shards = sorted((run / "generate").glob("shard-*"))
    assert shards and json.loads((run / "generate" / "manifest.json").read_text())["complete"]
    stamps = {p.name: p.stat().st_mtime_ns for p in shards}

    monkeypatch.setattr(cli, "stage_train", real_train)
    assert main(args) == 0
    assert (tmp_path / "code" / "latest").resolve() == run  # same run, continued
    assert {p.name: p.stat().st_mtime_ns for p in sorted((run / "generate").glob("shard-*"))} == stamps
    assert json.loads((run / "status.json").read_text())["complete"] is True
    assert (run / "metrics.json").exists()
