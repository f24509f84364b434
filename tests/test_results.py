"""pipeline.results: docs/results.md and README's headline are rendered from docs/results/*.json."""

import json
from pathlib import Path

import pytest

from pipeline import results

ROOT = Path(__file__).resolve().parents[1]

DISTILL = {
    "kind": "distill", "title": "a tiny distill", "command": "make distill DOMAIN=code",
    "machine": "box", "date": "2026-01-02", "commit": "abc1234", "serving_rev": "rev-1", "headline": True,
    "figures": {"wall_s": 125, "promoted": "medusa+ngram", "speedup": 2.0, "tau": 3.5, "alpha": 0.5,
                "tokens_per_s_plain": 80.0, "ngram_speedup": 1.6, "max_nodes": 4},
}
MACHINES = {"box": {"short": "a test box", "description": "two cores, no GPU"}}


def _write(d: Path, name: str, obj) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(obj))


def test_renders_a_distill_result(tmp_path):
    _write(tmp_path, "2026-01-02-distill-tiny.json", DISTILL)
    _write(tmp_path, "machines.json", MACHINES)
    page = results.render(tmp_path)
    assert ("| 2026-01-02-distill-tiny | code | 2026-01-02 | `box` | 2 min 05 s | medusa+ngram | 2.00× | 3.50 | 0.500 | "
            "80.0 | 1.60× | 1.25× | 4 |") in page
    assert "| a tiny distill | `make distill DOMAIN=code` | a test box | 2.00× | 3.50 | 1.60× | 2026-01-02 |" in page
    assert "commit `abc1234` · serving revision `rev-1`" in page
    assert "do not edit" in page
    assert "- `box` (a test box): two cores, no GPU" in page


def test_a_result_without_its_provenance_is_refused(tmp_path):
    _write(tmp_path, "bad.json", {k: v for k, v in DISTILL.items() if k != "commit"})
    with pytest.raises(results.ResultsError, match="bad.json: missing commit"):
        results.load_results(tmp_path)


def test_run_imports_metrics_and_renders(tmp_path):
    run = tmp_path / "runs" / "code" / "20260103-120000"
    _write(run, "metrics.json", {
        "domain": "code", "target": "embedded:smollm2-135m-instruct", "draft_method": "medusa+ngram",
        "checkpoint": "checkpoint-000900", "k": 2, "alpha": 0.62, "tau": 4.03, "speedup": 2.04,
        "tokens_per_s_plain": 83.7, "max_nodes": 6, "n_prompts": 16, "ngram_k": 8,
        "ngram_baseline": {"speedup": 1.82, "tau": 2.5}, "checkpoints": [{"name": "checkpoint-000900", "tau": 1.49,
                                                                          "speedup": 1.2, "alpha": 0.3}]})
    _write(run / "train", "manifest.json", {"steps": 900, "n_sequences": 2156, "tokens_per_s": 1900.0})
    docs = tmp_path / "docs"
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{results.HEADLINE_START}\nold\n{results.HEADLINE_END}\nrest\n")
    rc = results.main(["--run", str(run), "--machine", "box", "--wall", "32m06s", "--commit", "def5678",
                       "--serving-rev", "rev-2", "--headline", "--results-dir", str(docs / "results"),
                       "--out", str(docs / "results.md"), "--readme", str(readme)])
    assert rc == 0
    rec = json.loads((docs / "results" / "2026-01-03-distill-20260103-120000.json").read_text())
    assert rec["command"] == "draftsmith distill --domain code --run-id 20260103-120000"
    assert (rec["commit"], rec["serving_rev"], rec["date"]) == ("def5678", "rev-2", "2026-01-03")
    f = rec["figures"]
    assert (f["wall_s"], f["speedup"], f["tau"], f["ngram_speedup"], f["max_nodes"], f["train_steps"]) == \
        (1926, 2.04, 4.03, 1.82, 6, 900)
    assert f["checkpoints"] == [{"name": "checkpoint-000900", "tau": 1.49, "speedup": 1.2}]
    page = (docs / "results.md").read_text()
    assert "| 2026-01-03-distill-20260103-120000 | code | 2026-01-03 | `box` | 32 min 06 s | medusa+ngram | 2.04× |" in page
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{results.HEADLINE_END}\nrest\n")
    assert "**2.04×** plain decoding's speed (prompt lookup alone 1.82×), τ 4.03: `" in text  # the one line
    assert "| distill of domain code, run 20260103-120000 |" in page  # the table stays in docs/results.md
    assert results.main(["--check", "--results-dir", str(docs / "results"), "--out", str(docs / "results.md"),
                         "--readme", str(readme)]) == 0


