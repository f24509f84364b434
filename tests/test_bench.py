"""eval/bench.py on tiny random Llama models with a tiny word-level tokenizer (no network, seconds)."""

from __future__ import annotations

import json

import pytest

from eval import bench

from helpers import save_word_llama as _model, word_tokenizer as _tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    tok = _tokenizer()
    target = _model(root / "target", tok, layers=2, seed=0)
    draft = _model(root / "draft", tok, layers=1, seed=1, kind="draft_lm")
    bad = _model(root / "bad_draft", _tokenizer(extra_word="zz"), layers=1, seed=2, kind="draft_lm")
    prompts = root / "prompts.jsonl"
    lines = [{"prompt": "w1 w2 w3 w4 w1 w2 w3"}, {"prompt": "w5 w6 w7"},
             {"messages": [{"role": "user", "content": "w8 w9 w8 w9"}]}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return {"root": root, "target": str(target), "draft": str(draft), "bad_draft": str(bad),
            "prompts": str(prompts)}


def _run(tiny, tmp_path, *extra):
    out = tmp_path / "out.json"
    rc = bench.main(["--target", tiny["target"], "--prompts", tiny["prompts"], "--max-new-tokens", "8",
                     "--dtype", "float32", "--json", str(out), *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


REQUIRED = ["device", "dtype", "torch", "transformers", "n_prompts", "max_new_tokens", "cpu_threads",
            "greedy_exact", "exactness", "token_match_rate"]
SPEC_KEYS = ["tokens_per_s", "alpha", "tau", "k", "c", "predicted_speedup", "accept_per_pos"]


def test_ngram_writes_required_keys(tiny, tmp_path, capsys):
    rc, res = _run(tiny, tmp_path, "--draft", "ngram", "--batch-sweep", "1,2")
    assert rc == 0
    for key in REQUIRED:
        assert key in res, key
    for m in ("plain", "hf_generate", "hf_prompt_lookup"):
        assert res[m]["tokens_per_s"] > 0
    assert "hf_assisted" not in res
    for key in SPEC_KEYS:
        assert key in res["speculative"], key
    assert res["n_prompts"] == 3 and res["max_new_tokens"] == 8
    assert res["greedy_exact"] is True  # float32: exact match with plain
    assert res["exactness"]["exact_match"] is True
    # HF greedy and prompt lookup are greedy too: same tokens as our plain decoder in fp32
    assert res["token_match_rate"]["hf_generate"] == 1.0
    assert res["token_match_rate"]["hf_prompt_lookup"] == 1.0
    sweep = res["batch_sweep"]
    assert [r["batch_size"] for r in sweep["rows"]] == [1, 2]
    # 3 prompts: batch 2 cycles them to 6 sequences, so that each method runs --sweep-turns (3) batches there too
    assert [r["n_sequences"] for r in sweep["rows"]] == [3, 6]
    assert all(r["plain_tokens_per_s"] > 0 and r["speculative_tokens_per_s"] > 0 for r in sweep["rows"])
    # the K controller in the same turns, beside the fixed K
    assert all(r["controlled_tokens_per_s"] > 0 and 0 <= r["controlled_spec_off_fraction"] <= 1 for r in sweep["rows"])
    assert sweep["markdown"].startswith("| batch |") and "controller speedup" in sweep["markdown"]
    # each turn's own ratio over plain's (the same batch): 3 turns, and the exact greedy outputs make the sweep's
    # ratio their time-weighted mean, so it lies in their range, which the table shows
    for r in sweep["rows"]:
        for key in ("speedup", "controlled_speedup"):
            turns = r[f"{key}_turns"]
            assert len(turns) == 3 and min(turns) - 1e-9 <= r[key] <= max(turns) + 1e-9, (key, r)
    # float32 greedy: every batch size's outputs are plain decoding's, for the fixed K and the controller alike
    assert all(r["same_tokens"] is True and r["controlled_same_tokens"] is True for r in sweep["rows"])
    assert all(r["match_rate"] == 1.0 and r["controlled_match_rate"] == 1.0 for r in sweep["rows"])
    assert sweep["markdown"].splitlines()[-1].endswith("| 1.000 |") and "| controller match |" in sweep["markdown"]
    assert f"× ({min(sweep['rows'][0]['speedup_turns']):.2f}–" in sweep["markdown"]
    assert res["complete"] is True
    out = capsys.readouterr().out
    assert "speculative" in out and "hf_prompt_lookup" in out and out.count("| batch |") == 1


def test_a_run_stopped_part_way_keeps_what_it_measured(tiny, tmp_path, capsys, monkeypatch):
    """Stopped during the sweep's second batch size (a lent GPU's time ran out), --json already holds the
    main table and the first batch size, marked incomplete, and both were printed as they landed."""
    calls, measure = [], bench.Runner.measure

    def measure_then_stop(self, methods, prompts, turns=1):
        calls.append(len(calls))
        if len(calls) == 3:  # the main table, batch 1, then stopped
            raise KeyboardInterrupt
        return measure(self, methods, prompts, turns)
    monkeypatch.setattr(bench.Runner, "measure", measure_then_stop)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny, tmp_path, "--draft", "ngram", "--batch-sweep", "1,2")
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["complete"] is False and res["plain"]["tokens_per_s"] > 0 and res["table"]
    assert [r["batch_size"] for r in res["batch_sweep"]["rows"]] == [1]
    out = capsys.readouterr().out
    assert "hf_prompt_lookup" in out and "\n| 1 |" in out and "\n| 2 |" not in out
    assert not list(tmp_path.glob("*.tmp"))


def test_draft_lm_includes_hf_assisted(tiny, tmp_path):
    rc, res = _run(tiny, tmp_path, "--draft", tiny["draft"], "--k", "3", "--n-prompts", "2",
                   "--batch-size", "2")
    assert rc == 0
    assert res["draft_kind"] == "draft_lm" and res["n_prompts"] == 2
    assert res["hf_assisted"]["tokens_per_s"] > 0 and res["hf_assisted"]["k"] == 3
    assert res["token_match_rate"]["hf_assisted"] == 1.0  # assisted greedy is lossless
    assert "hf_prompt_lookup" not in res
    assert res["speculative"]["k"] == 3 and isinstance(res["speculative"]["k"], int)


def _err(capsys):
    """The one `draftsmith: error: ...` line a bad input prints (the last line of stderr)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("draftsmith: error: ") and sum(e.startswith("draftsmith: error: ") for e in err) == 1, err
    return err[-1]


def test_bad_inputs_fail_with_one_line(tiny, tmp_path, capsys):
    base = ["--target", tiny["target"], "--draft", "ngram"]
    assert bench.main(base + ["--prompts", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in _err(capsys)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert bench.main(base + ["--prompts", str(empty)]) == 2
    assert "is empty" in _err(capsys)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1"}\n{"prompt": \n')
    assert bench.main(base + ["--prompts", str(bad)]) == 2
    assert f"{bad}:2" in _err(capsys)

    assert bench.main(["--target", tiny["target"], "--draft", str(tmp_path / "no_draft"),
                       "--prompts", tiny["prompts"]]) == 2
    assert "does not exist" in _err(capsys)

    assert bench.main(["--target", tiny["target"], "--draft", tiny["bad_draft"],
                       "--prompts", tiny["prompts"]]) == 2
    line = _err(capsys)
    assert "tokenizer differs" in line

    ok = base + ["--prompts", tiny["prompts"]]
    for extra, msg in ((["--k", "0"], "--k must be >= 1"), (["--k", "two"], "--k must be a positive integer"),
                       (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
                       (["--batch-size", "0"], "--batch-size must be >= 1"),
                       (["--batch-sweep", "1,x"], "--batch-sweep must be comma-separated integers"),
                       (["--batch-sweep", "0"], "--batch-sweep needs positive batch sizes"),
                       (["--batch-sweep", "1", "--sweep-turns", "0"], "--sweep-turns must be >= 1"),
                       (["--set", "branches=2"], "--set branches=2: give KEY=VALUE with KEY one of max_nodes"),
                       (["--set", "max_nodes=0"], "max_nodes is a positive integer"),
                       (["--set", "sampled_chain=maybe"], "sampled_chain is true or false"),
                       (["--set", "sampled_chain=true"], "--set applies to a hybrid's trees; --draft ngram")):
        assert bench.main(ok + extra) == 2
        assert msg in _err(capsys)


def test_batches_cycle_the_prompts_to_fill_the_turns():
    p = [[1], [2], [3]]
    assert bench.cycled_batches(p, 2) == [[[1], [2]], [[3]]]  # enough for one turn: as given, the last batch short
    assert bench.cycled_batches(p, 2, turns=3) == [[[1], [2]], [[3], [1]], [[2], [3]]]
    assert bench.cycled_batches(p, 4) == [[[1], [2], [3], [1]]]  # fewer than one batch: cycled to fill it
    assert bench.cycled_batches(p, 1, turns=3) == [[[1]], [[2]], [[3]]]


def test_missing_draft_dir_message(tiny, tmp_path, capsys):
    assert bench.main(["--target", tiny["target"], "--draft", str(tmp_path / "no_draft"),
                       "--prompts", tiny["prompts"]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and err[0].startswith("draftsmith: error: ")


def test_match_rate_and_merge():
    assert bench.match_rate([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    merged = bench.merge_stats([{"alpha": 1.0, "accept_per_pos": [1.0, 1.0], "_n": 10},
                                 {"alpha": 0.0, "accept_per_pos": [0.0], "_n": 30}])
    assert merged["alpha"] == pytest.approx(0.25)
    assert merged["accept_per_pos"] == [pytest.approx(0.25), pytest.approx(1.0)]
    # with counts, rates come from the sums: a long repetitive output must not dominate τ
    merged = bench.merge_stats([{"tau": 8.0, "rounds": 10, "proposed": 40, "accepted": 35, "_n": 80},
                                 {"tau": 1.0, "rounds": 30, "proposed": 120, "accepted": 5, "_n": 30}])
    assert merged["tau"] == pytest.approx((80 + 30) / 40) and merged["alpha"] == pytest.approx(40 / 160)
    assert merged["rounds"] == 40 and merged["proposed"] == 160


def test_int8_and_head_drafts_bench_without_hf_comparisons(tiny, tmp_path):
    """Drafts HF cannot load as assistant_model (an int8 copy of the target, Medusa heads) still get
    plain / HF generate / speculative rows, exact in fp32."""
    from transformers import AutoModelForCausalLM

    from eval.heads import MedusaHeads

    rc, res = _run(tiny, tmp_path, "--draft", "int8", "--k", "2", "--n-prompts", "2")
    assert rc == 0 and res["draft_kind"] == "int8" and "hf_assisted" not in res
    assert res["speculative"]["tokens_per_s"] > 0 and res["exactness"]["exact_match"] is True
    heads = MedusaHeads.from_target(AutoModelForCausalLM.from_pretrained(tiny["target"]), num_heads=2)
    heads.save(tmp_path / "medusa")
    rc, res = _run(tiny, tmp_path, "--draft", str(tmp_path / "medusa"), "--k", "2", "--n-prompts", "2")
    assert rc == 0 and res["draft_kind"] == "medusa" and res["greedy_exact"] is True


def test_served_sources_bench_a_draft_with_its_datastore(tiny, tmp_path):
    """'hybrid:DIR', 'hybrid-nostore:DIR' and 'datastore:DIR' serve one draft directory three ways;
    each is exact in fp32, and a prefix over a non-draft directory is a one-line error."""
    from transformers import AutoModelForCausalLM

    from eval.datastore import Datastore
    from eval.heads import MedusaHeads

    heads = MedusaHeads.from_target(AutoModelForCausalLM.from_pretrained(tiny["target"]), num_heads=2)
    heads.save(tmp_path / "medusa")
    Datastore([[5, 6, 7, 8], [9, 10, 11]]).save(tmp_path / "medusa")
    for pre in ("hybrid", "hybrid-nostore", "datastore"):
        rc, res = _run(tiny, tmp_path, "--draft", f"{pre}:{tmp_path / 'medusa'}", "--k", "2", "--n-prompts", "2")
        assert rc == 0 and res["draft_kind"] == pre and res["greedy_exact"] is True, (pre, res.get("greedy_exact"))
    rc, _ = _run(tiny, tmp_path, "--draft", f"hybrid:{tmp_path / 'nowhere'}", "--n-prompts", "2")
    assert rc == 2


def test_also_measures_more_drafts_in_the_same_turns(tiny, tmp_path, capsys):
    """--also DRAFT[@K] adds drafts to the same interleaved run, each at its own K, with its own figures;
    a draft LM there, or a missing directory, is a one-line error before any model loads."""
    from transformers import AutoModelForCausalLM

    from eval.heads import MedusaHeads

    heads = MedusaHeads.from_target(AutoModelForCausalLM.from_pretrained(tiny["target"]), num_heads=2)
    heads.save(tmp_path / "medusa")
    hyb = f"hybrid-nostore:{tmp_path / 'medusa'}"
    rc, res = _run(tiny, tmp_path, "--draft", "ngram", "--k", "4", "--n-prompts", "2",
                   "--also", "ngram@6", "--also", f"{hyb}@2", "--also", str(tmp_path / "medusa"))
    assert rc == 0
    names = ["ngram@6", f"{hyb}@2", f"{tmp_path / 'medusa'}@4"]  # no @K: --k's
    assert res["also"] == names
    for n in names:
        assert res[n]["tokens_per_s"] > 0 and res[n]["speedup"] > 0 and res[n]["tau"] >= 1
        assert res["token_match_rate"][n] == 1.0  # float32: every draft reproduces plain greedy
    assert res["ngram@6"]["k"] == 6 and res[f"{hyb}@2"]["k"] == 2
    out = capsys.readouterr().out
    assert all(n in out for n in names)
    # --set serves --draft as a promoted hybrid's "serve" would: sampled, its model's chain sampled in the tree
    rc, res = _run(tiny, tmp_path, "--draft", hyb, "--set", "sampled_chain=true", "--set", "max_nodes=4",
                   "--temperature", "0.8", "--n-prompts", "2", "--also", hyb)
    assert rc == 0 and res["speculative"]["decoder_stats"]["tree_rounds"] > 0 and res["speculative"]["tokens_per_s"] > 0
    capsys.readouterr()
    for bad in (tiny["draft"], str(tmp_path / "nowhere")):
        rc, _ = _run(tiny, tmp_path, "--draft", "ngram", "--also", bad)
        assert rc == 2
        assert capsys.readouterr().err.count("\n") == 1
