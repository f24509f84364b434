"""The train stage's checkpoints: train/checkpoint-{step:06d}/ = a draft directory (eval/draft_dir.py)
+ trainer_state.pt, written to a temporary directory and renamed; a run's own checkpoints (by the training
recipe's key, Recipe.train_key) are resumed, those of another are set aside."""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from eval import draft_dir

from .faults import kill_point

STATE_FILE = "trainer_state.pt"


def checkpoints(train_dir: Path) -> list[Path]:
    """Complete checkpoints (a draft directory and trainer_state.pt), oldest first."""
    return sorted(p for p in train_dir.glob("checkpoint-*")
                  if p.is_dir() and (p / STATE_FILE).exists() and draft_dir.is_draft_dir(p))


BUDGET_FILE = "budget.json"  # train/budget.json: the steps train.max_minutes planned, which a resume keeps


def set_aside_foreign(train_dir: Path, key: str) -> None:
    """Checkpoints written under another training recipe (a changed train.* override, or compare
    --steps on a run dir that holds a shorter run) are not resumed: they move, with their manifest, to
    train/stale-<their key>/ (nothing is deleted), and training starts from step 0 under its own plan. Checkpoints from
    before train_key was stored carry none and are resumed as before."""
    ckpts = checkpoints(train_dir)
    keys = {draft_dir.read_meta(ck).get("train_key") for ck in ckpts}
    foreign = sorted(k for k in keys if k not in (None, key))
    if not foreign:
        return
    dest, n = train_dir / f"stale-{foreign[-1]}", 2
    while dest.exists():  # set aside before (recipes switched back and forth): never merge into it
        dest, n = train_dir / f"stale-{foreign[-1]}-{n}", n + 1
    dest.mkdir()
    for p in ckpts + [train_dir / "manifest.json", train_dir / BUDGET_FILE]:  # their time budget's plan too
        if p.exists():
            shutil.move(str(p), str(dest / p.name))
    print(f"draftsmith: {train_dir} held checkpoints of another training recipe (train key "
          f"{', '.join(foreign)} vs {key}); moved them to {dest} and training from step 0", file=sys.stderr)


def write_checkpoint(train_dir: Path, step: int, save_draft, state=None) -> Path:
    """save_draft(directory) + trainer_state.pt (`state()` taken after the draft is saved, default
    {"step": step}) into a temporary directory, renamed to train/checkpoint-{step:06d}."""
    final = train_dir / f"checkpoint-{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=train_dir, prefix=f".checkpoint-{step:06d}-"))
    save_draft(tmp)
    kill_point("train.draft_saved")
    torch.save(state() if state is not None else {"step": step}, tmp / STATE_FILE)
    kill_point("train.before_rename")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def trainer_state(optimizer, scheduler, step: int) -> dict:
    """What a resumed run restores: optimizer, scheduler, step and every RNG the loop draws from."""
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}


def restore(resume: Path, optimizer, scheduler) -> int:
    """Load a checkpoint's trainer state into the optimizer, scheduler and RNGs; return its step."""
    st = torch.load(resume / STATE_FILE, weights_only=False)
    optimizer.load_state_dict(st["optimizer"])
    scheduler.load_state_dict(st["scheduler"])
    random.setstate(st["rng"]["python"])
    np.random.set_state(st["rng"]["numpy"])
    torch.set_rng_state(st["rng"]["torch"])
    return st["step"]
