"""End to end through the CLI: a tiny target built from a config, distilled once for the module
(generate -> train -> evaluate -> report, W&B offline), then each file a user relies on checked on
its own; and the real embedded target with a tiny budget."""

import json
import re
import shutil
from pathlib import Path

import pytest

from pipeline.cli import main

from helpers import TINY_BUDGET, wandb_logged

METRIC_KEYS = {"domain", "target", "draft_method", "checkpoint", "k", "alpha", "tau", "tokens_per_s_plain",
               "tokens_per_s_spec", "speedup", "greedy_exact", "n_prompts", "max_new_tokens"}


def _args(tiny_target, runs_dir, wandb="offline") -> list[str]:
    return ["distill", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={runs_dir}", f"wandb.mode={wandb}", *TINY_BUDGET]


def _wandb_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _evaluate_args(tiny_target, run: Path) -> list[str]:
    return ["evaluate", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={run.parent.parent}", "wandb.mode=disabled", *TINY_BUDGET, "--run-id", run.name]


@pytest.fixture(scope="module")
def distilled(tiny_target, tmp_path_factory):
    """One tiny distill, W&B offline: (runs_dir, the run directory)."""
    runs = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        mp.delenv("WANDB_MODE", raising=False)
        assert main(_args(tiny_target, runs)) == 0
    return runs, (runs / "code" / "latest").resolve()


def test_distill_writes_the_run_files(distilled):
    runs, run = distilled
    assert (runs / "code" / "latest").is_symlink()
    for name in ("metrics.json", "report.md", "acceptance_per_position.png", "speedup.png", "recipe.yaml",
                 "best/draftsmith_draft.json"):
        assert (run / name).is_file(), name
    assert json.loads((run / "status.json").read_text())["complete"] is True
    gen = json.loads((run / "generate" / "manifest.json").read_text())
    assert gen["complete"] and sum(s["rows"] for s in gen["shards"].values()) > 0
    # runs/code/champion: the registry's champion, this run's best/ exactly when its gate promoted it
    gate, link = json.loads((run / "gate.json").read_text()), runs / "code" / "champion"
    assert link.is_symlink() == gate["promote"], gate["summary"]
    if gate["promote"]:
        assert link.resolve() == (runs / "code" / "registry" / "entries" / run.name / "draft").resolve()
        assert (link / "draftsmith_draft.json").read_bytes() == (run / "best" / "draftsmith_draft.json").read_bytes()


def test_metrics_are_the_promoted_candidates_measurement(distilled):
    """metrics.json holds the promised keys, and its figures are those of the candidate it names, as
    measured in eval/; fp32 speculative output equals plain greedy output."""
    _, run = distilled
    m = _metrics(run)
    assert METRIC_KEYS <= set(m)
    assert m["greedy_exact"] is True and m["fp32_exact"] is True and m["fp32_prompts"] == 1
    assert m["n_prompts"] == 2 and m["max_new_tokens"] == 12 and m["k"] == 2
    assert m["ngram_k"] == 8  # the n-gram baseline at its own K, not the draft's
    measured = json.loads((run / "eval" / f"{m['checkpoint']}.json").read_text())
    assert (m["alpha"], m["tau"], m["speedup"]) == (measured["stats"]["alpha"], measured["stats"]["tau"],
                                                    measured["speedup"])
    baseline = json.loads((run / "eval" / "ngram.json").read_text())
    assert m["ngram_baseline"]["speedup"] == baseline["speedup"] and baseline["stats"]["k"] == 8
    hist = measured["stats"]["accept_len_hist"]  # vLLM's mean acceptance length from the same counters
    assert m["mean_acceptance_length"] == 1 + measured["stats"]["accepted"] / sum(hist)
    # the code recipe serves greedy: nothing is measured sampling, and promotion is by greedy speedup
    assert m["sampled"] is None and m["promoted_by"] == "greedy" and not list((run / "eval").glob("*.sampled.json"))


def test_served_forms_of_the_best_checkpoint_and_promotion_by_speedup(distilled):
    """The checkpoint with the highest τ is served as a hybrid with and without its datastore; the
    candidate with the best measured speedup is promoted, and best/ carries the datastore exactly
    when the promoted form used it."""
    _, run = distilled
    m = _metrics(run)
    ckpts = json.loads((run / "train" / "manifest.json").read_text())["checkpoints"]
    measured = [json.loads((run / "eval" / f"{c}.json").read_text()) for c in ckpts]
    best_ck = max(measured, key=lambda r: (r["stats"]["tau"], r["speedup"]))["name"]
    names = [c["name"] for c in m["checkpoints"]]
    assert names == ckpts + [f"{best_ck}+ngram", f"{best_ck}+ngram-nostore"]
    assert m["checkpoint"] == max(m["checkpoints"], key=lambda c: c["speedup"])["name"]
    nostore = m["checkpoint"].endswith("+ngram-nostore")
    assert (run / "best" / "datastore.npy").exists() == (not nostore)
    meta = json.loads((run / "best" / "draftsmith_draft.json").read_text())
    assert meta["proposer"] == ("hybrid" if "+ngram" in m["checkpoint"] else "draft")
    assert m["draft_method"] == meta["method"] + ("+ngram" if "+ngram" in m["checkpoint"] else "") + \
        ("+datastore" if "+ngram" in m["checkpoint"] and not nostore else "")


def test_best_loads_and_serves_as_measured(distilled, tiny_target):
    """The promoted draft loads in the decoder with the target alone, at its fitted tree budget, and
    reproduces plain greedy decoding in fp32."""
    from transformers import AutoModelForCausalLM

    from eval.decoder import SpeculativeDecoder
    from eval.proposers import load_proposer

    _, run = distilled
    m = _metrics(run)
    target = AutoModelForCausalLM.from_pretrained(tiny_target).float().eval()
    prop = load_proposer(str(run / "best"), target)
    meta = json.loads((run / "best" / "draftsmith_draft.json").read_text())
    if "+ngram" in m["checkpoint"]:
        assert meta["serve"] == {"max_nodes": m["max_nodes"]} and prop.max_nodes == m["max_nodes"]
        assert (prop.datastore is not None) == m["draft_method"].endswith("+datastore")
    else:  # a bare checkpoint won: it serves no trees
        assert "serve" not in meta and m["max_nodes"] is None
    prompt = [[1, 5, 9, 3, 5, 9, 4, 1, 5, 9]]
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=12).sequences
    assert SpeculativeDecoder(target, prop, k=m["k"]).generate(prompt, max_new_tokens=12).sequences == plain


def test_tree_budget_fitted_on_validation_prompts(distilled):
    """The hybrid's tree budget was fitted on this machine among the recipe's budgets, on validation
    prompts, and a promoted hybrid serves with the fitted one."""
    _, run = distilled
    m = _metrics(run)
    fits = list((run / "eval").glob("*.tree-budget.json"))
    assert len(fits) == 1
    fit = json.loads(fits[0].read_text())
    n_val = len((run / "prompts" / "val.jsonl").read_text().splitlines())
    assert (fit["prompts"], fit["n_prompts"]) == (("val", min(2, n_val)) if n_val else ("train", 2))
    for f in fit["fits"].values():
        assert sorted(int(n) for n in f["budgets"]) == [4, 6, 8, 10, 12]
        assert str(f["max_nodes"]) == max(f["budgets"], key=lambda n: f["budgets"][n]["est_speedup"])
    for c in m["checkpoints"][-2:]:  # the served forms, each measured at its own fitted budget
        measured = json.loads((run / "eval" / f"{c['name']}.json").read_text())
        assert measured["max_nodes"] == fit["fits"][measured["source"]]["max_nodes"]
    if "+ngram" in m["checkpoint"]:
        promoted = json.loads((run / "eval" / f"{m['checkpoint']}.json").read_text())
        assert m["max_nodes"] == promoted["max_nodes"]
        assert m["tree_budget_fit"]["budgets"] == fit["fits"][promoted["source"]]["budgets"]
    else:
        assert m["tree_budget_fit"] is None


def test_report_shows_the_promoted_draft(distilled):
    _, run = distilled
    m = _metrics(run)
    report = (run / "report.md").read_text()
    assert f"**{m['draft_method']}**" in report and f"`{m['checkpoint']}`" in report
    assert f"| **measured speedup** | **{m['speedup']:.2f}×** |" in report
    assert all(f"| {c['name']} |" in report for c in m["checkpoints"])
    assert f"speedup {m['ngram_baseline']['speedup']:.2f}×" in report
    if m["max_nodes"] is not None:
        assert f"at most **{m['max_nodes']} nodes**" in report
    assert "Served greedy (evaluate.temperature=0)" in report and "## Greedy and at the serving" not in report


def test_wandb_offline_runs_hold_the_logged_metrics(distilled):
    """One W&B offline run file per stage, holding what each stage logged: the generate summary, the
    training loss, and every evaluated candidate's α, τ, tokens/s and speedup as measured."""
    _, run = distilled
    files = _wandb_files(run)
    assert len(files) == 3
    logged = {}
    for f in files:
        logged |= wandb_logged(f)
    assert logged["generate/rows"] > 0 and "train/loss" in logged and "train/tokens_per_s" in logged
    m = _metrics(run)
    for c in m["checkpoints"] + [dict(m["ngram_baseline"], name="ngram")]:
        for key in ("alpha", "tau", "tokens_per_s", "speedup"):
            assert logged[f"eval/{c['name']}/{key}"] == pytest.approx(c[key]), (c["name"], key)


def test_evaluate_again_reads_every_measurement_back(distilled, tiny_target, monkeypatch):
    """The evaluate stage rerun on the finished run measures nothing again (every candidate and the
    fit are read back from eval/) and writes the same metrics.json and best/."""
    import pipeline.evaluate as evaluate

    _, run = distilled
    before = _metrics(run)
    best = {p.name: p.read_bytes() for p in (run / "best").iterdir()}

    def measured(*a, **kw):
        raise AssertionError("a cached candidate was measured again")

    monkeypatch.setattr(evaluate, "decode_together", measured)
    monkeypatch.setattr(evaluate, "fit_budget", measured)
    assert main(_evaluate_args(tiny_target, run)) == 0
    assert _metrics(run) == before
    assert {p.name: p.read_bytes() for p in (run / "best").iterdir()} == best


def test_served_forms_and_baseline_are_measured_together(distilled, tiny_target, tmp_path, monkeypatch):
    """Without their cached results, the served forms and the n-gram baseline are measured in one
    interleaved run, in that order and each at its own K and budget, and the checkpoints are not."""
    import pipeline.evaluate as evaluate

    _, src = distilled
    run = tmp_path / "code" / src.name
    shutil.copytree(src, run, symlinks=True)
    m = _metrics(run)
    served = [c["name"] for c in m["checkpoints"][-2:]]
    for name in served + ["ngram"]:
        (run / "eval" / f"{name}.json").unlink()
    calls, real = [], evaluate.decode_together

    def recording(target, proposers, *a, **kw):
        calls.append([(name, k, p.max_nodes) for name, (p, k) in proposers.items()])
        return real(target, proposers, *a, **kw)

    monkeypatch.setattr(evaluate, "decode_together", recording)
    assert main(_evaluate_args(tiny_target, run)) == 0
    fit = json.loads(next((run / "eval").glob("*.tree-budget.json")).read_text())
    budget = [fit["fits"][json.loads((run / "eval" / f"{n}.json").read_text())["source"]]["max_nodes"] for n in served]
    assert len(calls) == 1 and calls[0][:2] == [(served[0], 2, budget[0]), (served[1], 2, budget[1])]
    assert calls[0][2][:2] == ("ngram", 8)


def test_distill_again_on_a_finished_run_starts_a_new_one(distilled, tiny_target, monkeypatch):
    """Running the same command again on a finished run starts a new run; the old one is kept."""
    import time

    runs, first = distilled
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    time.sleep(1.1)  # run ids are timestamps to the second
    assert main(_args(tiny_target, runs, wandb="disabled") + ["train.steps=2"]) == 0
    latest = (runs / "code" / "latest").resolve()
    assert latest != first and (first / "metrics.json").exists() and (latest / "metrics.json").exists()


@pytest.mark.integration
@pytest.mark.cpu_paths
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
    args = _args(tiny_target, tmp_path, wandb="disabled")
    real_train = cli.stage_train

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "stage_train", interrupted)
    assert main(args) == 130
    assert not (tmp_path / "code" / "latest").exists()  # an unfinished run is no result to point at
    [run] = [d for d in (tmp_path / "code").iterdir() if (d / "status.json").exists()]
    shards = sorted((run / "generate").glob("shard-*"))
    assert shards and json.loads((run / "generate" / "manifest.json").read_text())["complete"]
    stamps = {p.name: p.stat().st_mtime_ns for p in shards}

    monkeypatch.setattr(cli, "stage_train", real_train)
    assert main(args) == 0
    assert (tmp_path / "code" / "latest").resolve() == run  # same run, continued
    assert {p.name: p.stat().st_mtime_ns for p in sorted((run / "generate").glob("shard-*"))} == stamps
    assert json.loads((run / "status.json").read_text())["complete"] is True
    assert (run / "metrics.json").exists()


