"""The retrain loop end to end through the CLI on a tiny target (issue 24's four steps): distill -> champion;
retrain on new code traffic -> the gate decides, with its figures; chat-like traffic -> `monitor` fires
first, then a retrain; rollback. Plus the job's refusals: bad traffic, nothing new, another target.

Timing on a tiny model is noise, so where the gate's verdict matters the judged per-prompt numbers are
replaced by synthetic ones (`synthetic_gate`: the real gate decides on them); the test checks the plumbing
and the records. tests/test_gate.py tests the rules on hand-computed numbers."""

import json
import re
from pathlib import Path

import pytest

import pipeline.retrain as retrain_mod
from pipeline.cli import main
from pipeline.registry import Registry

from faulted import with_timing
from helpers import TINY_BUDGET

FAST = TINY_BUDGET + ["data.max_prompts=12", "train.steps=2", "evaluate.hybrid=false", "evaluate.tree_budgets=[4]"]
CODE = [f"def {n}(items, k={i}):\n    \"\"\"Return the {n} of items, using k.\"\"\"\n" for i, n in enumerate(
    ["add", "scale", "clip", "merge", "split", "count", "find", "rotate", "flatten", "pairs", "window", "chunk"])]
CHAT = [{"request": {"messages": [{"role": "user", "content": f"Tell me a story about {t} and a lighthouse, #{i}."}]},
         "response": {"choices": [{"message": {"role": "assistant", "content": "Once..."}}]}}
        for i, t in enumerate(["tides", "bread", "chess", "owls", "tea", "maps", "bees", "kites"])]


def _args(cmd, tiny_target, runs, *extra, target=None):
    return [cmd, "--recipe", "recipes/code.yaml", f"target={target or tiny_target}", "dtype=float32",
            f"runs_dir={runs}", "wandb.mode=offline", *FAST, *extra]


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


REAL_DECIDE = retrain_mod.decide


def synthetic_gate(mp, gain: float):
    """retrain's decide() on the judged results with given timing (tests/faulted.py): the champion 1.5x plain,
    the challenger `gain` times that, the n-gram baseline 1.1x. Counts, acceptance and exactness stay measured."""
    speedups = {"champion": 1.5, "challenger": 1.5 * gain, "ngram": 1.1}
    mp.setattr(retrain_mod, "decide", lambda recipe, judged: REAL_DECIDE(recipe, with_timing(judged, speedups)))


@pytest.fixture(scope="module")
def loop(tiny_target, tmp_path_factory):
    """distill, then retrain on 12 new code prompts with a challenger 1.3x the champion, W&B offline:
    {"runs", "traffic", "distill", "retrain": run dirs}."""
    runs = tmp_path_factory.mktemp("runs")
    traffic = tmp_path_factory.mktemp("traffic")
    out = {"runs": runs, "traffic": traffic}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        mp.delenv("WANDB_MODE", raising=False)
        synthetic_gate(mp, 1.0)  # the first draft: the absolute checks (1.0 x 1.5 > 1.0 and > 1.1)
        assert main(_args("distill", tiny_target, runs)) == 0
        out["distill"] = (runs / "code" / "latest").resolve()
        out["champion0"] = Registry(runs / "code").champion()
        synthetic_gate(mp, 1.3)
        code = _jsonl(traffic / "code.jsonl", [{"prompt": p} for p in CODE])
        assert main(_args("retrain", tiny_target, runs, "--traffic", code)) == 0
        out["retrain"] = Path(json.loads(next((runs / "code" / "traffic" / "batches").glob(
            "2*/manifest.json")).read_text())["run_dir"])
    return out


def test_distill_admits_its_draft_as_champion(loop):
    """Step 1: the distill's best/ is a registry entry and, passing the absolute checks, the champion."""
    champ = loop["champion0"]
    assert champ is not None and champ["kind"] == "distill" and champ["run_dir"] == str(loop["distill"])
    gate = json.loads((loop["distill"] / "gate.json").read_text())
    assert gate["promote"] and gate["champion"] is None
    assert {r["name"] for r in gate["reasons"]} == {"evidence", "speedup_over_plain", "speedup_over_ngram", "lossless"}
    assert (Path(champ["draft_dir"]) / "draftsmith_draft.json").exists()
    m = json.loads((loop["distill"] / "metrics.json").read_text())
    assert champ["metrics"]["tau"] == m["tau"] and champ["metrics"]["target"] == m["target"]


