"""Bad input through `draftsmith`: each case exits 2, its whole stderr is one `draftsmith: error:` line naming
the problem and the fix, and it changes nothing already written: every file under the case's directory is
hashed before and after, the command running from a fresh working directory inside it (a stray write to
./runs is caught). The cases that need a finished run work on a copy of one tiny distill.

Cases for the registry, the lock and retrain (a registry pointing at a deleted draft, a held lock, traffic
logs that are empty/truncated/not UTF-8/mistyped, a challenger for another target, a retrain with no
new data) live beside those commands: tests/test_registry.py, tests/test_lock.py, tests/test_retrain.py.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from pipeline.cli import EXIT_USER_ERROR, main

from helpers import TINY_BUDGET

RUN_ID = "r"
RECIPE = str(Path(__file__).resolve().parent.parent / "recipes" / "code.yaml")  # the cases run from elsewhere
# Where no one may create a directory, root included: sysfs refuses mkdir (EPERM), or is mounted read-only (EROFS).
READ_ONLY = Path("/sys")


def _overrides(target, runs) -> list[str]:
    return ["--recipe", RECIPE, f"target={target}", "dtype=float32", f"runs_dir={runs}",
            "wandb.mode=disabled", *TINY_BUDGET, "evaluate.hybrid=false"]


@pytest.fixture(scope="module")
def finished(tiny_target, tmp_path_factory, one_thread):
    """One finished tiny distill: its runs dir."""
    runs = tmp_path_factory.mktemp("finished") / "runs"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        mp.setenv("WANDB_MODE", "disabled")
        assert main(["distill", *_overrides(tiny_target, runs), "--run-id", RUN_ID]) == 0
    return runs


@dataclass
class Ctx:
    tmp: Path  # everything the case may touch lives under it (hashed before and after)
    target: Path
    runs: Path  # runs dir: empty, or a copy of the finished run (Case.run)

    @property
    def run(self) -> Path:
        return self.runs / "code" / RUN_ID

    def stage(self, cmd: str, *more: str) -> list[str]:
        return [cmd, *_overrides(self.target, self.runs), "--run-id", RUN_ID, *more]


@dataclass
class Case:
    id: str
    argv: Callable[[Ctx], list[str]]
    expect: tuple[str, ...]  # in the error line: the problem and the fix
    setup: Callable[[Ctx], None] | None = None
    run: bool = False  # work on a copy of the finished run
    patch: Callable[[pytest.MonkeyPatch, Ctx], None] | None = None
    adds: bool = False  # may add files (a new run's first ones), never change or remove one


def _write(rel: str, text: str):
    def setup(c: Ctx):
        p = c.tmp / rel if not rel.startswith("run/") else c.run / rel[4:]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return setup


def _write_bytes(rel: str, data: bytes):
    def setup(c: Ctx):
        (c.tmp / rel).write_bytes(data)
    return setup


# a prompts file whose second line is Latin-1, not UTF-8; a chat row whose turn has no content
NOT_UTF8 = _write_bytes("p.jsonl", b'{"prompt": "def f():\\n    return 1\\n"}\n{"prompt": "caf\xe9 au lait"}\n')
NO_CONTENT = _write("p.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "user"}]}\n')
NOT_TEXT = _write("p.jsonl", '{"messages": [{"role": "user", "content": 7}]}\n')


def _bench(c: Ctx, *more: str) -> list[str]:
    return ["bench", "--target", str(c.target), "--draft", "ngram", "--prompts", str(c.tmp / "p.jsonl"),
            "--dtype", "float32", "--max-new-tokens", "4", *more]


def _report(c: Ctx, *more: str) -> list[str]:
    return ["report", "--domain", "code", "--runs-dir", str(c.runs), "--out", str(c.tmp / "r.html"), *more]


def _other_target(c: Ctx):
    """The same tiny model under another path: another target, to a recipe; the copied run's draft the champion."""
    from pipeline.registry import Registry

    shutil.copytree(c.target, c.tmp / "other-target")
    reg = Registry(c.runs / "code")
    if reg.champion() is None:  # the gate may have kept a tiny draft out: make it the champion
        reg.promote(RUN_ID, {"reason": "set up as champion"})


def _corrupt_shard(c: Ctx):
    (c.run / "train" / "manifest.json").unlink()  # train reads the shards again
    arrow = sorted((c.run / "generate" / "shard-00001").glob("*.arrow"))[0]
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])


