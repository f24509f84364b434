"""`draftsmith compare` on a tiny target: every method trains and is judged in the decoder, the
divergences run on the best one, the raw-text baseline and the K sweep are there, and the table is
written to the run directory, to W&B's offline files and to --docs."""

import json

import pytest

from pipeline.cli import main
from pipeline.compare import best_k
from pipeline.methods import variants

from helpers import TINY_BUDGET


def test_best_k_maximises_the_predicted_speedup():
    pred = lambda a, K, c: (1 - a ** (K + 1)) / ((1 - a) * (K * c + 1))  # noqa: E731
    for a, c in [(0.8, 0.05), (0.5, 0.2), (0.3, 0.5), (0.95, 0.01)]:
        K = best_k(a, c)
        assert all(pred(a, K, c) >= pred(a, j, c) for j in range(1, 9))
    assert best_k(0.9, 0.01) > best_k(0.3, 0.3)  # good cheap drafts want long runs
    assert best_k(0.0, 0.1) is None and best_k(0.5, None) is None


def test_compare_end_to_end(tiny_target, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    docs = tmp_path / "compare.md"
    args = ["compare", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={tmp_path}", "wandb.mode=offline", *TINY_BUDGET,
            "--methods", ",".join(variants()), "--divergences", "fkl,tv", "--steps", "2", "--docs", str(docs)]
    assert main(args) == 0
    run = (tmp_path / "code" / "latest").resolve()
    out = json.loads((run / "compare" / "compare.json").read_text())
    names = [r["name"] for r in out["methods"]]
    assert names == [f"{m}-fkl" for m in variants()] + ["hybrid", "hybrid-nostore", "ngram+datastore", "int8+ngram",
                                                     "ngram"]
    served = ("hybrid", "hybrid-nostore", "ngram+datastore", "int8+ngram", "ngram", "int8-fkl")
    decoded = ("hybrid", "hybrid-nostore", "ngram+datastore", "int8+ngram", "ngram")
    for r in out["methods"]:  # each row's figures are its own measurement's
        if r["name"] in decoded:
            cached = json.loads((run / "compare" / f"{r['name']}-k{r['k']}.json").read_text())["row"]
            assert {k: v for k, v in r.items() if k != "method"} == {k: v for k, v in cached.items() if k != "method"}
        else:
            m = json.loads((run / "compare" / r["name"] / "metrics.json").read_text())
            assert (r["alpha"], r["tau"], r["speedup"]) == (m["alpha"], m["tau"], m["speedup"]), r["name"]
        assert r["c"] is not None and r["best_k"] is not None or r["alpha"] == 0.0
    trained = [r for r in out["methods"] if r["name"] not in served]
    assert all(r["steps"] == 2 and r["train_tokens_per_s"] > 0 for r in trained)
    best = out["best_method"]
    assert [r["name"] for r in out["divergences"]] == [f"{best}-fkl", f"{best}-tv"]
    assert out["raw_baseline"]["data"] == "raw" and out["distillation_tau_lift"] is not None
    assert out["lift"]["distilled"]["name"] == f"{best}-fkl" and out["lift"]["steps"] == 2  # the table's own row
    assert [r["k"] for r in out["k_sweep"]] == [2, 3, 4, 6, 8]
    md = docs.read_text()
    assert md == (run / "compare" / "compare.md").read_text()
    assert "draftsmith compare" in md and "| eagle-fkl |" in md and "K sweep" in md
    assert "+ ngram + datastore) |" in md and "| ngram + datastore (no draft) |" in md
    assert any(b"compare/methods" in f.read_bytes() for f in run.glob("wandb/offline-run-*/run-*.wandb"))
    # the run's report shows the comparison, int8 and n-gram baselines included, with a plot
    from pipeline.report import compare_section

    section = "\n".join(compare_section(run))
    assert "| int8-fkl |" in section and "| ngram |" in section and (run / "compare_speedup.png").exists()
    # rerun: every variant is read back, nothing retrained
    stamp = {p: p.stat().st_mtime for p in run.glob("compare/*/train/manifest.json")}
    assert main(args) == 0
    assert {p: p.stat().st_mtime for p in run.glob("compare/*/train/manifest.json")} == stamp


def test_compare_rejects_unknown_method(tiny_target, tmp_path, capsys):  # noqa: F811
    args = ["compare", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={tmp_path}", "wandb.mode=disabled", *TINY_BUDGET, "--methods", "eagle,warp"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "['warp']" in err[0] and all(m in err[0] for m in variants())
    assert not (tmp_path / "code").exists()  # refused before any run opens


def test_variants_are_the_methods_own():
    """compare's variants are those the methods declare (DraftMethod.variants), each training its own
    method, as they were when compare held its own table; an unknown one is refused naming them all."""
    from pipeline import compare
    from pipeline.methods import METHODS

    assert variants() == {
        "eagle": {"method": "eagle"}, "eagle_fullvocab": {"method": "eagle", "draft_vocab_size": 0},
        "medusa": {"method": "medusa", "medusa": {"recurrent": True}},
        "medusa_indep": {"method": "medusa", "medusa": {"recurrent": False}},
        "lora": {"method": "draft_lm", "draft_lm": {"num_layers": 2, "lora_rank": 16, "lora_alpha": 32}, "lr": 1e-3},
        "draft_lm": {"method": "draft_lm", "draft_lm": {"num_layers": 2, "lora_rank": 0}, "lr": 3e-4},
        "self_spec": {"method": "self_spec", "self_spec": {"num_layers": 6, "adapter_rank": 128}, "lr": 1e-2},
        "int8": {"method": "int8"}}
    assert all(v in METHODS[over["method"]].variants for v, over in variants().items())
    with pytest.raises(compare.CompareError, match="warp") as e:
        compare.check_choices(["eagle", "warp"], ["fkl"])
    assert all(v in str(e.value) for v in variants())
    with pytest.raises(compare.CompareError, match=r"\['kl'\].*" + ".*".join(compare.DIVERGENCES)):
        compare.check_choices(["eagle"], ["kl"])


def test_compare_cache_files_written_before_still_read(tmp_path, monkeypatch):
    """compare/<name>-k<K>.json as compare wrote it before it shared evaluate's cache (on avx512-bf16, before the
    CPU path was keyed): {"key": {src, k, evaluate, serving, files}, "row": ...}."""
    import types

    import pipeline.measure as measure
    from eval.decoder import SERVING_REV
    from pipeline.measure import MeasurementCache

    monkeypatch.setattr(measure, "cpu_path", lambda: types.SimpleNamespace(name="avx512-bf16"))
    key = {"src": "ngram", "k": 4, "evaluate": {"k": 2}, "serving": SERVING_REV, "files": []}
    (tmp_path / "ngram-k4.json").write_text(json.dumps({"key": key, "row": {"name": "ngram", "k": 4}}))
    cache = MeasurementCache(tmp_path, {"evaluate": {"k": 2}})
    assert cache.read("ngram-k4", "ngram", {"src": "ngram", "k": 4})["row"] == {"name": "ngram", "k": 4}
    assert cache.read("ngram-k4", "ngram", {"src": "ngram", "k": 8}) is None


def test_compare_reuses_the_distills_target_features(tiny_target, tmp_path):  # noqa: F811
    """A compare on a distilled run links the train stage's feature cache instead of recomputing it,
    and recomputes (into the variant's own file, the run's untouched) when its key does not match. The run's
    method trains on no features (draft_lm), so its shards hold none (with medusa they would, and no cache
    is written at all: test_compare_trains_on_the_shards_features)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    args = ["compare", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={tmp_path}", "wandb.mode=disabled", *TINY_BUDGET, "train.method=draft_lm",
            "--methods", "medusa", "--divergences", "fkl", "--no-raw", "--steps", "1"]
    assert main(args) == 0
    run = (tmp_path / "code" / "latest").resolve()
    # Stand in for a distill's train stage: its features where `distill` leaves them, no compare yet.
    (run / "train").mkdir()
    (run / "compare" / "features-generated.safetensors").rename(run / "train" / "features.safetensors")
    shutil.rmtree(run / "compare")
    distilled = run / "train" / "features.safetensors"
    ino, mtime = distilled.stat().st_ino, distilled.stat().st_mtime_ns
    assert main(args) == 0
    variant = run / "compare" / "medusa-fkl" / "train" / "features.safetensors"
    assert variant.stat().st_ino == ino and distilled.stat().st_mtime_ns == mtime  # linked, not recomputed

    # A stale cache (another key): the variant recomputes its own, the distill's file is left as it was.
    with safe_open(str(distilled), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(distilled), metadata={"key": "stale"})
    shutil.rmtree(run / "compare")
    assert main(args) == 0
    assert variant.stat().st_ino != distilled.stat().st_ino
    with safe_open(str(distilled), "pt") as f:
        assert f.metadata()["key"] == "stale"


def test_compare_trains_on_the_shards_features(tiny_target, tmp_path):  # noqa: F811
    """With a method that trains on final-norm features (medusa, the recipe's), generate keeps them in its
    shards and every variant trains on those: no teacher-forced pass, no feature cache written."""
    from pipeline.shards import shard_features

    args = ["compare", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={tmp_path}", "wandb.mode=disabled", *TINY_BUDGET, "--methods", "medusa,eagle",
            "--divergences", "fkl", "--no-raw", "--steps", "1"]
    assert main(args) == 0
    run = (tmp_path / "code" / "latest").resolve()
    assert shard_features(run / "generate") is not None
    assert not [p for p in run.rglob("features*.safetensors") if p.parent.parent.name != "generate"]


def test_compare_measures_the_lift_at_its_own_steps_and_prompts(tiny_target, tmp_path):  # noqa: F811
    """--lift-steps / --lift-prompts: both arms of the distillation lift (generated vs raw text) are
    variants of their own at those steps, judged on that many prompts, and the lift is their τ ratio;
    the table's own variants keep --steps. A rerun reads every arm back."""
    base = ["compare", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
            f"runs_dir={tmp_path}", "wandb.mode=disabled", *TINY_BUDGET, "--methods", "medusa",
            "--divergences", "fkl"]
    assert main(base + ["--lift-steps", "0"]) == 2  # a one-line error before anything loads
    assert not (tmp_path / "code").exists()
    args = base + ["--steps", "1", "--lift-steps", "3", "--lift-prompts", "3"]
    assert main(args) == 0
    run = (tmp_path / "code" / "latest").resolve()
    out = json.loads((run / "compare" / "compare.json").read_text())
    dist, raw = out["lift"]["distilled"], out["raw_baseline"]
    assert (dist["name"], raw["name"]) == ("medusa-fkl-s3-p3", "medusa-fkl-raw-s3-p3")
    assert (dist["data"], raw["data"]) == ("generated", "raw") and dist["steps"] == raw["steps"] == 3
    assert out["methods"][0]["steps"] == 1  # the table's variant keeps --steps
    for name in (dist["name"], raw["name"]):
        assert json.loads((run / "compare" / name / "metrics.json").read_text())["n_prompts"] == 3
    assert out["lift"]["steps"] == 3 and out["lift"]["n_prompts"] == 3
    assert out["distillation_tau_lift"] == pytest.approx(dist["tau"] / raw["tau"] - 1)
    md = (run / "compare" / "compare.md").read_text()
    section = md.split("## Distillation vs raw domain text")[1].split("## K sweep")[0]
    assert "3 steps" in section and "3 held-out prompts" in section
    assert "| medusa-fkl-s3-p3 |" in section and "| medusa-fkl-raw-s3-p3 |" in section
    stamp = {p: p.stat().st_mtime for p in run.glob("compare/*/train/manifest.json")}
    assert main(args) == 0
    assert {p: p.stat().st_mtime for p in run.glob("compare/*/train/manifest.json")} == stamp