def test_bench_import_takes_every_row(tmp_path):
    bench = {"draft": "ngram", "n_prompts": 4, "k_arg": "8", "also": ["hybrid:d@2"],
             "plain": {"tokens_per_s": 50.0, "speedup": 1.0, "match_rate": 1.0},
             "hf_generate": {"tokens_per_s": 20.0, "speedup": 0.4},
             "speculative": {"tokens_per_s": 80.0, "speedup": 1.6, "tau": 2.1, "alpha": 0.4, "k": 8},
             "hybrid:d@2": {"tokens_per_s": 100.0, "speedup": 2.0, "tau": 3.0, "k": 2}}
    rec = results.bench_record(bench, "box", commit="abc", serving_rev="r", date="2026-01-04")
    assert [r["method"] for r in rec["figures"]["rows"]] == ["plain", "hf_generate", "speculative", "hybrid:d@2"]
    assert rec["command"] == "draftsmith bench --draft ngram --n-prompts 4 --k 8 --also hybrid:d@2"
    assert results.render_bench({**rec, "id": "x"}, {}).splitlines()[-1] == "| hybrid:d@2 | 100.0 | 2.00× | 3.00 | – | 2 | – |"
    # a batch sweep: plain, fixed K and the controller, one row per batch size
    bench["batch_sweep"] = {"rows": [{"batch_size": 16, "plain_tokens_per_s": 300.0, "speculative_tokens_per_s": 250.0,
                                      "speedup": 0.8333, "tau": 2.2, "k": 8, "controlled_tokens_per_s": 303.0,
                                      "controlled_speedup": 1.01, "controlled_tau": 1.1, "controlled_k": 1.0,
                                      "controlled_spec_off_fraction": 0.9}]}
    rec = results.bench_record(bench, "box", commit="abc", serving_rev="r", date="2026-01-04")
    assert results.render_bench({**rec, "id": "x"}, {}).splitlines()[-1] == \
        "| 16 | 300.0 | 250.0 | 0.83× | 2.20 | 303.0 | 1.01× | 1.0 | 0.90 | – / – |"
    # with each turn's own ratio kept, the cell gives their range (the batches' text and the drift between calls)
    bench["batch_sweep"]["rows"][0] |= {"speedup_turns": [0.8, 0.87, 0.83], "controlled_speedup_turns": [0.95, 1.08]}
    rec = results.bench_record(bench, "box", commit="abc", serving_rev="r", date="2026-01-04")
    assert results.render_bench({**rec, "id": "x"}, {}).splitlines()[-1] == \
        "| 16 | 300.0 | 250.0 | 0.83× (0.80–0.87) | 2.20 | 303.0 | 1.01× (0.95–1.08) | 1.0 | 0.90 | – / – |"
    # greedy: how much of each output matched plain decoding's (a result from before the rate was kept: same or not)
    bench["batch_sweep"]["rows"][0] |= {"same_tokens": False, "match_rate": 0.9312, "controlled_same_tokens": True,
                                        "controlled_match_rate": 1.0}
    rec = results.bench_record(bench, "box", commit="abc", serving_rev="r", date="2026-01-04")
    assert results.render_bench({**rec, "id": "x"}, {}).splitlines()[-1].endswith("| 0.931 / 1.000 |")
    for r in rec["figures"]["batch_sweep"]:
        r.pop("match_rate"), r.pop("controlled_match_rate")
    assert results.render_bench({**rec, "id": "x"}, {}).splitlines()[-1].endswith("| differs / 1.000 |")
    # a `--k auto` bench: its speculative decoder is the controller, so its sweep fills the controller's columns
    auto = {**bench, "k_arg": "auto", "speculative": {**bench["speculative"], "k": 3.3777},
            "batch_sweep": {"rows": [{"batch_size": 16, "plain_tokens_per_s": 226.3, "speculative_tokens_per_s": 196.6,
                                      "speedup": 0.8687, "tau": 1.04, "k": 1.1667, "spec_off_fraction": 0.949,
                                      "speedup_turns": [0.96, 0.74, 0.94], "same_tokens": True, "match_rate": 1.0}]}}
    lines = results.render_bench({**results.bench_record(auto, "box", commit="abc", serving_rev="r",
                                                         date="2026-01-04"), "id": "x"}, {}).splitlines()
    assert lines[-1] == "| 16 | 226.3 | – | – | – | 196.6 | 0.87× (0.74–0.96) | 1.2 | 0.95 | – / 1.000 |"
    assert "| speculative | 80.0 | 1.60× | 2.10 | 0.400 | 3.4 | – |" in lines