def _disk_full_at(name: str):
    """Every atomic writer (JSON and text) refuses `name` with ENOSPC, as a full disk would."""
    def patch(mp: pytest.MonkeyPatch, c: Ctx):
        import pipeline.atomic

        def refusing(real):
            def write(path, *a, **kw):
                if Path(path).name == name:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                return real(path, *a, **kw)
            return write
        for fn in ("write_json_atomic", "write_text_atomic"):
            write = refusing(getattr(pipeline.atomic, fn))
            for mod in ("pipeline.shards", "pipeline.evaluate", "pipeline.atomic"):
                mp.setattr(importlib.import_module(mod), fn, write, raising=False)
    return patch


def _cpu_path_env(value: str):
    """DRAFTSMITH_CPU_PATH set to `value`, read afresh by bench (the process's path is decided once and cached)."""
    def patch(mp: pytest.MonkeyPatch, c: Ctx):
        import eval.bench
        import eval.cpu

        mp.setenv(eval.cpu.ENV_PATH, value)
        mp.setattr(eval.bench, "cpu_path", eval.cpu.cpu_path.__wrapped__)
    return patch


BAD = "draftsmith: error:"
# A tqdm progress bar as it is redrawn ("desc:  50%|█████     | 1/2 [00:00<00:00, 7.63it/s]"): the work done
# before the failure (ours, or transformers' "Loading weights"), not a message; nothing else may be on stderr.
PROGRESS_BAR = re.compile(r"^[^|\n]*: *\d+%\|[^|]*\| *\d+/\d+ \[[^]]*\]$")


def _stderr_lines(err: str) -> list[str]:
    """stderr's lines, each redrawn segment (split at carriage returns) a line of its own, less progress bars."""
    return [s for line in err.split("\n") for s in line.split("\r") if s.strip() and not PROGRESS_BAR.match(s)]


