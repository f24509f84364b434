"""Evaluate at the recipe's serving temperature: a tiny distill with evaluate.temperature=0.7 measures the
best checkpoint (bare and as a hybrid) and the n-gram baseline sampling at it, promotes by that speedup,
writes the sampled block of metrics.json from the same counters, shows both temperatures in the report,
and reads the sampled measurements back on a second evaluate. The default recipe keys stay as they were."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.config import load_recipe
from pipeline.options import RecipeError

from helpers import TINY_BUDGET, wandb_logged

# top_k=2 peaks the tiny random target's near-uniform distribution, so drafts get accepted at T=0.7.
SAMPLING = ["evaluate.temperature=0.7", "evaluate.top_p=0.9", "evaluate.top_k=2"]
# Fewer prompts, one checkpoint and two tree budgets keep the run small; the sampled step is under test.
SMALL = ["data.max_prompts=12", "train.steps=2", "train.save_every=2", "evaluate.tree_budgets=[4, 6]"]


def _args(stage, tiny_target, runs_dir, *extra) -> list[str]:
    return [stage, "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32", f"runs_dir={runs_dir}",
            *TINY_BUDGET, *SMALL, *SAMPLING, *extra]


@pytest.fixture(scope="module")
def sampled_run(tiny_target, tmp_path_factory):
    """One tiny distill served at T=0.7, top-p 0.9, top-k 2: the run directory."""
    runs = tmp_path_factory.mktemp("runs")
    assert main(_args("distill", tiny_target, runs, "wandb.mode=disabled")) == 0
    return (runs / "code" / "latest").resolve()


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _sampled_file(run: Path, name: str) -> dict:
    return json.loads((run / "eval" / f"{name}.sampled.json").read_text())


def test_sampled_block_is_the_counters_of_the_sampled_measurements(sampled_run):
    """metrics.json's sampled block holds the settings and, for the promoted draft and the n-gram baseline,
    figures computed from the counters of their eval/<name>.sampled.json: vLLM's mean acceptance length
    1 + accepted / drafts, draft acceptance rate accepted / proposed, acceptance at i accepted there / drafts."""
    m = _metrics(sampled_run)
    s = m["sampled"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["seed"], s["n_prompts"]) == (0.7, 0.9, 2, 0, 2)
    ck = m["checkpoints"][0]["name"]
    assert [c["name"] for c in s["candidates"]] == [ck, ck + "+ngram", ck + "+ngram-nostore", ck + "+ngram+sampled",
                                                    ck + "+ngram-nostore+sampled"]
    for block, name in ((s["draft"], s["draft"]["name"]), (s["ngram_baseline"], "ngram")):
        r = _sampled_file(sampled_run, name)
        st, hist = r["stats"], r["stats"]["accept_len_hist"]
        assert r["key"]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 2, "seed": 0}
        drafts = sum(hist)
        assert drafts > 0 and st["accepted"] == sum(j * n for j, n in enumerate(hist))
        assert block["mean_acceptance_length"] == 1 + st["accepted"] / drafts
        assert block["draft_acceptance_rate"] == st["accepted"] / st["proposed"]
        assert block["acceptance_per_pos"] == [sum(hist[i + 1:]) / drafts for i in range(len(hist) - 1)]
        assert (block["alpha"], block["tau"], block["speedup"]) == (st["alpha"], st["tau"], r["speedup"])
        assert block["speedup"] == st["tokens_per_s"] / r["plain_stats"]["tokens_per_s"]
    assert _sampled_file(sampled_run, "ngram")["stats"]["k"] == 8
    for hybrid in (c["name"] for c in s["candidates"][1:]):  # sampling verifies the hybrid's token trees too
        sampled = _sampled_file(sampled_run, hybrid)
        assert sampled["stats"]["tree_rounds"] > 0
        form = hybrid.removesuffix("+sampled")  # the same form with its model's chain sampled in the tree
        greedy = json.loads((sampled_run / "eval" / f"{form}.json").read_text())
        assert greedy["stats"]["tree_rounds"] > 0 and sampled["key"]["max_nodes"] == greedy["key"]["max_nodes"]
        assert sampled["key"].get("sampled_chain", False) is hybrid.endswith("+sampled") is sampled["sampled_chain"]


def test_promoted_by_its_speedup_at_the_serving_temperature(sampled_run):
    """The recipe serves at T=0.7, so the candidate with the best sampled speedup is promoted (each served
    form measured at it: the hybrid with and without its datastore verify different trees, each with its
    model's branches deterministic or its chain sampled), and best/ serves as that measurement did; its
    greedy output is still checked exact in fp32."""
    m = _metrics(sampled_run)
    s = m["sampled"]
    by_t = {c["name"]: c["speedup"] for c in s["candidates"]}
    pool = [c for c in m["checkpoints"] if c["name"] in by_t]
    assert len(pool) == 3  # the checkpoint, its hybrid, the hybrid without datastore

    def fastest(c):  # its fastest sampled twin: (speedup, name)
        return max((by_t[n], n) for n in (c["name"], c["name"] + "+sampled") if n in by_t)
    best = max(pool, key=lambda c: (fastest(c)[0], c["speedup"]))
    assert m["promoted_by"] == "sampled" and m["checkpoint"] == best["name"]
    assert s["draft"]["name"] == fastest(best)[1]
    sampled_chain = s["draft"]["name"].endswith("+sampled")
    assert m["sampled_chain"] is sampled_chain
    serve = json.loads((sampled_run / "best" / "draftsmith_draft.json").read_text()).get("serve", {})
    assert serve.get("sampled_chain", False) is sampled_chain
    assert m["fp32_exact"] is True and m["greedy_exact"] is True
    # the gate admitted it on the same sampled measurements, paired with the sampled n-gram baseline's
    gate = json.loads((sampled_run / "gate.json").read_text())["figures"]
    assert gate["challenger"]["name"] == s["draft"]["name"] and gate["challenger"]["speedup"] == s["draft"]["speedup"]
    assert gate["ngram"]["speedup"] == s["ngram_baseline"]["speedup"]


def test_report_gives_both_temperatures_for_the_draft_and_the_baseline(sampled_run):
    m = _metrics(sampled_run)
    s, b, bs = m["sampled"], m["ngram_baseline"], m["sampled"]["ngram_baseline"]
    report = (sampled_run / "report.md").read_text()
    assert "## Greedy and at the serving temperature (T=0.7, top-p 0.9, top-k 2)" in report
    assert (f"| promoted `{m['checkpoint']}` | 0 | {m['alpha']:.3f} | {m['tau']:.2f} | "
            f"{m['mean_acceptance_length']:.2f} | {m['speedup']:.2f}× |") in report
    d = s["draft"]
    assert (f"| promoted `{d['name']}` | 0.7 | {d['alpha']:.3f} | {d['tau']:.2f} | "
            f"{d['mean_acceptance_length']:.2f} | {d['speedup']:.2f}× |") in report
    assert f"| n-gram baseline | 0 | {b['alpha']:.3f} | {b['tau']:.2f} |" in report
    assert (f"| n-gram baseline | 0.7 | {bs['alpha']:.3f} | {bs['tau']:.2f} | "
            f"{bs['mean_acceptance_length']:.2f} | {bs['speedup']:.2f}× |") in report
    assert "## Data" not in report  # no data.json in this run


def test_tree_budget_fitted_at_the_serving_temperature(sampled_run):
    """The budget is replayed along the target's text sampled as served (eval.replay.fit_budget), and the
    report says so."""
    fit = json.loads(next((sampled_run / "eval").glob("*.tree-budget.json")).read_text())
    assert fit["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 2, "seed": 0}
    assert fit["key"]["sampling"] == fit["sampling"]
    m = _metrics(sampled_run)
    said = f"replayed on {fit['n_prompts']} {fit['prompts']} prompts sampled at T=0.7 with its measured"
    if m["tree_budget_fit"] is not None:  # a hybrid was promoted: its fit is reported
        assert m["tree_budget_fit"]["sampling"] == fit["sampling"]
        assert said in (sampled_run / "report.md").read_text()
    else:  # the bare checkpoint won: no tree served, no fit claimed
        assert "+ngram" not in m["draft_method"] and said not in (sampled_run / "report.md").read_text()


def test_evaluate_again_reads_the_sampled_measurements_back(sampled_run, tiny_target, monkeypatch):
    """A second evaluate (W&B offline) measures nothing (greedy and sampled results are read back), writes
    the same metrics.json, and its W&B run records each sampled candidate's figures under eval/sampled/
    and the promoted draft's in the summary as sampled/<figure>."""
    import pipeline.evaluate as evaluate

    before = _metrics(sampled_run)

    def measured(*a, **kw):
        raise AssertionError("a cached candidate was measured again")

    monkeypatch.setattr(evaluate, "decode_together", measured)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = _args("evaluate", tiny_target, sampled_run.parent.parent, "wandb.mode=offline", "--run-id", sampled_run.name)
    assert main(args) == 0
    assert _metrics(sampled_run) == before
    logged = {}  # the values the offline run files hold, compared with metrics.json's
    for f in sorted(sampled_run.glob("wandb/offline-run-*/run-*.wandb")):
        logged |= wandb_logged(f)
    s = before["sampled"]
    keys = ("alpha", "tau", "speedup", "mean_acceptance_length", "draft_acceptance_rate")
    for c in s["candidates"] + [s["ngram_baseline"]]:
        for key in keys:
            assert logged[f"eval/sampled/{c['name']}/{key}"] == pytest.approx(c[key]), (c["name"], key)
    assert logged["sampled/temperature"] == s["temperature"] == 0.7
    assert logged["sampled/ngram_speedup"] == pytest.approx(s["ngram_baseline"]["speedup"])
    if s["draft"]:
        assert logged["sampled/speedup"] == pytest.approx(s["draft"]["speedup"])
        assert logged["sampled/mean_acceptance_length"] == pytest.approx(s["draft"]["mean_acceptance_length"])


def test_data_section_from_data_json(sampled_run, tmp_path):
    """The report's Data section reads data.json as pipeline/synth.py writes it."""
    from pipeline.report import write_report

    run = tmp_path / "run"
    shutil.copytree(sampled_run, run, symlinks=True)
    (run / "data.json").write_text(json.dumps({
        "source": "self", "method": "magpie", "system": "JSON only.", "seeds": ["Give me"],
        "train": {"sampled": 130, "truncated": 7, "duplicate": 3}, "heldout": {"sampled": 17, "short": 1},
        "n_train_requests": 120, "n_heldout_requests": 16, "json_parse_rate": 0.875, "json_checked": 120}))
    report = write_report(run).read_text()
    assert ("- system prompt: 'JSON only.'\n- request beginnings: 'Give me'\n"
            "- training requests: 120 kept of 130 sampled (dropped: truncated 7, duplicate 3)\n"
            "- held-out requests: 16 kept of 17 sampled (dropped: short 1)\n"
            "- the target's answers that hold valid JSON: 87.5% of 120") in report
    (run / "data.json").write_text(json.dumps({"source": "self", "n_train_requests": 5, "n_heldout_requests": 2,
                                               "train": {"sampled": 5}, "heldout": {"sampled": 2}}))
    report = write_report(run).read_text()
    assert "(dropped: none)" in report and "valid JSON" not in report


def test_default_recipe_keys_unchanged_and_greedy_keys_ignore_sampling():
    """At their defaults the sampling keys leave the recipe hash and train_key as they were; set, they
    change the recipe hash but neither the train key nor the greedy measurements' key."""
    from pipeline.measure import evaluate_settings

    default = load_recipe(domain="code")
    assert (default.hash(), default.train_key()) == ("6e56496bbbb8a0a8", "a9bc2e49f74e318f")
    served = load_recipe(domain="code", overrides=SAMPLING)
    assert served.hash() != default.hash() and served.train_key() == default.train_key()
    assert evaluate_settings(served) == evaluate_settings(default)  # greedy results of a run are read back


@pytest.mark.parametrize("overrides, message", [
    (["evaluate.top_p=0.9"], "evaluate.temperature=0 .greedy. never does"),
    (["evaluate.temperature=0.7", "evaluate.top_p=0"], r"evaluate.top_p=0.0 must be in \(0, 1\]"),
    (["evaluate.temperature=-1"], "evaluate.temperature=-1.0 must be >= 0"),
    (["evaluate.temperature=0.7", "evaluate.top_k=-2"], "evaluate.top_k=-2 must be >= 0"),
])
def test_sampling_settings_are_checked(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(domain="code", overrides=overrides)


def test_pick_best_promotes_by_the_sampled_speedup():
    """Greedy, the hybrid is faster (its token trees); sampled, the bare checkpoint is: at a serving
    temperature the bare one is promoted. A form with no sampled measurement is not promoted."""
    from pipeline.evaluate import pick_best

    ck = "/r/train/checkpoint-000002"
    results = [{"name": "c", "source": ck, "speedup": 1.2}, {"name": "c+ngram", "source": f"hybrid:{ck}", "speedup": 1.9},
               {"name": "c+ngram-nostore", "source": f"hybrid-nostore:{ck}", "speedup": 1.8}]
    sampled = {"c": {"name": "c", "source": ck, "speedup": 1.3},
               "c+ngram": {"name": "c+ngram", "source": f"hybrid:{ck}", "speedup": 1.1},
               "ngram": {"name": "ngram", "source": "ngram", "speedup": 1.5}}
    assert pick_best(results, "draftsmith")["name"] == "c+ngram"
    assert pick_best(results, "draftsmith", sampled)["name"] == "c"
    sampled["c+ngram"]["speedup"] = 1.4
    assert pick_best(results, "draftsmith", sampled)["name"] == "c+ngram"  # the tie: greedy decides


def test_sampled_decoding_draws_each_prompt_with_its_seed():
    """Sampled decode_together: on prompt i every decoder draws with seed + i, so the plain run equals a
    plain run of its own with that seed, and a second measurement draws the same samples."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eval.decoder import SpeculativeDecoder
    from eval.proposers import NgramProposer
    from pipeline.measure import decode_together

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    target = LlamaForCausalLM(cfg).float().eval()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5]]
    sampling = {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": 5}
    plain, _, outs = decode_together(target, {"ngram": (NgramProposer(), 4)}, prompts, 10, None, "t",
                                     sampling=sampling)
    alone = [SpeculativeDecoder(target, None).generate([p], max_new_tokens=10, temperature=0.8, top_p=0.9,
                                                       seed=5 + i).sequences[0] for i, p in enumerate(prompts)]
    assert plain == alone
    again = decode_together(target, {"ngram": (NgramProposer(), 4)}, prompts, 10, None, "t", sampling=sampling)
    assert again[0] == plain and again[2]["ngram"][0] == outs["ngram"][0]
    greedy = decode_together(target, {}, prompts, 10, None, "t")[0]
    assert greedy != plain  # sampled, not greedy
