"""Stage 4, log: Weights & Biases, offline by default, and a no-op twin so tests never need W&B.

Each stage is one W&B run, grouped by the draftsmith run id, with its files under
`runs/<domain>/<run-id>/wandb/`. Offline runs are uploaded later with `wandb sync <dir>`.
"""

from __future__ import annotations

import os
from pathlib import Path


class NoOpTracker:
    """Same interface as WandbTracker; records nothing (tests, wandb.mode=disabled)."""

    run_dir: Path | None = None

    def log(self, metrics: dict, step: int | None = None) -> None:
        pass

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def summary(self, metrics: dict) -> None:
        pass

    def draft_artifact(self, name: str, directory: Path, *, aliases: list[str], metadata: dict,
                       used: bool = False) -> None:
        """A draft directory as a W&B artifact of type "draft": `used` marks it an input of this run (the
        champion a challenger starts from), else an output (the challenger)."""

    def finish(self) -> None:
        pass


class WandbTracker(NoOpTracker):
    def __init__(self, *, project: str, entity: str | None, mode: str, group: str, stage: str,
                 config: dict, directory: Path, name: str | None = None):
        import wandb  # imported here: the decoder and `draftsmith bench` must not need wandb

        directory.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb = wandb
        self.run = wandb.init(project=project, entity=entity, mode=mode, group=group, job_type=stage,
                              name=name or f"{group}-{stage}", config=config, dir=str(directory), reinit="create_new")
        self.run_dir = Path(self.run.dir).parent  # .../wandb/offline-run-*/ (files/ is run.dir)
        self.mode = mode

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self._wandb.Table(columns=columns, data=rows)})

    def summary(self, metrics: dict) -> None:
        for k, v in metrics.items():
            self.run.summary[k] = v

    def draft_artifact(self, name: str, directory: Path, *, aliases: list[str], metadata: dict,
                       used: bool = False) -> None:
        art = self._wandb.Artifact(name, type="draft", metadata=metadata)
        art.add_dir(str(directory))
        if used and self.mode == "online":
            self.run.use_artifact(art, aliases=aliases)
        else:  # offline runs cannot use an artifact: the input is logged, and the output's metadata names it
            self.run.log_artifact(art, aliases=aliases)

    def finish(self) -> None:
        self.run.finish()


def resolve_mode(mode: str) -> str:
    """auto -> online when the user has a key, offline otherwise (W&B never blocks a run)."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def make_tracker(recipe, run_dir: Path, stage: str, group: str | None = None) -> NoOpTracker:
    """A stage's W&B run, grouped by the run id (distill's stages) or by `group` (every retrain of a domain:
    "<domain>-retrain", one run each, named by its run id)."""
    mode = resolve_mode(recipe.wandb.mode)
    if mode == "disabled":
        return NoOpTracker()
    return WandbTracker(project=recipe.wandb.project, entity=recipe.wandb.entity, mode=mode,
                        group=group or Path(run_dir).name, stage=stage, config=recipe.to_dict(),
                        directory=Path(run_dir), name=f"{Path(run_dir).name}-{stage}" if group else None)
