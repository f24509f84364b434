"""Bring your own data: a model owner's prompts and served traffic as JSONL, Parquet or a saved HF dataset,
bad rows named, the held-out split drawn from the user's rows, and each format driving a tiny distill."""

import gzip
import json
from pathlib import Path

import datasets
import pytest
import yaml

from pipeline.cli import main
from pipeline.config import DataConfig, Recipe, RecipeError, load_recipe
from pipeline.data import (DataError, build_prompt_sets, encode_prompt, export_heldout_jsonl, heldout_filter,
                           load_source, normalise, prompt_text, raw_text_chunks, read_jsonl, source_row)

from helpers import TINY_BUDGET

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["tides", "compilers", "bread", "glaciers", "chess", "violins", "orbits", "ferns", "bridges", "owls",
          "tea", "volcanoes", "maps", "bees", "clocks", "rivers", "kites", "salt", "lighthouses", "coral",
          "trains", "paper", "wolves", "cheese", "comets", "looms", "deserts", "ink", "bells", "moss"]


class CharTok:
    """Stand-in tokenizer: one id per character (enough for length filtering and chat rows)."""
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 1000 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")


def _ask(i: int) -> str:
    return f"Explain {TOPICS[i % len(TOPICS)]} to a child in two sentences, take {i}."


def _chat_rows(n: int) -> list[dict]:
    """Served chat traffic: a system turn, the user's question and the assistant's served reply."""
    return [{"id": f"c{i}", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": _ask(i)},
                                         {"role": "assistant", "content": f"Answer {i}."}]} for i in range(n)]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------- formats


def test_each_jsonl_shape_is_parsed(tmp_path):
    msgs = [{"role": "user", "content": "Hi there"}]
    rows = [
        {"prompt": "def f(x):\n"},                                                 # a raw prompt
        {"messages": msgs},                                                        # a chat prompt
        {"messages": msgs, "completion": "Hello!"},                                # messages + the served reply
        {"messages": msgs + [{"role": "assistant", "content": "Hey."}]},           # last turn is the reply
        {"request": {"model": "m", "messages": msgs},                              # an OpenAI request/response
         "response": {"id": "chatcmpl-1", "object": "chat.completion",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "Yo."},
                                   "finish_reason": "stop"}]}},
        {"request": {"custom_id": "req-7", "method": "POST", "url": "/v1/chat/completions",  # Batch API / vLLM
                     "body": {"model": "m", "messages": [{"role": "user", "content": [
                         {"type": "text", "text": "Hi "}, {"type": "text", "text": "again"}]}]}},
         "response": {"status_code": 200, "request_id": "r", "body": {"choices": [
             {"index": 0, "message": {"role": "assistant", "content": "Again."}}]}}},
        {"request": {"prompt": "Once upon"}, "response": {"choices": [{"text": " a time"}]}},  # /v1/completions
        {"custom_id": "b-2", "method": "POST", "url": "/v1/chat/completions",     # a Batch API input line alone
         "body": {"model": "m", "messages": msgs}},
    ]
    got = load_source(str(_write_jsonl(tmp_path / "log.jsonl", rows)))
    assert got == [
        {"id": "log:1", "prompt": "def f(x):\n"},
        {"id": "log:2", "messages": msgs},
        {"id": "log:3", "messages": msgs, "completion": "Hello!"},
        {"id": "log:4", "messages": msgs, "completion": "Hey."},
        {"id": "log:5", "messages": msgs, "completion": "Yo."},
        {"id": "req-7", "messages": [{"role": "user", "content": "Hi again"}], "completion": "Again."},
        {"id": "log:7", "prompt": "Once upon", "completion": " a time"},
        {"id": "b-2", "messages": msgs},
    ]


@pytest.mark.parametrize("row,reason", [
    ({"messages": [{"role": "assistant", "content": "Hey."}]}, "the only message is the assistant's"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] must be a \{'role', 'content'\} object"),
    ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\] \(user\) has no text content"),
    ({"prompt": "a", "completion": 3}, "'completion' must be a string"),
    ({"request": {"messages": [{"role": "user", "content": "x"}]}, "response": {"error": "boom"}},
     "'response' needs 'choices'"),
    ({"request": {"model": "m"}, "response": {"choices": [{"text": "x"}]}}, "'request' needs 'messages'"),
    ({"text": "b"}, "needs 'prompt'"),
])
def test_bad_jsonl_row_named_by_line(tmp_path, row, reason):
    p = _write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(DataError, match=rf"mine\.jsonl:2: {reason}") as e:
        load_source(str(p))
    assert "\n" not in str(e.value)


