"""A W&B key given in the environment never lands on disk or in the output: a tiny distill with W&B
offline and a recognisable fake key, then every file under the runs dir (logs, recipe.yaml, config dumps,
W&B's offline run files, report, metrics) and under W&B's own settings, cache and data directories is
searched for it, as bytes, as is the captured stdout and stderr. (W&B 0.31 records the command line, git
commit, host and Python in each run's metadata, not the environment: tracking.py needs no setting.)"""

import os
import subprocess
import sys
from pathlib import Path

from helpers import TINY_BUDGET

ROOT = Path(__file__).resolve().parent.parent
KEY = "local-" + "c0ffee5ecret" * 3 + "draftsmith"  # the shape of a W&B key (a prefix and 40 hex-ish chars)


def test_wandb_key_never_written(tiny_target, tmp_path):
    runs, wb = tmp_path / "runs", tmp_path / "wandb-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "DRAFTSMITH_"))}
    env |= {"WANDB_API_KEY": KEY, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env |= {f"WANDB_{d.upper()}_DIR": str(wb / d) for d in ("config", "cache", "data")}  # W&B's files outside the run
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "distill", "--recipe", "recipes/code.yaml",
                        f"target={tiny_target}", "dtype=float32", f"runs_dir={runs}", "wandb.mode=offline",
                        *TINY_BUDGET, "evaluate.hybrid=false", "--run-id", "s"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    run = runs / "code" / "s"
    wandb_files = list(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(wandb_files) == 3  # W&B did record the three stages, its strings as plain bytes a key would be
    assert any(b"s-generate" in f.read_bytes() for f in wandb_files)
    files = [f for root in (runs, wb) for f in root.rglob("*") if f.is_file() and not f.is_symlink()]
    assert any(f.name == "recipe.yaml" for f in files) and any(f.suffix == ".log" for f in files)
    leaks = [str(f) for f in files if KEY.encode() in f.read_bytes()]
    assert not leaks
    assert KEY not in p.stdout and KEY not in p.stderr
