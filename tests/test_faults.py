"""Crash safety: `distill` SIGKILLed at named points (pipeline/faults.py), rerun, and compared with a run
that was never interrupted.

Each chain is one run directory: the first run is killed at the chain's first point, the rerun (same
command, same run id) at the next, ... and a last clean rerun finishes it. Its outputs must then equal
the uninterrupted reference's: the generated rows (none lost or duplicated), every checkpoint's
weights, the train log, every candidate's measured acceptance, the promoted draft; and nothing
half-written is left or counted as complete. The reference and the chains run in parallel.
After every kill the champion pointer is still the one from before the run, unless the kill came after its
move (AFTER_MOVE). Each run goes through tests/faulted.py: the CLI in a child forked from one server process
that has imported it once, killed at its point, with the gate's judged timing given (a challenger 1.3x
the champion) so that the real gate promotes on every run alike; on a tiny model measured timing is noise.

To add a stage: append a Chain to CHAINS with its command and its kill points; with
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
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from helpers import TINY_BUDGET
from pipeline.registry import Registry
from pipeline.traffic import Ledger

ROOT = Path(__file__).resolve().parent.parent
RUN_ID = "faults"
# The served forms are built from the checkpoint with the highest τ, ties broken by measured speed: off,
# so that which candidates exist does not depend on timing.
DETERMINISTIC = ["evaluate.hybrid=false"]
# The champion under a retrain: one checkpoint (so best/ is not a timing-dependent pick), no report curves.
CHAMPION_BUDGET = [*TINY_BUDGET, "train.save_every=4", "report.curves=false"]
RETRAIN_ID = "retrain"
TRAFFIC = [f"def {n}(items, k={i}):\n    \"\"\"Return the {n} of items, using k.\"\"\"\n"
           for i, n in enumerate(["add", "scale", "clip", "merge", "split", "count", "find", "rotate"])]
# Kill points after which the champion pointer has moved (the gate promotes); before them it must not have.
AFTER_MOVE = {"registry.pointer_moved", "registry.decisions_tmp", "retrain.after_promote", "cli.before_complete"}


def distill_command(target: Path, runs: Path) -> list[str]:
    return ["distill", "--recipe", "recipes/code.yaml", f"target={target}", "dtype=float32", f"runs_dir={runs}",
            "wandb.mode=disabled", *TINY_BUDGET, *DETERMINISTIC, "--run-id", RUN_ID]


def champion_distill(target: Path, runs: Path) -> list[list[str]]:
    """The set-up of a retrain chain: a distill whose draft becomes the champion, and the new traffic."""
    (runs / "traffic.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TRAFFIC))
    return [["distill", "--recipe", "recipes/code.yaml", f"target={target}", "dtype=float32", f"runs_dir={runs}",
             "wandb.mode=disabled", *CHAMPION_BUDGET, *DETERMINISTIC, "--run-id", RUN_ID]]


def retrain_command(target: Path, runs: Path) -> list[str]:
    return ["retrain", "--recipe", "recipes/code.yaml", f"target={target}", "dtype=float32", f"runs_dir={runs}",
            "wandb.mode=disabled", *CHAMPION_BUDGET, *DETERMINISTIC, "retrain.steps=2",
            "--traffic", str(runs / "traffic.jsonl"), "--run-id", RETRAIN_ID]


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


def registry_outputs(ddir: Path, weights: bool = True) -> dict:
    """The registry and the traffic ledger, without times and generated batch ids: the entries (with their
    weights when `weights`), the champion and its history, the decisions, the ledger's prompts (none lost or
    twice)."""
    reg = Registry(ddir)
    entries = [{k: e.get(k) for k in ("id", "kind", "parent", "run_dir")}
               | {"traffic": {k: (e.get("traffic") or {}).get(k) for k in ("rows", "new_rows")}}
               | ({"weights": _draft_files(Path(e["draft_dir"])),
                   "files": {f.name: (f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest())
                             for f in sorted(Path(e["draft_dir"]).iterdir()) if f.suffix != ".json"},
                   # its metadata names where it was warm-started from: under the chain's own runs dir
                   "meta": (Path(e["draft_dir"]) / "draftsmith_draft.json").read_text().replace(str(ddir), "<domain>")}
                  if weights else {}) for e in reg.entries()]
    for e in entries:
        e["run_dir"] = Path(e["run_dir"]).name
    lines = Ledger(ddir).lines()
    batches = list(dict.fromkeys(x["batch"] for x in lines))
    keys = [x["key"] for x in lines]
    assert len(keys) == len(set(keys)), "a prompt is in the ledger twice"
    champ = reg.champion()
    return {"entries": entries, "champion": champ and champ["id"],
            "history": [(h["id"], h["replaced"]) for h in reg.history()],
            "decisions": [(d["kind"], d["challenger"], d["champion"], d["promote"]) for d in reg.decisions()],
            "logged": [(d["kind"], d["challenger"], d["promote"]) for d in reg._read_decisions()],  # the file itself
            "ledger": [(x["key"], batches.index(x["batch"]), x["split"]) for x in lines],
            "batches": [(Ledger(ddir).manifest(b)["status"], Ledger(ddir).manifest(b).get("new_rows"))
                        for b in batches]}


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
        # which checkpoint is promoted follows measured speed: the entry's weights are checked against best/
        "registry": registry_outputs(run.parent, weights=False),
    }


def retrain_outputs(run: Path) -> dict:
    """What a retrain must produce whatever the interruptions: the registry (with every entry's weights), the
    ledger, the new prompts and generated rows, the challenger's checkpoints and served weights, its verdict."""
    gen = json.loads((run / "generate" / "manifest.json").read_text())
    train = json.loads((run / "train" / "manifest.json").read_text())
    gate = json.loads((run / "gate.json").read_text())
    return {
        "registry": registry_outputs(run.parent),
        "prompts": {p.name: p.read_text() for p in sorted((run / "prompts").glob("*.jsonl"))},
        "shards": {n: e["rows"] for n, e in gen["shards"].items()}, "generate_complete": gen["complete"],
        "new_rows": gen["incremental"]["new_rows"], "rows": _rows(run / "generate"),
        "checkpoints": {n: _draft_files(run / "train" / n) for n in train["checkpoints"]},
        "challenger": _draft_files(run / "challenger"),
        "gate": {k: gate[k] for k in ("kind", "challenger", "champion", "promote")},
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
    gate: str = "promote"  # the timing the gate is given (tests/faulted.py TIMING): the verdict it leads to

    @property
    def reference(self) -> tuple:
        return self.before, self.command, self.gate


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
    # distill admits its best/ (pipeline/retrain.py admit_distill): the first draft, promoted. A chain of its own
    # so that the two run side by side: the first run here goes through every stage before its kill.
    Chain("admit", distill_command, [
        "registry.entry_copied",  # the entry built aside, not renamed into entries/
        "registry.entry_published",  # the entry in place, the run's registered.json not written
        "retrain.after_register",
        "retrain.before_promote",
        "registry.pointer_tmp",  # the new pointer written aside
        "registry.pointer_moved",  # the champion moved, its decision not yet logged
        "registry.decisions_tmp",  # the decision log rewritten aside
        "retrain.after_promote",  # logged, gate.json not written
    ]),
    Chain("open-evaluate", distill_command, [
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
        "cli.latest_pointer",  # the run finished, the latest link written aside, status not yet complete
    ]),
    Chain("retrain", retrain_command, [
        "retrain.after_ingest",  # the batch directory published, not yet in the ledger: re-ingested
        "retrain.after_ledger",  # the batch committed: resumed, not read again
        "retrain.after_generate",
        "retrain.after_train",  # the challenger trained and served like the champion, not judged
        "retrain.after_judge",
        "registry.entry_copied",
        "registry.entry_published",
        "retrain.after_register",
        "retrain.before_promote",
        "registry.pointer_tmp",
        "registry.pointer_moved",
        "registry.decisions_tmp",
        "retrain.after_promote",
    ], outputs=retrain_outputs, run=lambda runs: runs / "code" / RETRAIN_ID, before=champion_distill),
]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env |= {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # one thread: the runs go in parallel
    return env


class Runner:
    """One `tests/faulted.py --serve` process that runs every chain's commands, each in a child forked from it: a
    SIGKILLed child is a SIGKILLed CLI process, without a fresh interpreter's imports each time. Thread-safe:
    each chain's thread waits for its own answers."""

    def __init__(self, logs: Path):
        self.logs, self.n, self.lock, self.waiting = logs, 0, threading.Lock(), {}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "faulted.py"), "--serve"], cwd=ROOT,
                                     env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._answers, daemon=True)
        self.reader.start()

    def _answers(self) -> None:
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self.lock:
                future = self.waiting.pop(answer["id"])
            future.set_result(answer)
        with self.lock:  # the server ended: nothing more will be answered
            for future in self.waiting.values():
                future.set_exception(RuntimeError(f"tests/faulted.py --serve exited with {self.proc.wait()}"))

    def __call__(self, args: list[str], kill: str | None = None, gate: str = "promote") -> tuple[int, str]:
        """(return code, the tail of its output) of one run of the CLI with `args`, killed at `kill`."""
        future = Future()
        with self.lock:
            self.n += 1
            rid, log = str(self.n), self.logs / f"{self.n:03d}.log"
            self.waiting[rid] = future
            self.proc.stdin.write(json.dumps({"id": rid, "args": args, "kill": kill, "timing": gate,
                                              "log": str(log), "timeout": 600}) + "\n")
            self.proc.stdin.flush()
        answer = future.result()
        tail = log.read_text()[-3000:] if log.exists() else ""
        assert not answer["timed_out"], f"{args} killed after 600 s\n{tail}"
        return answer["returncode"], tail

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _champion(runs: Path) -> str | None:
    p = runs / "code" / "registry" / "champion.json"
    return json.loads(p.read_text())["id"] if p.exists() else None