def test_parse_wall():
    assert results.parse_wall("55m16s") == 3316
    assert results.parse_wall("90") == 90
    with pytest.raises(results.ResultsError, match="--wall"):
        results.parse_wall("soon")


def test_the_committed_pages_are_what_the_result_files_render():
    """docs/results.md and README's headline are generated: edit docs/results/*.json and run
    `python -m pipeline.results`, never the markdown."""
    assert (ROOT / "docs" / "results.md").read_text() == results.render(ROOT / "docs" / "results")
    readme = (ROOT / "README.md").read_text()
    table = results.render_readme_line(results.load_results(ROOT / "docs" / "results"),
                                    results.load_machines(ROOT / "docs" / "results"))
    assert readme == results.with_headline(readme, table)


def test_compare_import_takes_its_tables(tmp_path):
    run = tmp_path / "runs" / "code" / "20260105-000000"
    row = {"name": "medusa-fkl", "alpha": 0.2, "tau": 1.3, "c": 0.06, "k": 2, "speedup": 1.08,
           "train_tokens_per_s": 1900.0}
    _write(run / "compare", "compare.json", {
        "methods": [row], "divergences": [row], "best_method": "medusa", "served": "hybrid",
        "raw_baseline": {**row, "name": "medusa-fkl-raw", "tau": 1.1}, "lift": {"steps": 9, "n_prompts": 4,
                                                                               "distilled": row},
        "k_sweep": [{**row, "name": "hybrid@k", "k": 3, "speedup": 2.3}], "n_prompts": 4, "steps": 2,
        "distillation_tau_lift": 0.18, "best_measured": {"speedup": 2.3, "tau": 4.3, "ngram_speedup": 2.05}})
    rec = results.compare_record(run / "compare" / "compare.json", "box", commit="abc", serving_rev="r")
    assert rec["command"] == "draftsmith compare --domain code --run-id 20260105-000000"
    assert list(rec["figures"]["tables"]) == ["Methods", "Divergences on medusa",
                                              "Distillation against raw domain text (9 steps, 4 prompts)",
                                              "K sweep on hybrid"]
    md = results.render_compare({**rec, "id": "x"}, {})
    assert "| medusa-fkl | 0.200 | 1.30 | 0.060 | 2 | 1.08× | 1,900 |" in md
    assert "| hybrid, K=3 | 0.200 | 1.30 | 0.060 | 3 | 2.30× | 1,900 |" in md


def test_run_import_reads_the_wall_time_distill_recorded(tmp_path):
    run = tmp_path / "20260106-000000"
    _write(run, "metrics.json", {"draft_method": "ngram", "speedup": 1.5, "tau": 2.0, "alpha": 0.4})
    _write(run, "status.json", {"complete": True, "wall_s": 1234.5})
    rec = results.run_record(run, "box", commit="abc", serving_rev="r")
    assert rec["figures"]["wall_s"] == 1234.5
    assert results.run_record(run, "box", wall_s=60.0, commit="abc", serving_rev="r")["figures"]["wall_s"] == 60.0
    # no --serving-rev: the revision its promoted figures were measured under (its eval result's key), not this
    # checkout's
    _write(run, "metrics.json", {"draft_method": "ngram", "speedup": 1.5, "tau": 2.0, "alpha": 0.4,
                                 "checkpoint": "checkpoint-000004+ngram"})
    _write(run / "eval", "checkpoint-000004+ngram.json", {"key": {"serving": "older-rev-1"}})
    assert results.run_record(run, "box", commit="abc")["serving_rev"] == "older-rev-1"