def test_distill_eagle3_trains_evaluates_and_exports(tiny_target, tmp_path):
    """`draftsmith distill train.method=eagle3 export.formats=[speculators,eagle3]` in one command: the
    EAGLE-3 head is trained, judged and promoted in our decoder, and best/ is written in both engine
    layouts, each with its manifest naming the source checkpoint and the serve commands."""
    from safetensors import safe_open

    args = ["distill", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={tmp_path}", "wandb.mode=disabled", *TINY_BUDGET, "train.method=eagle3",
            "export.formats=[speculators,eagle3]"]
    assert main(args) == 0
    run = (tmp_path / "code" / "latest").resolve()
    m = _metrics(run)
    assert m["draft_method"].startswith("eagle3") and set(m["exports"]) == {"speculators", "eagle3"}
    spec = json.loads((run / "best" / "export-speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target)
    e3 = json.loads((run / "best" / "export-eagle3" / "config.json").read_text())
    assert e3["architectures"] == ["LlamaForCausalLMEagle3"]
    for fmt, layer in (("speculators", "layers.0."), ("eagle3", "midlayer.")):
        d = run / "best" / f"export-{fmt}"
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert any(k.startswith(layer) for k in f.keys()) and "fc.weight" in f.keys()
        man = json.loads((d / "draftsmith_export.json").read_text())
        step = int(re.search(r"checkpoint-(\d+)", m["checkpoint"]).group(1))  # promoted by measured speed
        assert man["format"] == fmt and man["kind"] == "eagle3" and man["step"] == step and man["serve"]
        assert Path(man["source"]) == (run / "best").resolve()
