"""`python tests/faulted.py [--kill-at POINT[@N]] [--timing promote|keep] -- <draftsmith arguments>`: the
draftsmith CLI in this process, SIGKILLed at the N-th time a kill point (pipeline/faults.py) is reached, and
with the gate's judged timing given rather than measured. Timing on a tiny model is noise; with the judged
figures passed in, the real gate (pipeline/gate.py via retrain.decide) decides the same way on every run of a
fault chain. Counts, acceptance and exactness stay measured.

`python tests/faulted.py --serve`: the same, for many runs at once, each in a child forked from one process
that has imported the project and its libraries once and run nothing (a fresh interpreter spends ~5 s of a
tiny run's ~10 s importing). Requests come on stdin, one JSON line each: {"id", "args": [...], "kill":
"POINT[@N]" or null, "timing": "promote"|"keep", "log": a file for the child's stdout and stderr, "timeout":
seconds}; each is answered on stdout when its child ends: {"id", "returncode": as subprocess gives it (-9:
SIGKILLed), "timed_out": bool}."""

import argparse
import atexit
import copy
import importlib
import json
import os
import pkgutil
import select
import signal
import sys
import threading
import time
import traceback

import pipeline.retrain as retrain
from pipeline import faults
from pipeline.cli import main

# Speedups over plain decoding the judged results are given: the challenger 1.3x the champion, both above the
# n-gram baseline ("promote"), or the challenger at 0.8x the champion and below plain decoding ("keep").
TIMING = {"promote": {"champion": 1.5, "challenger": 1.95, "ngram": 1.1},
          "keep": {"champion": 1.5, "challenger": 0.8, "ngram": 1.1}}


def kill_at(spec: str) -> None:
    name, _, nth = spec.partition("@")
    hits = [0]

    def watcher(point: str) -> None:
        if point == name:
            hits[0] += 1
            if hits[0] == int(nth or 1):
                os.kill(os.getpid(), signal.SIGKILL)

    faults.watch(watcher)


def with_timing(judged: dict, speedups: dict) -> dict:
    """judged with each result's per-prompt wall times set to its given speedup over 10 tokens/s plain runs."""
    out = copy.deepcopy(judged)
    for name, r in out.items():
        if r is None:
            continue
        sp = speedups[name]
        r["speedup"] = sp
        r["stats"]["per_prompt"] = [p | {"wall_s": p["n_tokens"] / (10 * sp)} for p in r["stats"]["per_prompt"]]
        r["plain_stats"]["per_prompt"] = [p | {"wall_s": p["n_tokens"] / 10} for p in r["plain_stats"]["per_prompt"]]
    return out


def give_timing(verdict: str) -> None:
    judge, first = retrain.judge, retrain.first_draft_judged
    retrain.judge = lambda *a, **kw: with_timing(judge(*a, **kw), TIMING[verdict])
    retrain.first_draft_judged = lambda *a, **kw: with_timing(first(*a, **kw), TIMING[verdict])


def run(args: list[str], kill: str | None, timing: str | None) -> int | str | None:
    if kill:
        kill_at(kill)
    if timing:
        give_timing(timing)
    return main(args[1:] if args[:1] == ["--"] else args)


def preload() -> None:
    """Import every module a run may import lazily: all of pipeline/ and eval/, and the libraries they load on
    first use. Modules that need the engines' own venv (vLLM) are left to fail where they are used."""
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import matplotlib
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401

    matplotlib.use("Agg")  # as pipeline/report.py does before pyplot
    import matplotlib.pyplot  # noqa: F401

    import eval as eval_pkg
    import pipeline

    for pkg in (pipeline, eval_pkg):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            try:
                importlib.import_module(m.name)
            except ImportError:
                pass


def child(req: dict) -> None:
    """The forked child: stdin from /dev/null, stdout and stderr into the request's log; exits as the CLI would."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        code = run(req["args"], req.get("kill"), req.get("timing"))
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if not isinstance(code, int):  # as sys.exit: None is 0, a message is printed and exits 1
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()  # as an interpreter's exit does; then leave without unwinding the server's own frames
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve() -> None:
    """Fork a child for each request as it arrives, answer each as its child ends (requests run in parallel)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else writes to stdout (an import's print) goes to stderr, not into the answers
    preload()
    # fork copies only the calling thread: a thread started by an import would be missing in every child
    assert threading.active_count() == 1, f"an import started a thread: {threading.enumerate()}"
    running: dict[int, tuple[str, float]] = {}  # pid -> (request id, deadline)
    pending, open_ = b"", True
    while open_ or running:
        if open_ and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 65536)
            open_, pending = bool(chunk), pending + chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    child(req)
                running[pid] = (req["id"], time.monotonic() + req.get("timeout", 600))
        elif not open_:
            time.sleep(0.02)
        for pid, (rid, deadline) in list(running.items()):
            timed_out = time.monotonic() > deadline
            if timed_out:
                os.kill(pid, signal.SIGKILL)
            done, status = os.waitpid(pid, 0 if timed_out else os.WNOHANG)
            if done:
                del running[pid]
                print(json.dumps({"id": rid, "returncode": os.waitstatus_to_exitcode(status),
                                  "timed_out": timed_out}), file=answers, flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true")
    p.add_argument("--kill-at")
    p.add_argument("--timing", choices=sorted(TIMING))
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    if a.serve:
        serve()
    else:
        sys.exit(run(a.args, a.kill_at, a.timing))