def _run_chain(draftsmith: Runner, chain: Chain, target: Path, runs: Path, kills: list[str]) -> list[tuple]:
    """[(kill point or None, return code, output tail, champion after it)] for each run of the chain (kills=[]:
    its reference); the first element: (None, 0, "", the champion before the chain's command)."""
    for args in chain.before(target, runs):
        rc, tail = draftsmith(args, gate=chain.gate)
        assert rc == 0, tail
    out = [(None, 0, "", _champion(runs))]
    for kill in kills + [None]:
        rc, tail = draftsmith(chain.command(target, runs), kill, chain.gate)
        out.append((kill, rc, tail, _champion(runs)))
        if rc not in (0, -signal.SIGKILL):
            break
    return out


@pytest.fixture(scope="module")
def runs(tiny_target, tmp_path_factory):
    """{chain name, or ("reference", chain name): (runs dir, [(kill, return code, output tail, champion after)],
    champion before)}: every chain and one uninterrupted reference per distinct (before, command), all in
    parallel, each run a process forked from one server."""
    refs = {}
    for c in CHAINS:
        refs.setdefault(c.reference, c)
    jobs = [(("reference", c.name), c, []) for c in refs.values()] + [(c.name, c, c.kills) for c in CHAINS]
    dirs = {key: tmp_path_factory.mktemp("-".join(key) if isinstance(key, tuple) else key) for key, _, _ in jobs}
    draftsmith = Runner(tmp_path_factory.mktemp("logs"))  # the logs apart from the runs, whose files are compared
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {key: pool.submit(_run_chain, draftsmith, c, tiny_target, dirs[key], kills)
                       for key, c, kills in jobs}
            out = {key: (dirs[key], f.result()[1:], f.result()[0][3]) for key, f in futures.items()}
    finally:
        draftsmith.close()
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
    _, ref, _ = runs["reference", chain.name]
    assert ref[-1][1] == 0, ref[-1][2]
    _, results, _ = runs[chain.name]
    for kill, rc, err, _ in results[:-1]:
        assert rc == -signal.SIGKILL, f"{kill}: exit {rc}\n{err}"
    assert [k for k, *_ in results] == chain.kills + [None]
    assert results[-1][1] == 0, results[-1][2]


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_resumed_outputs_equal_the_uninterrupted_run(runs, chain):
    ref_dir = runs["reference", chain.name][0]
    runs_dir, results, _ = runs[chain.name]
    assert results[-1][1] == 0, results[-1][2]
    ref, got = chain.outputs(chain.run(ref_dir)), chain.outputs(chain.run(runs_dir))
    for key in ref:
        assert got[key] == ref[key], key
    if "rows" in got:  # no row lost or duplicated
        ids = [r["id"] for r in got["rows"]]
        prompts = chain.run(runs_dir) / "prompts"
        train = (prompts / ("all_train.jsonl" if (prompts / "all_train.jsonl").exists() else "train.jsonl"))
        assert len(ids) == len(set(ids)) == len(train.read_text().splitlines())


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_the_champion_moves_only_with_the_promotion(runs, chain):
    """After each kill the champion pointer is the one from before the run, or, once the kill point is past
    the pointer's move, the one the uninterrupted run ends with; the pointer never names anything else."""
    _, ref, ref_before = runs["reference", chain.name]
    _, results, before = runs[chain.name]
    assert before == ref_before
    final = ref[-1][3]
    assert results[-1][3] == final
    assert final != before  # the real gate promoted on the timing it was given, so the pointer did move
    moved = False
    for kill, _, _, champion in results[:-1]:
        moved = moved or kill.split("@")[0] in AFTER_MOVE
        assert champion == (final if moved else before), kill


DISTILLS = [c for c in CHAINS if c.outputs is distill_outputs]


@pytest.mark.parametrize("chain", DISTILLS, ids=lambda c: c.name)
def test_the_promoted_draft_is_the_measured_best(runs, chain):
    """Promotion is by measured wall-clock speedup, so which checkpoint wins may differ from the
    reference's (it does between two uninterrupted runs too); what must hold: the promoted one is the
    best of its own run's measurements, its figures are the deterministic ones the reference measured
    for it, and best/ holds exactly its weights."""
    ref_run, run = chain.run(runs["reference", chain.name][0]), chain.run(runs[chain.name][0])
    champion = Registry(run.parent).champion()  # distill's admission: the promoted draft, copied whole
    assert champion["id"] == run.name and _draft_files(Path(champion["draft_dir"])) == _draft_files(run / "best")
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
    locks = {".manifest.lock", ".write.lock", ".lock", ".lock.takeover"}
    assert not [p for p in runs_dir.rglob(".*") if p.name not in locks and "wandb" not in p.parts]


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
