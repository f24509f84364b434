"""`python tests/faulted.py [--kill-at POINT[@N]] [--timing promote|keep] -- <draftsmith arguments>`: the
draftsmith CLI in this process, SIGKILLed at the N-th time a kill point (pipeline/faults.py) is reached, and
with the gate's judged timing given rather than measured. Timing on a tiny model is noise; with the judged
figures passed in, the real gate (pipeline/gate.py via retrain.decide) decides the same way on every run of a
fault chain. Counts, acceptance and exactness stay measured."""

import argparse
import copy
import os
import signal
import sys

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


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--kill-at")
    p.add_argument("--timing", choices=sorted(TIMING))
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    if a.kill_at:
        kill_at(a.kill_at)
    if a.timing:
        give_timing(a.timing)
    sys.exit(main(a.args[1:] if a.args[:1] == ["--"] else a.args))