CASES = [
    # the recipe and the command line
    Case("no-recipe", lambda c: ["distill"], ("--recipe",)),
    Case("unknown-flag", lambda c: ["distill", "--recipe", RECIPE, "--bogus"], ("--bogus", "--help")),
    Case("flag-not-a-number", lambda c: _bench(c, "--temperature", "warm"), ("--temperature", "warm", "--help")),
    Case("recipe-file-missing", lambda c: ["distill", "--recipe", str(c.tmp / "nope.yaml")], ("nope.yaml",)),
    Case("unknown-domain", lambda c: ["distill", "--domain", "nosuchdomain"], ("nosuchdomain", "known domains")),
    Case("unknown-key", lambda c: ["distill", *_overrides(c.target, c.runs), "trian.steps=3"], ("trian",)),
    Case("override-wrong-type", lambda c: ["distill", *_overrides(c.target, c.runs), "train.steps=many"],
         ("train.steps", "many")),
    Case("recipe-wrong-types", lambda c: ["distill", "--recipe", str(c.tmp / "r.yaml")], ("train.steps",),
         setup=_write("r.yaml", "domain: code\ntrain:\n  steps: lots\n")),
    Case("recipe-not-a-mapping", lambda c: ["distill", "--recipe", str(c.tmp / "r.yaml")], ("r.yaml",),
         setup=_write("r.yaml", "- generate\n- train\n")),
    Case("recipe-not-yaml", lambda c: ["distill", "--recipe", str(c.tmp / "r.yaml")], ("not valid YAML",),
         setup=_write("r.yaml", "train: [steps: 3\n")),
    Case("bad-dtype", lambda c: ["distill", *_overrides(c.target, c.runs), "dtype=float8"], ("dtype",)),
    Case("top-p-when-greedy", lambda c: ["distill", *_overrides(c.target, c.runs), "evaluate.top_p=0.5"],
         ("evaluate.top_p", "evaluate.temperature")),
    Case("target-missing", lambda c: ["distill", *_overrides(c.tmp / "nosuch", c.runs)],
         ("does not exist", "HF checkpoint directory")),
    Case("target-without-config", lambda c: ["distill", *_overrides(c.tmp / "empty", c.runs)],
         ("config.json",), setup=lambda c: (c.tmp / "empty").mkdir()),
    Case("stage-before-any-run", lambda c: ["evaluate", *_overrides(c.target, c.runs)],
         ("no run under", "draftsmith distill")),
    # a run directory damaged on disk
    Case("corrupt-status", lambda c: c.stage("evaluate"), ("status.json", "delete it"),
         setup=_write("run/status.json", "{\"complete\": tr"), run=True),
    Case("status-not-an-object", lambda c: c.stage("evaluate"), ("status.json", "delete it"),
         setup=_write("run/status.json", "[1, 2]"), run=True),
    Case("corrupt-generate-manifest", lambda c: c.stage("generate"), ("manifest.json", "rerun"),
         setup=_write("run/generate/manifest.json", "{\"shards\": {"), run=True),
    Case("corrupt-train-manifest", lambda c: c.stage("evaluate"), ("manifest.json", "rerun"),
         setup=_write("run/train/manifest.json", "not json"), run=True),
    Case("truncated-shard", lambda c: c.stage("train"), ("shard-00001", "generate stage"),
         setup=_corrupt_shard, run=True),
    # the machine refuses a write
    Case("disk-full-metrics", lambda c: c.stage("evaluate"), ("disk full", "metrics.json", "free space"),
         run=True, patch=_disk_full_at("metrics.json")),
    Case("disk-full-new-run", lambda c: ["distill", *_overrides(c.target, c.runs), "--run-id", "new"],
         ("disk full", "status.json", "rerun"), patch=_disk_full_at("status.json"), adds=True),
    Case("runs-dir-under-a-file", lambda c: ["distill", *_overrides(c.target, c.tmp / "file" / "runs")],
         ("cannot write", "runs_dir"), setup=_write("file", "not a directory")),
    Case("runs-dir-read-only", lambda c: ["distill", *_overrides(c.target, READ_ONLY / "draftsmith-runs")],
         ("cannot write", "draftsmith-runs")),
    Case("prompts-out-under-a-file", lambda c: ["prompts", "--out", str(c.tmp / "file" / "p" / "h.jsonl")],
         ("cannot write", "--out"), setup=_write("file", "x")),
    Case("prompts-of-a-run-without-prompts", lambda c: ["prompts", "--out", str(c.tmp / "h.jsonl"), "--run-dir",
                                                         str(c.tmp / "emptyrun")], ("heldout.jsonl",),
         setup=lambda c: (c.tmp / "emptyrun").mkdir()),
    # prompt files: not UTF-8, chat rows without text, in every command that reads one
    Case("bench-prompts-not-utf8", lambda c: _bench(c), ("p.jsonl:2", "UTF-8"), setup=NOT_UTF8),
    Case("distill-source-not-utf8", lambda c: [*c.stage("distill"), f"data.source={c.tmp / 'p.jsonl'}"],
         ("p.jsonl:2", "UTF-8"), setup=NOT_UTF8, run=True),
    Case("distill-heldout-not-utf8", lambda c: ["distill", *_overrides(c.target, c.runs),
                                                f"data.heldout={c.tmp / 'p.jsonl'}"], ("p.jsonl:2", "UTF-8"),
         setup=NOT_UTF8),
    Case("report-prompts-not-utf8", lambda c: _report(c, "--prompts", str(c.tmp / "p.jsonl")),
         ("p.jsonl:2", "UTF-8"), setup=NOT_UTF8, run=True),
    Case("bench-messages-without-content", lambda c: _bench(c), ("p.jsonl:2", "content"), setup=NO_CONTENT),
    Case("distill-messages-without-content", lambda c: ["distill", *_overrides(c.target, c.runs),
                                                        f"data.source={c.tmp / 'p.jsonl'}"],
         ("p.jsonl:2", "content"), setup=NO_CONTENT),
    Case("report-messages-without-content", lambda c: _report(c, "--prompts", str(c.tmp / "p.jsonl")),
         ("p.jsonl:2", "content"), setup=NO_CONTENT, run=True),
    Case("bench-messages-content-not-text", lambda c: _bench(c), ("p.jsonl:1", "content"), setup=NOT_TEXT),
    # sampling settings out of range, on the command line and in the recipe
    Case("bench-temperature-negative", lambda c: _bench(c, "--temperature", "-1"), ("--temperature", ">= 0"),
         setup=_write("p.jsonl", '{"prompt": "def f():"}\n')),
    Case("bench-temperature-nan", lambda c: _bench(c, "--temperature", "nan"), ("--temperature", ">= 0"),
         setup=_write("p.jsonl", '{"prompt": "def f():"}\n')),
    Case("evaluate-temperature-nan", lambda c: ["distill", *_overrides(c.target, c.runs), "evaluate.temperature=.nan"],
         ("evaluate.temperature",)),
    Case("report-temperature-negative", lambda c: _report(c, "report.temperatures=[0,-1]"),
         ("report.temperatures",), run=True),
    # a distill that fails or is refused leaves runs/<domain>/latest where it was
    Case("failed-distill-latest-stays", lambda c: ["distill", *_overrides(c.target, c.runs), "--run-id", "new"],
         ("disk full", "val.jsonl"), run=True, patch=_disk_full_at("val.jsonl"), adds=True),
    Case("distill-new-target-refused-first", lambda c: ["distill", *_overrides(c.tmp / "other-target", c.runs)],
         ("serves target", "other-target"), setup=_other_target, run=True),
    # export
    Case("export-missing-draft", lambda c: ["export", "--draft", str(c.tmp / "nodraft"), "--format", "hf",
                                            "--out", str(c.tmp / "out")], ("nodraft",)),
    Case("export-unknown-format", lambda c: ["export", "--draft", str(c.run / "best"), "--format", "onnx",
                                             "--out", str(c.tmp / "out")], ("onnx",), run=True),
    Case("export-format-the-draft-lacks", lambda c: ["export", "--draft", str(c.run / "best"), "--format",
                                                     "eagle3", "--out", str(c.tmp / "out")],
         ("recurrent Medusa", "train.medusa.recurrent=false"), run=True),
    # a refused stage leaves the run's recorded recipe; train and evaluate do not begin a run
    Case("stage-refused-keeps-the-runs-recipe", lambda c: c.stage("generate", "seed=5"),
         ("different seed/data settings", "new run id"), run=True),
    Case("train-run-id-that-does-not-exist", lambda c: ["train", *_overrides(c.target, c.runs), "--run-id", "nosuch"],
         ("nosuch", "draftsmith generate"), run=True),
    Case("evaluate-for-another-target", lambda c: ["evaluate", *_overrides(c.tmp / "other", c.runs), "--run-id", RUN_ID],
         ("trained for target", "evaluate with target="), run=True,
         setup=lambda c: shutil.copytree(c.target, c.tmp / "other")),
    # recipes and overrides YAML cannot read
    Case("recipe-a-directory", lambda c: ["distill", "--recipe", str(c.tmp)], ("not a file", "recipes/code.yaml")),
    Case("recipe-not-utf8", lambda c: ["distill", "--recipe", str(c.tmp / "r.yaml")], ("r.yaml", "not UTF-8"),
         setup=_write_bytes("r.yaml", b"\xff\xfe\x00train")),
    Case("override-not-yaml", lambda c: ["distill", *_overrides(c.target, c.runs), "train.steps=[1"],
         ("train.steps=[1", "not valid YAML")),
    Case("override-a-section-to-a-value", lambda c: ["distill", *_overrides(c.target, c.runs), "train=5"],
         ("section 'train'", "train.<key>=value")),
    Case("source-of-one-distinct-prompt", lambda c: ["distill", *_overrides(c.target, c.runs),
                                                     f"data.source={c.tmp / 'p.jsonl'}"], ("2 distinct prompts",),
         setup=_write("p.jsonl", '{"prompt": "def f():"}\n{"prompt": "def  f():"}\n')),
    Case("domain-outside-the-runs-dir", lambda c: ["distill", *_overrides(c.target, c.runs), "domain=.."],
         ("domain='..'", "plain name")),
    Case("warmup-steps-negative", lambda c: ["distill", *_overrides(c.target, c.runs), "train.warmup_steps=-3"],
         ("train.warmup_steps=-3", ">= 0")),
    Case("override-a-yaml-boolean", lambda c: ["distill", *_overrides(c.target, c.runs), "wandb.mode=off"],
         ("wandb.mode", "quote it")),
    # an output path that cannot take the file, refused before the work that fills it
    Case("prompts-out-a-directory", lambda c: ["prompts", "--out", str(c.tmp)], ("--out", "is a directory")),
    Case("prompts-out-a-file-of-other-content", lambda c: ["prompts", "--out", str(c.tmp / "mine.jsonl")],
         ("mine.jsonl", "other content", "--force"), setup=_write("mine.jsonl", '{"prompt": "my own"}\n')),
    Case("prompts-run-dir-missing", lambda c: ["prompts", "--out", str(c.tmp / "h.jsonl"), "--run-dir",
                                               str(c.tmp / "nosuch")], ("nosuch", "does not exist")),
    Case("report-out-a-directory", lambda c: ["report", "--domain", "code", "--runs-dir", str(c.runs), "--out",
                                              str(c.tmp / "cwd")], ("--out", "is a directory"), run=True),
    Case("bench-json-a-directory", lambda c: _bench(c, "--json", str(c.tmp / "cwd")), ("--json", "is a directory"),
         setup=_write("p.jsonl", '{"prompt": "def f():"}\n')),
    Case("bench-n-prompts-0", lambda c: _bench(c, "--n-prompts", "0"), ("--n-prompts 0", "leave it out"),
         setup=_write("p.jsonl", '{"prompt": "def f():"}\n')),
    Case("bench-cpu-path-unknown", lambda c: _bench(c), ("DRAFTSMITH_CPU_PATH='bogus'", "unset it"),
         setup=_write("p.jsonl", '{"prompt": "def f():"}\n'), patch=_cpu_path_env("bogus")),
    Case("verify-export-of-a-file", lambda c: ["verify-export", "--export", str(c.tmp / "f")], ("is a file",),
         setup=_write("f", "x")),
    Case("verify-export-k-0", lambda c: ["verify-export", "--export", str(c.tmp), "--k", "0"], ("--k=0", "> 0")),
    Case("verify-export-n-negative", lambda c: ["verify-export", "--export", str(c.tmp), "--n", "-3"], ("--n=-3",)),
    # a command without recipe overrides: a mistyped option (to=ID for --to ID) is refused, not ignored
    Case("rollback-stray-key-value", lambda c: ["drafts", "rollback", "--domain", "code", "--runs-dir", str(c.runs),
                                                "to=20261203-000000-abcd"],
         ("to=20261203-000000-abcd", "takes no recipe overrides", "draftsmith drafts --help")),
]


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[rel] = "dir"
    return out