def test_retrain_decides_with_its_figures(loop):
    """Step 2: the challenger trained on the old and the new prompts (only the new ones generated), warm-started
    from the champion, judged with the champion and the n-gram baseline in one measurement, promoted by the gate;
    gate.json, the registry's decisions and W&B hold the figures."""
    runs, run = loop["runs"], loop["retrain"]
    reg = Registry(runs / "code")
    gate = json.loads((run / "gate.json").read_text())
    assert gate["promote"] and gate["kind"] == "retrain" and gate["champion"] == loop["champion0"]["id"]
    assert reg.champion()["id"] == gate["challenger"] and reg.champion()["parent"] == loop["champion0"]["id"]
    assert gate["figures"]["bootstrap"]["ratio"] == pytest.approx(1.3)
    assert {r["name"] for r in gate["reasons"]} >= {"gain_over_champion", "acceptance_per_position"}
    assert [d["challenger"] for d in reg.decisions()] == [loop["champion0"]["id"], gate["challenger"]]
    # one interleaved measurement: the three took turns with the same plain runs
    judged = {n: json.loads((run / "gate" / f"{n}.json").read_text()) for n in ("challenger", "champion", "ngram")}
    assert judged["challenger"]["plain_stats"] == judged["champion"]["plain_stats"] == judged["ngram"]["plain_stats"]
    fresh = (run / "prompts" / "heldout.jsonl").read_text().splitlines()
    assert len(judged["champion"]["stats"]["per_prompt"]) == min(2, len(fresh))
    # incremental: the distill's shards reused, the new prompts generated; the fresh slice never trained on
    info = json.loads((run / "generate" / "manifest.json").read_text())["incremental"]
    n_new = len((run / "prompts" / "train.jsonl").read_text().splitlines())
    assert info["reused_from"] == str(loop["distill"] / "generate") and info["new_rows"] == n_new
    assert not info["regenerated"]
    assert n_new + len(fresh) == len(CODE)
    train_ids = {json.loads(x)["id"] for x in (run / "prompts" / "all_train.jsonl").read_text().splitlines()}
    assert not train_ids & {json.loads(x)["id"] for x in fresh}
    ck = json.loads((run / "challenger" / "draftsmith_draft.json").read_text())
    assert ck["init_from"] == loop["champion0"]["draft_dir"]
    # W&B: one offline run in the domain's retrain group, the gate table, the two draft artifacts
    files = list(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    blob = files[0].read_bytes()
    for needle in (b"code-retrain", b"gate/decision", b"code-draft", b"challenger", b"champion",
                   gate["challenger"].encode(), loop["champion0"]["id"].encode()):
        assert needle in blob, needle


def test_same_traffic_again_is_nothing_new(loop, tiny_target, capsys):
    """A rerun with traffic already used exits 0, says "nothing new", and changes nothing."""
    runs = loop["runs"]
    before = _tree(runs)
    assert main(_args("retrain", tiny_target, runs, "--traffic", str(loop["traffic"] / "code.jsonl"))) == 0
    assert "nothing new" in capsys.readouterr().out
    assert _tree(runs) == before


@pytest.mark.parametrize("name, content, where", [
    ("empty.jsonl", b"", ":1:"),
    ("truncated.jsonl", b'{"prompt": "def f():"}\n{"prompt": "def g(', ":2:"),
    ("latin1.jsonl", b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', ":2:"),
    ("types.jsonl", b'{"prompt": "ok"}\n{"prompt": 42}\n', ":2:"),
])
def test_bad_traffic_is_one_line_and_changes_nothing(loop, tiny_target, capsys, name, content, where):
    runs = loop["runs"]
    bad = loop["traffic"] / name
    bad.write_bytes(content)
    before = _tree(runs)
    assert main(_args("retrain", tiny_target, runs, "--traffic", str(bad))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("draftsmith: error: ") and f"{bad}{where}" in err[0], err
    assert _tree(runs) == before


def test_a_draft_for_another_target_is_refused(loop, tmp_path, capsys):
    """The champion serves the tiny target: a retrain for another target is refused in one line, nothing changed."""
    import shutil

    runs = loop["runs"]
    other = tmp_path / "other-target"
    shutil.copytree(loop["champion0"]["metrics"]["target"], other)
    before = _tree(runs)
    code = _jsonl(tmp_path / "more.jsonl", [{"prompt": "def novel(x):\n    pass\n"}])
    assert main(_args("retrain", None, runs, "--traffic", code, target=str(other))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "serves target" in err[0] and str(other) in err[0]
    assert _tree(runs) == before


def test_a_run_id_naming_an_existing_run_is_refused(loop, tmp_path, tiny_target, capsys):
    """retrain --run-id <the distill's run>: refused in one line before any traffic is read into the ledger, the
    distill's run (its status, prompts, generate stage) and everything else unchanged."""
    runs = loop["runs"]
    before = _tree(runs)
    code = _jsonl(tmp_path / "fresh.jsonl", [{"prompt": "def brand_new(x):\n    pass\n"}])
    assert main(_args("retrain", tiny_target, runs, "--traffic", code, "--run-id", loop["distill"].name)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and loop["distill"].name in err[0], err
    assert _tree(runs) == before


@pytest.mark.parametrize("extra, which", [(["evaluate.n_prompts=4", "retrain.min_prompts=8"], "evaluate.n_prompts"),
                                          (["retrain.fresh_prompts=3", "evaluate.n_prompts=0", "retrain.min_prompts=4"], "retrain.fresh_prompts")])
def test_a_gate_that_could_never_promote_is_refused(loop, tmp_path, tiny_target, capsys, extra, which):
    """The gate judges at most retrain.fresh_prompts prompts of a batch, and evaluate.n_prompts of those: a
    retrain.min_prompts above either is refused in one line naming it, before any traffic is read."""
    runs = loop["runs"]
    before = _tree(runs)
    code = _jsonl(tmp_path / "fresh.jsonl", [{"prompt": "def brand_new(x):\n    pass\n"}])
    assert main(_args("retrain", tiny_target, runs, "--traffic", code, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could ever be promoted" in err[0] and which in err[0], err
    assert _tree(runs) == before


def test_chat_traffic_monitor_fires_then_retrain_then_rollback(loop, tiny_target, monkeypatch, capsys):
    """Steps 3 and 4: chat-like traffic; `monitor` measures the champion on it and exits 1 (drift); the retrain
    that follows is judged (a slower challenger: kept); then a rollback restores the distill's champion.
    The tiny target's greedy output loops on any prompt, so the champion's τ cannot drift on it: its measured
    target forwards are doubled (τ halved), what another domain's traffic does to a real draft."""
    import pipeline.measure as measure

    runs = loop["runs"]
    chat = _jsonl(loop["traffic"] / "chat.jsonl", CHAT)
    real = measure.decode_together

    def drifted(*a, **kw):
        plain_seqs, plain, outs = real(*a, **kw)
        for _, stats in outs.values():
            stats["target_forwards"] *= 2
            stats["tau"] = stats["n_tokens"] / stats["target_forwards"]
        return plain_seqs, plain, outs

    with monkeypatch.context() as mp:
        mp.setattr(measure, "decode_together", drifted)
        assert main(_args("monitor", tiny_target, runs, "--traffic", chat)) == 1
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "DRIFT" in line
    report = json.loads(sorted((runs / "code" / "monitor").glob("*.json"))[-1].read_text())
    champ = Registry(runs / "code").champion()
    assert report["drift"] and report["champion"] == champ["id"] and report["n_prompts"] == len(CHAT)
    assert report["tau_drop"] == pytest.approx(1 - report["tau"] / champ["metrics"]["tau"])
    assert report["tau_drop"] > 0.10

    synthetic_gate(monkeypatch, 0.8)  # a slower challenger (0.8x the champion): never promoted
    assert main(_args("retrain", tiny_target, runs, "--traffic", chat)) == 0
    reg = Registry(runs / "code")
    last = reg.decisions()[-1]
    assert not last["promote"] and reg.champion()["id"] == champ["id"]
    assert "gain_over_champion" in {r["name"] for r in last["reasons"] if not r["passed"]}
    assert re.search(r"keep the champion", capsys.readouterr().out)

    back = reg.rollback()
    assert back["id"] == loop["champion0"]["id"] == reg.champion()["id"]
    assert len(reg.entries()) == 3  # nothing lost: every entry stays


def test_ingest_dedupes_splits_and_commits_through_the_ledger(tmp_path):
    """No model: the ledger drops prompts seen before (whitespace-insensitive), the fresh slice is held out
    and never in train, a batch directory the ledger does not name (a crash before the commit) is removed."""
    from pipeline.config import RetrainConfig
    from pipeline.traffic import Ledger, ingest

    cfg = RetrainConfig(fresh_prompts=3, fresh_fraction=0.25)
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": p} for p in CODE])
    first = ingest(tmp_path, [a], cfg)
    assert (first["new_rows"], first["n_fresh"], first["n_train"]) == (12, 3, 9)
    ledger = Ledger(tmp_path)
    assert ledger.pending()["id"] == first["id"] and len(ledger.keys()) == 12
    fresh = {r["id"] for r in ledger.rows(first["id"], "fresh")}
    assert len(fresh) == 3 and not fresh & {r["id"] for r in ledger.rows(first["id"], "train")}
    (ledger.dir / "batches" / "orphan").mkdir()
    ledger.update(first["id"], status="decided")
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": "  " + CODE[0]}, {"prompt": "def new_one():\n"}])
    second = ingest(tmp_path, [b], cfg)
    assert second["new_rows"] == 1 and second["duplicates"] == 1
    assert not (ledger.dir / "batches" / "orphan").exists()
    assert ingest(tmp_path, [a, b], cfg) is None  # nothing new: None, nothing written


def test_check_target_names_both_targets(tmp_path):
    from pipeline.config import recipe_from_dict
    from pipeline.retrain import RetrainError, check_target

    d = tmp_path / "draft"
    d.mkdir()
    (d / "draftsmith_draft.json").write_text(json.dumps({"kind": "medusa", "target": "/models/old"}))
    recipe = recipe_from_dict({"target": "/models/new"})
    with pytest.raises(RetrainError, match="trained for target '/models/old'.*serves '/models/new'"):
        check_target(d, recipe, None)
    with pytest.raises(RetrainError, match="serves target '/models/old'"):
        check_target(d, recipe, {"id": "x", "metrics": {"target": "/models/old"}})


def test_new_weights_change_the_reuse_key(tiny_target, tmp_path):
    """The shards of earlier runs are reused only under the same target files: new weights at the same path
    change the key (and so regenerate every prompt, saying so); another generate setting changes it too."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.config import recipe_from_dict
    from pipeline.generate import reuse_key

    t = tmp_path / "target"
    shutil.copytree(tiny_target, t)
    recipe = recipe_from_dict({"target": str(t), "dtype": "float32"})
    before = reuse_key(recipe)
    assert reuse_key(recipe) == before
    shorter = recipe_from_dict({"target": str(t), "dtype": "float32", "generate": {"max_new_tokens": 7}})
    assert reuse_key(shorter) != before
    w = load_file(t / "model.safetensors")
    name = next(iter(w))
    w[name] = w[name] + torch.ones_like(w[name])
    save_file(w, t / "model.safetensors", metadata={"format": "pt"})
    assert reuse_key(recipe) != before


def test_a_later_distill_is_judged_against_the_champion(loop, tiny_target, monkeypatch):
    """distill's admission with a champion in place: its best/ is judged against the champion in one measurement
    on its held-out prompts like a challenger (here 0.9x the champion: registered, not promoted)."""
    import shutil

    from pipeline.config import load_recipe
    from pipeline.models import load_target
    from pipeline.retrain import admit_distill

    runs = loop["runs"]
    reg = Registry(runs / "code")
    champ = reg.champion()
    run = runs / "code" / "later-distill"
    shutil.copytree(loop["distill"], run, ignore=shutil.ignore_patterns(  # what the admission wrote is not copied
        "gate.json", "registered.json", "judged_against.json", "wandb"))
    recipe = load_recipe("recipes/code.yaml", [f"target={tiny_target}", "dtype=float32", f"runs_dir={runs}", *FAST])
    target, tok = load_target(recipe.target, recipe.dtype, "cpu")
    synthetic_gate(monkeypatch, 0.9)
    from pipeline.retrain import data_state

    base = data_state(runs / "code")
    record = admit_distill(recipe, run, target, tok)
    assert not record["promote"] and record["champion"] == champ["id"] and record["kind"] == "distill"
    assert data_state(runs / "code") == base  # the champion's rows (its traffic included) stay the next retrain's base
    assert record["figures"]["bootstrap"]["ratio"] == pytest.approx(0.9)
    assert json.loads((run / "gate.json").read_text())["challenger"] == record["challenger"] == "later-distill"
    assert reg.champion()["id"] == champ["id"] and reg.entry("later-distill")["parent"] == champ["id"]
    judged = [json.loads((run / "gate" / f"{n}.json").read_text()) for n in ("challenger", "champion", "ngram")]
    assert judged[0]["plain_stats"] == judged[1]["plain_stats"] == judged[2]["plain_stats"]
