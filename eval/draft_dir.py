"""The draft-directory format: one folder per draft, marked by `draftsmith_draft.json`.

Every draft draftsmith writes (a training checkpoint, best/, a compare variant) is a directory holding
FILE, a JSON object whose "kind" is a registered DraftKind (the built-in ones below, with the files each
holds; a plugin's from its own module with register_kind), plus that kind's files. A kind is declared
once, with everything the decoder and the exporter need of it: its flags, the function that serves a
directory of it (load_proposer calls it), the in-memory model class it serves, and the export formats
that hold it (pipeline/formats.py reads `exports`).

Optional keys: "step", "train_key" (the training inputs' hash, pipeline/checkpoints.py), "proposer":
"hybrid" (promoted as a hybrid with n-gram lookups), "serve" (SERVE_KEYS settings fixed at
promotion, e.g. the fitted tree budget), and a datastore (eval/datastore.py) beside the weights.
This module is the one reader and writer of FILE, and holds the registry of draft kinds.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

FILE = "draftsmith_draft.json"
SERVED_AS = ("hybrid", "hybrid-nostore", "datastore")  # "<how>:<draft dir>": a directory served another way
# the serving settings a draft's "serve" may fix: a hybrid's tree node budget (a positive int), and whether
# its model's chain is sampled from q in a sampled round's tree (a bool; eval/proposers/hybrid.py)
SERVE_KEYS = ("max_nodes", "sampled_chain")


class DraftDirError(ValueError):
    """Not a usable draft directory; the message names the path and what is wrong."""


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft directory, declared once (register_kind)."""

    name: str
    stores_weights: bool = True  # False: the directory holds only FILE, and the kind's name alone is a draft
    layer_by_layer: bool = False  # runs the target's own layers in the lean forward (only the families it covers)
    # an HF causal LM with its own tokenizer: checked against the target's before decoding, and what HF's
    # assisted generation takes as its assistant_model
    standalone_lm: bool = False
    # How the decoder serves it. Each is a callable or "module:attribute" (the built-in kinds name their
    # proposer modules so, since those import this one): load(directory, meta, target, dtype) -> Proposer
    # (directory None for a kind that stores no weights); an in-memory `module` instance (a trained head)
    # is served by wrap(module, target) -> Proposer.
    load: str | Callable | None = None
    module: str | type | None = None
    wrap: str | Callable | None = None
    exports: tuple[str, ...] = ()  # the export formats (pipeline/formats.py) that hold a draft of this kind

    def __post_init__(self):
        if self.load is None:
            raise ValueError(f"draft kind {self.name!r}: give `load`, the function that serves a directory of it")
        if (self.module is None) != (self.wrap is None):
            raise ValueError(f"draft kind {self.name!r}: give both `module` and `wrap`, or neither")

    def loader(self) -> Callable:
        return resolve(self.load)

    def module_class(self) -> type | None:
        return None if self.module is None else resolve(self.module)

    def wrapper(self) -> Callable | None:
        return None if self.wrap is None else resolve(self.wrap)


def resolve(ref):
    """A "module:attribute" reference -> that attribute (imported now); anything else -> itself."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


_KINDS: dict[str, DraftKind] = {}


def register_kind(kind: DraftKind) -> DraftKind:
    """Add a draft kind (once per name; "ngram" and the SERVED_AS prefixes are load_proposer's own)."""
    if kind.name in _KINDS or kind.name == "ngram" or kind.name in SERVED_AS or not kind.name.isidentifier():
        raise ValueError(f"draft kind {kind.name!r} is taken or not a plain identifier")
    _KINDS[kind.name] = kind
    return kind


# The built-in kinds, each with the files it holds beside FILE, how it is served and the formats that export it.
for _kind in (
        # head.safetensors: an EAGLE head over the target's features
        DraftKind("eagle", load="eval.proposers.eagle:load", module="eval.heads:EagleHead",
                  wrap="eval.proposers.eagle:EagleProposer"),
        # head.safetensors: an EAGLE-3 head over three target layers, speculators' weight names
        DraftKind("eagle3", load="eval.proposers.eagle3:load", module="eval.heads:Eagle3Head",
                  wrap="eval.proposers.eagle3:Eagle3Proposer", exports=("speculators", "eagle3")),
        # head.safetensors: Medusa heads over the target's features
        DraftKind("medusa", load="eval.proposers.medusa:load", exports=("medusa",)),
        # an ordinary HF checkpoint (config.json, model.safetensors, tokenizer); LoRA: adapter/
        DraftKind("draft_lm", standalone_lm=True, load="eval.proposers.draft_lm:load", exports=("hf",)),
        # adapter.safetensors: the target's first layers are reused
        DraftKind("self_spec", layer_by_layer=True, load="eval.proposers.draft_lm:load_self_spec",
                  module="eval.drafts:SelfSpecDraft", wrap="eval.proposers.draft_lm:serve_self_spec"),
        # nothing: built from the target at load time
        DraftKind("int8", stores_weights=False, layer_by_layer=True, load="eval.proposers.draft_lm:load_int8"),
        # head.safetensors: a DFlash draft (a block per forward over fused target layers), speculators' weight names
        DraftKind("dflash", load="eval.proposers.dflash:load", module="eval.heads:DFlashHead",
                  wrap="eval.proposers.dflash:DFlashProposer", exports=("speculators-dflash",))):
    register_kind(_kind)


def kinds() -> tuple[DraftKind, ...]:
    """Every registered draft kind, the built-in ones first, in registration order."""
    return tuple(_KINDS.values())


def kind_names() -> tuple[str, ...]:
    return tuple(k.name for k in kinds())


def is_standalone_lm(name: str) -> bool:
    """`name` (a kind, or another form bench and load_proposer take: "ngram", "hybrid") is a standalone LM."""
    return name in _KINDS and _KINDS[name].standalone_lm


def get_kind(name: str) -> DraftKind:
    if name not in _KINDS:
        raise DraftDirError(f"draft kind {name!r} is not one of {', '.join(kind_names())}")
    return _KINDS[name]


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
    if not isinstance(meta, dict) or meta.get("kind") not in kind_names():
        kind = meta.get("kind") if isinstance(meta, dict) else None
        raise DraftDirError(f"{f}: unknown draft kind {kind!r} (expected one of {', '.join(kind_names())})")
    return meta


def write_meta(directory: str | Path, meta: dict) -> Path:
    """Write FILE (meta must name a known "kind"); the directory is created if needed."""
    if meta.get("kind") not in kind_names():
        raise DraftDirError(f"draft kind {meta.get('kind')!r} is not one of {', '.join(kind_names())}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / FILE).write_text(json.dumps(meta, indent=2))
    return d / FILE
