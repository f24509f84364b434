"""Crash safety: `distill` SIGKILLed at named points (pipeline/faults.py), rerun, and compared with a run
that was never interrupted.

Each chain is one run directory: the first run is killed at the chain's first point, the rerun (same
command, same run id) at the next, ... and a last clean rerun finishes it. Its outputs must then equal
the uninterrupted reference's: the generated rows (none lost or duplicated), every checkpoint's
weights, the train log, every candidate's measured acceptance, the promoted draft; and nothing
half-written is left or counted as complete. The reference and the chains run as parallel processes.

To add a stage (registry, retrain): append a Chain to CHAINS with its command and its kill points; with
`before` (commands run uninterrupted first, e.g. the distill that makes a champion) when it needs a state
to start from; and, when it writes other outputs, an `outputs(path) -> dict` of what must not depend on the
kills. Chains with the same `before` and command share one reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from helpers import TINY_BUDGET

ROOT = Path(__file__).resolve().parent.parent
RUN_ID = "faults"
# The served forms are built from the checkpoint with the highest τ, ties broken by measured speed: off,
# so that which candidates exist does not depend on timing.
DETERMINISTIC = ["evaluate.hybrid=false"]


def distill_command(target: Path, runs: Path) -> list[str]:
    return ["distill", "--recipe", "recipes/code.yaml", f"target={target}", "dtype=float32", f"runs_dir={runs}",
            "wandb.mode=disabled", *TINY_BUDGET, *DETERMINISTIC, "--run-id", RUN_ID]


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: (str(v.dtype), tuple(v.shape), hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest())
            for k, v in load_file(str(path)).items()}


def _draft_files(d: Path) -> dict:
    """A draft directory's weights (tensor by tensor) and its other data files, as comparable values."""
    out = {}
    for f in sorted(d.iterdir()):
        if f.suffix == ".safetensors":
            out[f.name] = _tensors(f)
        elif f.suffix == ".npy":
            out[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _rows(stage: Path) -> list[dict]:
    from datasets import load_from_disk

    m = json.loads((stage / "manifest.json").read_text())
    rows = []
    for name in sorted(m["shards"]):
        rows += load_from_disk(str(stage / name)).to_list()
    return rows


def distill_outputs(run: Path) -> dict:
    """What a distill run must produce whatever the interruptions: everything but timings."""
    gen = json.loads((run / "generate" / "manifest.json").read_text())
    train = json.loads((run / "train" / "manifest.json").read_text())
    m = json.loads((run / "metrics.json").read_text())
    measured = {p.stem: json.loads(p.read_text()) for p in sorted((run / "eval").glob("*.json"))}
    return {
        "prompts": {p.name: p.read_text() for p in sorted((run / "prompts").glob("*.jsonl"))},
        "shards": {n: e["rows"] for n, e in gen["shards"].items()}, "generate_complete": gen["complete"],
        "rows": _rows(run / "generate"),
        "checkpoints": {n: _draft_files(run / "train" / n) for n in train["checkpoints"]},
        "train_manifest": {k: v for k, v in train.items() if k != "tokens_per_s"},
        "train_log": (run / "train" / "log.jsonl").read_text(),
        "measured": {n: {k: r["stats"][k] for k in ("alpha", "tau", "accept_per_pos", "n_tokens")}
                     | {"exact_match": r["exact_match"]} for n, r in measured.items()},
        "candidates": [(c["name"], c["alpha"], c["tau"], c["greedy_exact"]) for c in m["checkpoints"]],
        "ngram": {k: m["ngram_baseline"][k] for k in ("alpha", "tau", "greedy_exact")},
        "draft_method": m["draft_method"], "fp32_exact": m["fp32_exact"],
        "complete": json.loads((run / "status.json").read_text())["complete"],
    }


@dataclass
class Chain:
    """One run directory killed at each of `kills` in turn (`point` or `point@N`: its N-th hit), then finished."""

    name: str
    command: Callable[[Path, Path], list[str]]  # (tiny target, runs dir) -> draftsmith arguments
    kills: list[str]
    outputs: Callable[[Path], dict] = distill_outputs
    run: Callable[[Path], Path] = field(default=lambda runs: runs / "code" / RUN_ID)  # what `outputs` reads
    before: Callable[[Path, Path], list[list[str]]] = field(default=lambda target, runs: [])

    @property
    def reference(self) -> tuple:
        return self.before, self.command


CHAINS = [
    Chain("generate-train", distill_command, [
        "generate.mid_shard@1",  # the first shard half generated
        "generate.shard_saved@1",  # shard 0 renamed into place, not yet in the manifest
        "generate.shard_recorded@1",
        "generate.shard_saved@2",  # shard 1 recorded, shard 2 saved
        "generate.before_complete",
        "features.before_rename",  # the features cache written aside
        "train.draft_saved@1",  # checkpoint-2 half written (weights, no trainer state)
        "train.before_rename@1",
        "train.after_rename@1",  # checkpoint-2 complete: the rerun resumes from it
        "train.after_rename@1",  # checkpoint-4 complete, no train manifest
        "train.before_manifest",
    ]),
    Chain("open-evaluate", distill_command, [
        "cli.latest_pointer",  # the run directory made, the latest link written aside
        "generate.prompt_file@1",  # one prompt set of three written
        "generate.prompts_written",
        "evaluate.measured@1",  # one checkpoint's measurement stored
        "evaluate.measured@2",  # the other checkpoint's and the n-gram baseline's
        "evaluate.before_best",
        "evaluate.best_copied",  # best/ copied aside
        "evaluate.best_removed",  # the old best/ gone, the new one not yet renamed
        "evaluate.before_metrics",
        "evaluate.before_report",
        "cli.before_complete",
    ]),
]


def _env(kill: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DRAFTSMITH_KILL_AT", "WANDB_API_KEY")}
    env |= {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # one thread: the runs go in parallel
    if kill:
        env["DRAFTSMITH_KILL_AT"] = kill
    return env


def _draftsmith(args: list[str], kill: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=_env(kill),
                          capture_output=True, text=True, timeout=600)


def _run_chain(chain: Chain, target: Path, runs: Path, kills: list[str]) -> list[tuple[str | None, int, str]]:
    """[(kill point or None, return code, stderr tail)] for each run of the chain (kills=[]: its reference)."""
    for args in chain.before(target, runs):
        p = _draftsmith(args)
        assert p.returncode == 0, p.stderr[-3000:]
    out = []
    for kill in kills + [None]:
        p = _draftsmith(chain.command(target, runs), kill)
        out.append((kill, p.returncode, p.stderr[-3000:]))
        if p.returncode not in (0, -signal.SIGKILL):
            break
    return out


@pytest.fixture(scope="module")
def runs(tiny_target, tmp_path_factory):
    """{chain name, or ("reference", chain name): (runs dir, [(kill, return code, stderr)])}: every chain and one
    uninterrupted reference per distinct (before, command), all as parallel processes."""
    refs = {}
    for c in CHAINS:
        refs.setdefault(c.reference, c)
    jobs = [(("reference", c.name), c, []) for c in refs.values()] + [(c.name, c, c.kills) for c in CHAINS]
    dirs = {key: tmp_path_factory.mktemp("-".join(key) if isinstance(key, tuple) else key) for key, _, _ in jobs}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {key: pool.submit(_run_chain, c, tiny_target, dirs[key], kills) for key, c, kills in jobs}
        out = {key: (dirs[key], f.result()) for key, f in futures.items()}
    for c in CHAINS:  # each chain's reference under its own name too
        out.setdefault(("reference", c.name), out[("reference", refs[c.reference].name)])
    return out


def test_the_table_covers_every_kill_point():
    """Every kill_point() in pipeline/ is driven by a chain (a new one must be added to CHAINS), and the
    chains name no point that does not exist."""
    in_code = set()
    for f in (ROOT / "pipeline").rglob("*.py"):
        in_code |= set(re.findall(r'kill_point\("([^"]+)"\)', f.read_text()))
    in_table = {k.split("@")[0] for c in CHAINS for k in c.kills}
    assert in_table == in_code
    assert len(in_code) >= 16


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_each_kill_point_is_reached_and_the_rerun_finishes(runs, chain):
    """Each run dies by SIGKILL at its point (so the point was reached), and the last rerun succeeds."""
    _, ref = runs["reference", chain.name]
    assert ref[-1][1] == 0, ref[-1][2]
    _, results = runs[chain.name]
    for kill, rc, err in results[:-1]:
        assert rc == -signal.SIGKILL, f"{kill}: exit {rc}\n{err}"
    assert [k for k, _, _ in results] == chain.kills + [None]
    assert results[-1][1] == 0, results[-1][2]


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_resumed_outputs_equal_the_uninterrupted_run(runs, chain):
    ref_dir, _ = runs["reference", chain.name]
    runs_dir, results = runs[chain.name]
    assert results[-1][1] == 0, results[-1][2]
    ref, got = chain.outputs(chain.run(ref_dir)), chain.outputs(chain.run(runs_dir))
    for key in ref:
        assert got[key] == ref[key], key
    if "rows" in got:  # no row lost or duplicated
        ids = [r["id"] for r in got["rows"]]
        train = (chain.run(runs_dir) / "prompts" / "train.jsonl").read_text().splitlines()
        assert len(ids) == len(set(ids)) == len(train)


DISTILLS = [c for c in CHAINS if c.outputs is distill_outputs]


@pytest.mark.parametrize("chain", DISTILLS, ids=lambda c: c.name)
def test_the_promoted_draft_is_the_measured_best(runs, chain):
    """Promotion is by measured wall-clock speedup, so which checkpoint wins may differ from the
    reference's (it does between two uninterrupted runs too); what must hold: the promoted one is the
    best of its own run's measurements, its figures are the deterministic ones the reference measured
    for it, and best/ holds exactly its weights."""
    ref_run, run = chain.run(runs["reference", chain.name][0]), chain.run(runs[chain.name][0])
    m = json.loads((run / "metrics.json").read_text())
    assert m["checkpoint"] == max(m["checkpoints"], key=lambda c: c["speedup"])["name"]
    ref_measured = json.loads((ref_run / "eval" / f"{m['checkpoint']}.json").read_text())
    for k in ("alpha", "tau", "accept_per_pos"):
        assert m[k] == ref_measured["stats"][k], k
    assert m["greedy_exact"] is True
    assert _draft_files(run / "best") == _draft_files(run / "train" / m["checkpoint"])
    assert f"`{m['checkpoint']}`" in (run / "report.md").read_text()
    assert (run.parent / "latest").resolve() == run


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_no_temporary_file_is_left(runs, chain):
    """No temporary (dot-named, written-aside) file or directory survives the reruns."""
    runs_dir = runs[chain.name][0]
    assert not [p for p in runs_dir.rglob(".*") if p.name != ".manifest.lock" and "wandb" not in p.parts]


@pytest.mark.parametrize("chain", DISTILLS, ids=lambda c: c.name)
def test_only_complete_shards_and_checkpoints_are_kept(runs, chain):
    """Everything a stage counts as complete is: every shard directory in the manifest, every checkpoint
    whole and listed."""
    run = chain.run(runs[chain.name][0])
    gen = json.loads((run / "generate" / "manifest.json").read_text())
    assert sorted(p.name for p in (run / "generate").glob("shard-*")) == sorted(gen["shards"])
    train = json.loads((run / "train" / "manifest.json").read_text())
    ckpts = sorted(p.name for p in (run / "train").glob("checkpoint-*"))
    assert ckpts == train["checkpoints"] and all((run / "train" / c / "trainer_state.pt").exists() for c in ckpts)