def _copy_run(src_runs: Path, dst_runs: Path, target: Path) -> None:
    """The finished run under another runs dir, its recipe.yaml as a run opened there would write it."""
    import yaml

    from pipeline.config import load_recipe

    shutil.copytree(src_runs, dst_runs, symlinks=True)
    args = _overrides(target, dst_runs)
    recipe = load_recipe(args[1], args[2:] + [f"run_id={RUN_ID}"])
    (dst_runs / "code" / RUN_ID / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_one_line_exit_2_nothing_changed(case, request, tiny_target, tmp_path, capsys, monkeypatch,
                                                   one_thread):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    ctx = Ctx(tmp_path, tiny_target, tmp_path / "runs")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # inside the snapshot: a write relative to the working directory shows
    if case.run:
        _copy_run(request.getfixturevalue("finished"), ctx.runs, tiny_target)
    if case.setup:
        case.setup(ctx)
    argv = case.argv(ctx)
    if case.patch:
        case.patch(monkeypatch, ctx)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's errors exit by themselves
        rc = e.code
    err = capsys.readouterr().err
    assert rc == EXIT_USER_ERROR, err
    lines = _stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith(BAD), err
    for word in case.expect:
        assert word in lines[0], (word, lines[0])
    after = _snapshot(tmp_path)
    if case.adds:
        assert {k: after.get(k) for k in before} == before
    else:
        assert after == before


def test_there_are_at_least_40_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 40


# The measuring tools run as `python -m`: the same rule, each line led by the tool's name. The prompts and the
# arguments are checked before the target loads, so every case here answers in well under a second.
TOOL_CASES = [
    ("replay-k-0", "eval.replay", "replay:", lambda c: ["--draft", "ngram", "--prompts", str(c.tmp / "p.jsonl"),
                                                        "--k", "0"], ("--k", ">= 1")),
    ("replay-try-k-0", "eval.replay", "replay:", lambda c: ["--draft", "ngram", "--target", str(c.target),
                                                            "--prompts", str(c.tmp / "p.jsonl"), "--try", "k=0"],
     ("k=0", ">= 1")),
    ("replay-no-prompts", "eval.replay", "replay:",
     lambda c: ["--draft", "ngram", "--prompts", str(c.tmp / "no.jsonl")], ("no.jsonl", "does not exist")),
    ("vllm-bench-no-prompts", "pipeline.vllm_bench", "vllm_bench:",
     lambda c: ["--target", str(c.target), "--prompts", str(c.tmp / "no.jsonl")], ("no.jsonl", "does not exist")),
    ("vllm-bench-batch-sizes", "pipeline.vllm_bench", "vllm_bench:",
     lambda c: ["--prompts", str(c.tmp / "p.jsonl"), "--batch-sizes", "1,x"],
     ("--batch-sizes must be comma-separated integers", "'1,x'")),
    ("vllm-bench-n-0", "pipeline.vllm_bench", "vllm_bench:",
     lambda c: ["--prompts", str(c.tmp / "p.jsonl"), "--n", "0"], ("--n=0", "> 0")),
    ("vllm-bench-method", "pipeline.vllm_bench", "vllm_bench:",
     lambda c: ["--prompts", str(c.tmp / "p.jsonl"), "--method", "bogus"], ("bogus", "bogus:K")),
    ("vllm-bench-no-export", "pipeline.vllm_bench", "vllm_bench:",
     lambda c: ["--prompts", str(c.tmp / "p.jsonl"), "--method", f"eagle3:2:{c.tmp / 'none'}"],
     ("does not exist", "draftsmith export --format eagle3")),
    ("vllm-bench-no-target", "pipeline.vllm_bench", "vllm_bench:",
     lambda c: ["--target", str(c.tmp / "none"), "--prompts", str(c.tmp / "p.jsonl")], ("none", "does not exist")),
    ("llamacpp-bench-no-prompts", "pipeline.llamacpp_bench", "llamacpp_bench:",
     lambda c: ["--gguf", str(c.tmp / "t.gguf"), "--prompts", str(c.tmp / "no.jsonl")], ("no.jsonl", "does not exist")),
    ("llamacpp-bench-threads-0", "pipeline.llamacpp_bench", "llamacpp_bench:",
     lambda c: ["--gguf", str(c.tmp / "t.gguf"), "--prompts", str(c.tmp / "p.jsonl"), "--threads", "0"],
     ("--threads=0", "> 0")),
    ("lookup-replay-k-0", "pipeline.lookup_replay", "lookup_replay:",
     lambda c: ["--export", str(c.tmp), "--prompts", str(c.tmp / "p.jsonl"), "--k", "0"], ("--k=0", "> 0")),
    ("generate-bench-key", "pipeline.generate_bench", "generate_bench:", lambda c: ["bogus.key=1"],
     ("bogus", "known keys")),
    ("generate-bench-domain", "pipeline.generate_bench", "generate_bench:", lambda c: ["--domain", "nope"],
     ("nope", "known domains")),
    ("generate-bench-n-0", "pipeline.generate_bench", "generate_bench:", lambda c: ["--n", "0"], ("--n=0", "> 0")),
    ("cpu-bench-against", "eval.cpu_bench", "cpu_bench:", lambda c: ["--against", str(c.tmp / "old.cpp")],
     ("old.cpp", "does not exist", "git show")),
    ("cpu-bench-path", "eval.cpu_bench", "cpu_bench:", lambda c: ["--paths", "bogus"], ("bogus", "avx2")),
    ("cpu-bench-shapes", "eval.cpu_bench", "cpu_bench:", lambda c: ["--shapes", "1xq"], ("--shapes", "BxT")),
    ("cpu-bench-turns-0", "eval.cpu_bench", "cpu_bench:", lambda c: ["--turns", "0"], ("--turns 0", "at least 1")),
    ("cpu-bench-json-dir", "eval.cpu_bench", "cpu_bench:", lambda c: ["--json", str(c.tmp)], ("--json", "directory")),
    ("cpu-bench-bad-flag", "eval.cpu_bench", "cpu_bench:", lambda c: ["--turns", "x"], ("--turns", "--help")),
    ("replay-top-p-greedy", "eval.replay", "replay:", lambda c: ["--draft", "ngram", "--prompts",
                                                                 str(c.tmp / "p.jsonl"), "--top-p", "0.5"],
     ("--top-p 0.5", "--temperature")),
    ("replay-bad-flag", "eval.replay", "replay:", lambda c: ["--draft", "ngram", "--prompts", str(c.tmp / "p.jsonl"),
                                                             "--k", "x"], ("--k", "--help")),
]


@pytest.mark.parametrize("case", TOOL_CASES, ids=lambda c: c[0])
def test_measuring_tools_answer_bad_input_in_one_line(case, tiny_target, tmp_path, capsys, monkeypatch):
    _, module, prog, argv, expect = case
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f():\\n"}\n')
    ctx = Ctx(tmp_path, tiny_target, tmp_path / "runs")
    before = _snapshot(tmp_path)
    capsys.readouterr()
    try:
        rc = importlib.import_module(module).main(argv(ctx))
    except SystemExit as e:  # argparse's errors exit by themselves
        rc = e.code
    lines = _stderr_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(prog), lines
    for word in expect:
        assert word in lines[0], (word, lines[0])
    assert _snapshot(tmp_path) == before