def test_parquet_and_saved_dataset_are_parsed(tmp_path):
    rows = _chat_rows(3) + [{"id": None, "messages": [{"role": "user", "content": "What is salt?"}]}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(tmp_path / "traffic.parquet")
    want = [source_row(r, f"traffic:{i}") for i, r in enumerate(rows)]
    assert want[0] == {"id": "c0", "messages": rows[0]["messages"][:2], "completion": "Answer 0."}
    assert want[3]["id"] == "traffic:3" and "completion" not in want[3]
    assert load_source(str(tmp_path / "traffic.parquet")) == want
    ds.save_to_disk(tmp_path / "traffic")
    assert load_source(str(tmp_path / "traffic")) == want
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(tmp_path / "dd" / "traffic")
    assert load_source(str(tmp_path / "dd" / "traffic")) == want  # a DatasetDict: its train split
    datasets.DatasetDict({"test": ds, "dev": ds}).save_to_disk(tmp_path / "nodd")
    with pytest.raises(DataError, match=r"without a 'train' split \(it has test, dev\)"):
        load_source(str(tmp_path / "nodd"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="neither a dataset saved by save_to_disk nor any .jsonl"):
        load_source(str(tmp_path / "plain"))


def test_a_folder_of_logs_is_read_file_by_file(tmp_path):
    """A model owner's folder of chat logs: every .jsonl, .jsonl.gz and .parquet under it, sorted by path."""
    logs = tmp_path / "logs"
    (logs / "day2").mkdir(parents=True)
    rows = _chat_rows(6)
    _write_jsonl(logs / "day1.jsonl", rows[:2])
    with gzip.open(logs / "day2" / "a.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps({k: v for k, v in r.items() if k != "id"}) + "\n" for r in rows[2:4]))
    datasets.Dataset.from_list(rows[4:]).to_parquet(logs / "day3.parquet")
    (logs / "notes.txt").write_text("not a log")
    got = load_source(str(logs))
    assert [r["id"] for r in got] == ["c0", "c1", "a:1", "a:2", "c4", "c5"]
    assert [r["completion"] for r in got] == [f"Answer {i}." for i in range(6)]
    with gzip.open(logs / "day2" / "a.jsonl.gz", "at") as fh:
        fh.write('{"messages": "oops"}\n')
    with pytest.raises(DataError, match=r"a\.jsonl\.gz:3: 'messages' must be a non-empty list"):
        load_source(str(logs))


def test_bad_parquet_and_dataset_row_named_by_row(tmp_path):
    log = {"request": {"messages": [{"role": "user", "content": "x"}]}, "response": {"choices": [{"text": "y"}]}}
    mixed = datasets.Dataset.from_list([{"prompt": "a", "request": None, "response": None}, {"prompt": None, **log}])
    mixed.to_parquet(tmp_path / "mixed.parquet")  # a table's columns: None where a row has no such key
    assert [r.get("completion") for r in load_source(str(tmp_path / "mixed.parquet"))] == [None, "y"]
    ds = datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"},
                                     {"prompt": None, "completion": "e"}])
    ds.to_parquet(tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet:row 2: needs 'prompt'"):
        load_source(str(tmp_path / "t.parquet"))
    ds.save_to_disk(tmp_path / "t")
    with pytest.raises(DataError, match=r"t:row 2: needs 'prompt'"):
        load_source(str(tmp_path / "t"))


def test_self_source_is_synthesised_not_loaded(tmp_path):
    with pytest.raises(DataError, match="generate stage synthesises"):
        load_source("self")
    cfg = DataConfig(source="self", max_prompt_tokens=200, val_fraction=0.0)
    assert cfg.heldout == "split"
    train = [{"id": f"s{i}", "messages": [{"role": "user", "content": _ask(i)}]} for i in range(10)]
    held = [{"id": "h0", "messages": [{"role": "user", "content": "A held-out question, synthesised apart?"}]}]
    sets = build_prompt_sets(cfg, tmp_path, CharTok(), 0, rows=train + held[:1], heldout_rows=held)
    assert sets["heldout"] == held and read_jsonl(tmp_path / "prompts" / "heldout.jsonl") == held
    assert sorted(r["id"] for r in sets["train"]) == sorted(r["id"] for r in train)  # h0 dropped from training


# ------------------------------------------------------------------------------- held-out split


def test_heldout_auto_resolves_and_keeps_the_code_recipe():
    assert DataConfig().heldout == "humaneval" and DataConfig(source="x.jsonl").heldout == "split"
    assert DataConfig(source="x.jsonl", heldout="h.jsonl").heldout == "h.jsonl"
    assert Recipe().to_dict()["data"]["heldout"] == "humaneval"
    assert load_recipe(domain="code", overrides=["data.heldout=auto"]) == load_recipe(domain="code")
    for bad in ("data.heldout_fraction=0", "data.heldout_fraction=1.0", "data.heldout_max=0", "data.heldout=self"):
        with pytest.raises(RecipeError, match=bad.split("=")[0]):
            load_recipe(domain="code", overrides=[bad])


def test_split_is_fixed_seed_disjoint_and_never_trained_on(tmp_path):
    rows = _chat_rows(60)
    rows.append(dict(rows[5], id="dup"))                                           # same prompt again
    rows.append({"id": "respaced", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": _ask(31).replace(" ", "  ")}]})
    src = _write_jsonl(tmp_path / "traffic.jsonl", rows)
    cfg = DataConfig(source=str(src), max_prompts=0, val_fraction=0.1, max_prompt_tokens=200, heldout_fraction=0.1)
    sets = build_prompt_sets(cfg, tmp_path / "a", CharTok(), seed=3)
    held = sets["heldout"]
    assert len(held) == 6 and len({r["id"] for r in held}) == 6  # round(0.1 * 61 distinct prompts)
    assert all(r["completion"] == f"Answer {r['id'][1:]}." for r in held)  # the served reply kept on the row
    trained = sets["train"] + sets["val"]
    key = lambda r: normalise(prompt_text(r))  # noqa: E731
    assert not {key(r) for r in held} & {key(r) for r in trained}
    assert "c31" in {r["id"] for r in held} and "respaced" not in {r["id"] for r in trained}  # a whitespace variant
    assert len(trained) + len(held) == 62 - 2  # "dup" deduplicated, "respaced" dropped as held-out c31's variant
    for name in ("train", "val", "heldout"):
        assert read_jsonl(tmp_path / "a" / "prompts" / f"{name}.jsonl") == sets[name]
    assert build_prompt_sets(cfg, tmp_path / "b", CharTok(), seed=3) == sets  # fixed seed
    other = build_prompt_sets(cfg, tmp_path / "c", CharTok(), seed=4)["heldout"]
    assert [r["id"] for r in other] != [r["id"] for r in held]
    capped = DataConfig(source=str(src), max_prompt_tokens=200, heldout_fraction=0.5, heldout_max=4)
    assert len(build_prompt_sets(capped, tmp_path / "d", CharTok(), seed=3)["heldout"]) == 4
    long = DataConfig(source=str(src), max_prompt_tokens=10)
    with pytest.raises(DataError, match="no prompt .* fits data.max_prompt_tokens=10"):
        build_prompt_sets(long, tmp_path / "e", CharTok(), seed=3)


def test_a_short_heldout_chat_prompt_only_matches_exactly():
    """A held-out "Hello!" drops its copies, not every training row that greets; a long one is found inside."""
    overlaps = heldout_filter([{"messages": [{"role": "user", "content": "Hello!"}]}])
    assert overlaps({"messages": [{"role": "user", "content": "Hello !"}]})
    assert not overlaps({"prompt": "Hello! Can you explain tides?"})
    overlaps = heldout_filter([{"prompt": "Summarise the attached quarterly report for the board."}])
    assert overlaps({"prompt": "Please: summarise the attached quarterly report for the board. Thanks"}) is False
    assert overlaps({"prompt": "Please: Summarise the attached quarterly report for the board. Thanks"})


def test_raw_text_and_export_use_the_runs_split(tmp_path):
    src = _write_jsonl(tmp_path / "t.jsonl", _chat_rows(20))
    cfg = DataConfig(source=str(src), max_prompt_tokens=200)
    run = tmp_path / "run"
    held = build_prompt_sets(cfg, run, CharTok(), seed=0)["heldout"]
    with pytest.raises(DataError, match="read a run's prompts/heldout.jsonl"):
        raw_text_chunks(str(src), CharTok(), 100, 400, 0, heldout="split")
    tok = CharTok()
    tok.decode = lambda ids: "".join(map(chr, ids))
    chunks = raw_text_chunks(str(src), tok, 100, 400, 0, heldout=str(run / "prompts" / "heldout.jsonl"))
    texts = {tok.decode(c) for c in chunks}
    assert len(texts) == 20 - len(held) and not any(prompt_text(r) in t for r in held for t in texts)
    assert any("Answer" in t for t in texts)  # the served completion is raw text too
    assert read_jsonl(export_heldout_jsonl(tmp_path / "h.jsonl", run_dir=run)) == held


# ------------------------------------------------------------------------------- a distill on each format


# TINY_BUDGET trimmed further: three distills here; what evaluate judges on is the point, not its figures
FAST = ["data.max_prompts=8", "train.steps=2", "evaluate.baselines=false", "evaluate.hybrid=false",
        "evaluate.fp32_prompts=0"]


def _recipe_file(tmp_path: Path, source: Path) -> Path:
    """recipes/code.yaml with the user's data as the source and the held-out spec left to its default."""
    r = yaml.safe_load((ROOT / "recipes" / "code.yaml").read_text())
    r["domain"], r["data"] = "mine", {"source": str(source)}
    p = tmp_path / "mine.yaml"
    p.write_text(yaml.safe_dump(r))
    return p


@pytest.mark.parametrize("fmt", ["jsonl-prompts", "traffic-log", "parquet"])
def test_own_data_drives_a_distill_judged_on_its_split(fmt, tiny_target, real_tokenizer, tmp_path):
    from pipeline.evaluate import heldout_ids

    if fmt == "jsonl-prompts":
        source = _write_jsonl(tmp_path / "mine.jsonl", [{"id": f"p{i}", "prompt": _ask(i)} for i in range(30)])
    elif fmt == "traffic-log":
        source = _write_jsonl(tmp_path / "mine.jsonl", [
            {"custom_id": f"c{i}", "request": {"messages": r["messages"][:2]},
             "response": {"choices": [{"message": {"role": "assistant", "content": f"Answer {i}."}}]}}
            for i, r in enumerate(_chat_rows(30))])
    else:
        source = tmp_path / "mine.parquet"
        datasets.Dataset.from_list(_chat_rows(30)).to_parquet(source)
    ids = {r["id"] for r in load_source(str(source))}
    runs = tmp_path / "runs"
    assert main(["distill", "--recipe", str(_recipe_file(tmp_path, source)), f"target={tiny_target}",
                 "dtype=float32", f"runs_dir={runs}", "wandb.mode=disabled", *TINY_BUDGET,
                 *FAST]) == 0
    run = (runs / "mine" / "latest").resolve()
    recipe = load_recipe(run / "recipe.yaml")
    assert recipe.data.heldout == "split"
    held, train = read_jsonl(run / "prompts" / "heldout.jsonl"), read_jsonl(run / "prompts" / "train.jsonl")
    assert len(held) == 3 and {r["id"] for r in held} <= ids  # the user's own rows, not HumanEval's
    assert not {r["id"] for r in held} & {r["id"] for r in train}
    assert not {normalise(prompt_text(r)) for r in held} & {normalise(prompt_text(r)) for r in train}
    judged = heldout_ids(recipe, run, real_tokenizer)
    assert judged == [encode_prompt(r, real_tokenizer, False) for r in held[:2]]
    assert json.loads((run / "metrics.json").read_text())["n_prompts"] == 2
