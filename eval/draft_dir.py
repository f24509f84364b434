"""The draft-directory format: one folder per draft, marked by `draftsmith_draft.json`.

Every draft draftsmith writes (a training checkpoint, best/, a compare variant) is a directory holding
FILE, a JSON object whose "kind" is one of KINDS, plus the kind's own weights:

  eagle, medusa  head.safetensors (a head over the target's features)
  eagle3         head.safetensors (an EAGLE-3 head over three target layers; speculators' weight names)
  self_spec      adapter.safetensors (the target's first layers are reused, not stored)
  draft_lm       an ordinary HF checkpoint (config.json, model.safetensors, tokenizer), and with LoRA
                 the PEFT adapter in adapter/
  int8           nothing: an int8 copy of the target is built at load time

Optional keys: "step", "train_key" (the training inputs' hash, pipeline/checkpoints.py), "proposer":
"hybrid" (promoted as a hybrid with n-gram lookups), "serve" (SERVE_KEYS settings fixed at
promotion, e.g. the fitted tree budget), and a datastore (eval/datastore.py) beside the weights.
This module is the one reader and writer of FILE.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "draftsmith_draft.json"
KINDS = ("eagle", "eagle3", "medusa", "draft_lm", "self_spec", "int8")
SERVED_AS = ("hybrid", "hybrid-nostore", "datastore")  # "<how>:<draft dir>": a directory served another way
SERVE_KEYS = ("max_nodes",)  # the serving settings a draft's "serve" may fix


class DraftDirError(ValueError):
    """Not a usable draft directory; the message names the path and what is wrong."""


def served_form(source: str) -> tuple[str | None, str]:
    """"<how>:<draft dir>" (how in SERVED_AS) -> (how, the directory); any other source -> (None, source)."""
    how, sep, rest = source.partition(":")
    return (how, rest) if sep and how in SERVED_AS else (None, source)


def is_draft_dir(directory: str | Path) -> bool:
    return (Path(directory) / FILE).is_file()


def read_meta(directory: str | Path) -> dict:
    """The draft's metadata; DraftDirError when the directory is missing, unmarked, or of no known kind."""
    d = Path(directory)
    if not d.is_dir():
        raise DraftDirError(f"draft directory {d} does not exist (give a draft directory or 'ngram')")
    f = d / FILE
    if not f.is_file():
        raise DraftDirError(f"{d} is not a draft directory: no {FILE}")
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError:
        raise DraftDirError(f"{f}: bad JSON") from None
    if not isinstance(meta, dict) or meta.get("kind") not in KINDS:
        kind = meta.get("kind") if isinstance(meta, dict) else None
        raise DraftDirError(f"{f}: unknown draft kind {kind!r} (expected one of {', '.join(KINDS)})")
    return meta


def write_meta(directory: str | Path, meta: dict) -> Path:
    """Write FILE (meta must name a known "kind"); the directory is created if needed."""
    if meta.get("kind") not in KINDS:
        raise DraftDirError(f"draft kind {meta.get('kind')!r} is not one of {', '.join(KINDS)}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / FILE).write_text(json.dumps(meta, indent=2))
    return d / FILE
