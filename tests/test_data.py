"""Prompt sources and prompt sets (offline, a few seconds)."""

import json
import time

import pytest

from pipeline.config import DataConfig
from pipeline.data import (DataError, build_prompt_sets, encode_prompt, export_heldout_jsonl, heldout_filter,
                           humaneval_prompts, jsonl_prompts, normalise, read_jsonl, stdlib_prompts)


class CharTok:
    """Stand-in tokenizer: one id per character (enough for length filtering)."""
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 1000 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def stdlib():
    t = time.time()
    rows = stdlib_prompts()
    return rows, time.time() - t


def test_stdlib_prompts_are_many_and_unique(stdlib):
    rows, _ = stdlib  # its time is a benchmark's to judge, not a test's
    assert len(rows) > 1000
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({normalise(r["prompt"]) for r in rows}) == len(rows)
    assert not any(".test." in r["id"] or r["id"].startswith(("test.", "idlelib", "lib2to3")) for r in rows)
    r = next(r for r in rows if r["id"] == "textwrap:dedent")
    assert r["prompt"].startswith("def dedent(text):\n    \"\"\"") and r["prompt"].endswith('"""\n')
    m = next(r for r in rows if r["id"] == "json.decoder:JSONDecoder.decode")
    assert m["prompt"].startswith("def decode(self, s")  # methods are dedented to top level


def test_stdlib_limit_deterministic():
    a, b = stdlib_prompts(limit=30, seed=1), stdlib_prompts(limit=30, seed=1)
    assert a == b and len(a) == 30


def test_the_stdlib_scan_is_cached_and_rescanned_when_a_file_changes(tmp_path, monkeypatch):
    """The scan is read back from the cache as it was written; an edited file, or a corrupt cache file,
    means a fresh scan."""
    import os

    from pipeline import data

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    body = 'def f(x):\n    """Return x."""\n    return x\n'
    (root / "a.py").write_text(body)
    (root / "pkg" / "b.py").write_text(body.replace("f(", "g("))
    files = data._stdlib_files(root)
    first = data._cached_stdlib_scan(root, files)
    cached = data.stdlib_cache_path(root, files)
    assert [r["id"] for r in first] == ["a:f", "pkg.b:g"] and cached.exists()
    assert data._cached_stdlib_scan(root, files) == first == data._scan_files(root, files)
    cached.write_text("[{")  # corrupt: scanned again and rewritten
    assert data._cached_stdlib_scan(root, files) == first and json.loads(cached.read_text()) == first
    (root / "a.py").write_text(body.replace("f(", "h("))
    os.utime(root / "a.py", ns=(1, 1))
    assert data.stdlib_cache_path(root, files) != cached
    assert [r["id"] for r in data._cached_stdlib_scan(root, files)] == ["a:h", "pkg.b:g"]


def test_humaneval_and_export(tmp_path):
    rows = humaneval_prompts()
    assert len(rows) == 164 and rows[0]["id"] == "HumanEval/0"
    p = export_heldout_jsonl(tmp_path / "he.jsonl")
    assert read_jsonl(p) == rows


def test_jsonl_bad_line_named(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n')
    with pytest.raises(DataError, match=r"mine\.jsonl:4"):
        jsonl_prompts(p)
    p.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(DataError, match=r"mine\.jsonl:2: needs 'prompt'"):
        jsonl_prompts(p)
    p.write_text('{"prompt": "a", "id": "x"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert jsonl_prompts(p) == [{"id": "x", "prompt": "a"}, {"id": "mine:2", "messages": [{"role": "user", "content": "hi"}]}]


def test_empty_source_raises(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "h.jsonl").write_text('{"prompt": "def h():\\n"}\n')
    cfg = DataConfig(source=str(tmp_path / "empty.jsonl"), heldout=str(tmp_path / "h.jsonl"))
    with pytest.raises(DataError, match="empty.jsonl.*yielded no prompts"):
        build_prompt_sets(cfg, tmp_path / "run", CharTok(), 0)
    with pytest.raises(DataError, match="not 'stdlib'"):
        build_prompt_sets(DataConfig(source="nope", heldout=str(tmp_path / "h.jsonl")), tmp_path / "run", CharTok(), 0)


def test_heldout_never_trained_on(tmp_path):
    he = humaneval_prompts()
    src = [{"id": "copy", "prompt": he[0]["prompt"]},                                  # verbatim copy
           {"id": "reformatted", "prompt": he[1]["prompt"].replace("    ", "  ") + "# tail\n"},  # same signature
           {"id": "bigger", "prompt": "import x\n\n" + he[2]["prompt"]}]                 # contains it
    src += [{"id": f"ok{i}", "prompt": f"def ok{i}(a):\n    \"\"\"Doc {i}.\"\"\"\n"} for i in range(50)]
    src += [{"id": "dup", "prompt": "def ok1(a):\n  \"\"\"Doc 1.\"\"\"\n"}]             # duplicate of ok1
    src += [{"id": "long", "prompt": "def long(a):\n" + "#" * 500}]
    path = tmp_path / "src.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in src))
    cfg = DataConfig(source=str(path), heldout="humaneval", max_prompts=40, val_fraction=0.1, max_prompt_tokens=100)
    sets = build_prompt_sets(cfg, tmp_path / "run", CharTok(), seed=7)
    ids = [r["id"] for r in sets["train"] + sets["val"]]
    assert not {"copy", "reformatted", "bigger", "dup", "long"} & set(ids)
    assert len(ids) == 40 and len(sets["val"]) == 4 and len(set(ids)) == 40
    assert len(sets["heldout"]) == 164
    for name in ("train", "val", "heldout"):
        assert read_jsonl(tmp_path / "run" / "prompts" / f"{name}.jsonl") == sets[name]
    assert build_prompt_sets(cfg, tmp_path / "run2", CharTok(), seed=7) == sets  # deterministic
    overlaps = heldout_filter(he)
    assert not any(overlaps(r) for r in sets["train"])


def test_stdlib_train_set_excludes_humaneval(stdlib):
    overlaps = heldout_filter(humaneval_prompts())
    assert sum(map(overlaps, stdlib[0])) < len(stdlib[0]) // 10


def test_encode_prompt_raw_and_chat():
    tok = CharTok()
    assert encode_prompt({"prompt": "ab"}, tok, chat=False) == [97, 98]
    chat = encode_prompt({"prompt": "ab"}, tok, chat=True)
    assert chat == tok("<user>Complete this Python function:\nab\n<assistant>")["input_ids"]
    msgs = encode_prompt({"messages": [{"role": "user", "content": "x"}]}, tok, chat=False)
    assert msgs == tok("<user>x\n<assistant>")["input_ids"]


def test_prompts_rewrites_its_own_file_but_not_another(tmp_path, capsys):
    """`draftsmith prompts --out F` again (make bench runs it every time) leaves F as it is; a file of other content
    is replaced only with --force."""
    from pipeline.cli import main

    out = tmp_path / "he.jsonl"
    assert main(["prompts", "--out", str(out)]) == 0
    first = out.read_bytes()
    assert main(["prompts", "--out", str(out)]) == 0 and out.read_bytes() == first
    out.write_text('{"prompt": "mine"}\n')
    assert main(["prompts", "--out", str(out)]) == 2 and out.read_text() == '{"prompt": "mine"}\n'
    assert "--force" in capsys.readouterr().err
    assert main(["prompts", "--out", str(out), "--force"]) == 0 and out.read_bytes() == first