def test_a_run_evaluated_at_its_serving_temperature_carries_the_sampled_speedup(tmp_path):
    """A run with metrics.json's sampled block imports its speedup, τ and the n-gram's at the serving
    temperature, and the distill table gains those columns; runs served greedy show '–' there."""
    run = tmp_path / "20260107-000000"
    _write(run, "metrics.json", {
        "draft_method": "eagle3", "speedup": 1.9, "tau": 3.1, "alpha": 0.6, "ngram_baseline": {"speedup": 1.2},
        "sampled": {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "draft": {"speedup": 1.4, "tau": 2.2, "alpha": 0.5,
                                                                              "mean_acceptance_length": 2.4},
                    "ngram_baseline": {"speedup": 1.05}}})
    rec = results.run_record(run, "box", commit="abc", serving_rev="r")
    f = rec["figures"]
    assert (f["temperature"], f["top_p"], f["sampled_speedup"], f["sampled_tau"], f["ngram_sampled_speedup"]) == \
        (0.7, 0.9, 1.4, 2.2, 1.05)
    _write(tmp_path / "docs", "2026-01-07-distill-chat.json", rec)
    _write(tmp_path / "docs", "2026-01-02-distill-tiny.json", DISTILL)
    page = results.render(tmp_path / "docs")
    assert "| n-gram | vs n-gram | tree nodes | speedup sampled | τ sampled | n-gram sampled |" in page
    assert "| 1.20× | 1.58× | – | 1.40× (T=0.7 p=0.9) | 2.20 | 1.05× |" in page
    assert "| 1.60× | 1.25× | 4 | – | – | – |" in page
    assert "speedup sampled" not in results.render_distills([dict(DISTILL, id="x")], {})


def test_a_result_file_that_is_not_json_is_one_line(tmp_path):
    """A hand-edited result file cut short: a ResultsError naming the file, not a JSONDecodeError traceback."""
    from pipeline.results import ResultsError, load_results

    (tmp_path / "2026-12-03-cut.json").write_text('{"kind": "bench", ')
    with pytest.raises(ResultsError, match="2026-12-03-cut.json: not JSON"):
        load_results(tmp_path)


def test_each_result_names_the_conditions_it_was_measured_under(tmp_path):
    """A result's conditions come from its figures (a bench JSON's batch sizes, new tokens, temperature, dtype), or
    for a file from before they were kept, from its command: never one sentence claiming the same for all."""
    bench = {"draft": "ngram", "n_prompts": 8, "k_arg": "2", "max_new_tokens": 64, "temperature": 0.7,
             "dtype": "float32", "batch_size": 1, "target": "embedded",
             "plain": {"tokens_per_s": 50.0, "speedup": 1.0}, "speculative": {"tokens_per_s": 80.0, "speedup": 1.6}}
    rec = results.bench_record(bench, "box", commit="abc", serving_rev="r", date="2026-01-04")
    assert results.conditions(rec) == "batch 1, 64 new tokens, float32, 8 prompts, T = 0.7"
    bench |= {"temperature": 0.0, "dtype": "bfloat16", "target": "/models/mine",
              "batch_sweep": {"rows": [{"batch_size": b} for b in (1, 4, 16)]}}
    rec = results.bench_record(bench, "box", commit="abc", serving_rev="r", date="2026-01-04")
    assert results.conditions(rec) == "batch 1/4/16, 64 new tokens, bfloat16, 8 prompts, target /models/mine, greedy"
    assert results.conditions(rec) in results.render_bench({**rec, "id": "x"}, {})
    old = {"kind": "bench", "command": "draftsmith bench --draft d --max-new-tokens 32 --temperature 1.0",
           "figures": {"n_prompts": 4, "max_new_tokens": 32}, "target": "embedded"}  # before the figures were kept
    assert results.conditions(old) == "batch 1, 32 new tokens, bfloat16, 4 prompts, T = 1"
    run = {"kind": "distill", "command": "make distill DOMAIN=chat", "target": "embedded",
           "figures": {"n_prompts": 16, "temperature": 0.7}}
    assert results.conditions(run) == "batch 1, 128 new tokens, bfloat16, 16 prompts, greedy; the sampled columns at T = 0.7"
