"""An int8 copy of the target, built at load time (eval/drafts.py): nothing to train, a baseline.
Its checkpoint is a draft directory that only names the kind."""

from __future__ import annotations

from eval import draft_dir

from .base import DraftMethod


class Int8(DraftMethod):
    name = "int8"
    help = "an int8 copy of the target, no training: a baseline"
    variants = {"int8": {}}
    trains = False

    def save(self, module, directory, extra, step):
        draft_dir.write_meta(directory, {"kind": "int8", **extra, "step": step})
