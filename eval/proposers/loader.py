"""From a draft (a directory, a module, or a name) to its proposer, and the forms a draft is served in."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import draft_dir
from ..datastore import Datastore, DatastoreError
from ..draft_dir import SERVE_KEYS
from .base import NoDraft, Proposer
from .draft_lm import DraftLMProposer
from .hybrid import HybridProposer
from .ngram import NgramProposer


def load_proposer(path_or_kind, target, dtype=None) -> Proposer:
    """The proposer for a draft, however it is given:
      a Proposer                -> itself
      a draft kind's `module`   -> its `wrap` (an EagleHead -> EagleProposer, an Eagle3Head ->
                                   Eagle3Proposer, a SelfSpecDraft -> DraftLMProposer with its d2t: draft_dir.py)
      another module            -> DraftLMProposer (an HF model, the int8 draft)
      "ngram"                   -> NgramProposer()
      a kind that stores no weights, by name ("int8") -> its proposer, built now from the target
      "hybrid:<draft dir>"      -> HybridProposer over that draft (and its datastore.npy, if any)
      "hybrid-nostore:<dir>"    -> the same without the datastore
      "datastore:<draft dir>"   -> n-gram and datastore lookups alone, no draft (NoDraft)
      a draft directory         -> its kind's `load` (eval/draft_dir.py); a hybrid with its fitted
                                   "serve" settings when it was promoted as one
    A self_spec directory holds only the adapter: it is rebuilt around `target`, which must be its own
    target."""
    if isinstance(path_or_kind, Proposer):
        return path_or_kind
    if isinstance(path_or_kind, torch.nn.Module):
        for kind in draft_dir.kinds():
            cls = kind.module_class()
            if cls is not None and isinstance(path_or_kind, cls):
                return kind.wrapper()(path_or_kind, target)
        return DraftLMProposer(path_or_kind, target.config.vocab_size)
    if path_or_kind == "ngram":
        return NgramProposer()
    if isinstance(path_or_kind, str) and path_or_kind in _by_name():
        return draft_dir.get_kind(path_or_kind).loader()(None, {}, target, dtype)
    how, src = draft_dir.served_form(path_or_kind) if isinstance(path_or_kind, str) else (None, None)
    if how:
        return _served(how, src, target, dtype)
    d = Path(path_or_kind)
    meta = draft_dir.read_meta(d)
    dtype = dtype or target.get_output_embeddings().weight.dtype
    if meta.get("proposer") == "hybrid":  # a promoted draft that is served with n-gram lookups
        return _hybrid(d, meta, Datastore.from_dir(d), target, dtype)
    return _model_proposer(d, meta, target, dtype)


def _served(how: str, src, target, dtype) -> HybridProposer:
    """A draft directory served with n-gram lookups: "hybrid" with its datastore when it holds one,
    "hybrid-nostore" without it, "datastore" with the datastore and no draft. The draft is the
    directory's own model, whatever its "proposer" says (so a promoted best/ is not wrapped twice)."""
    d = Path(src)
    is_draft = draft_dir.is_draft_dir(d)
    store = Datastore.from_dir(d) if is_draft and how != "hybrid-nostore" else None
    if how == "datastore":
        if store is None:
            raise DatastoreError(f"{d} holds no datastore.npy; train with train.datastore=true or give a draft "
                                 f"directory that has one")
        return HybridProposer(NoDraft(), datastore=store)
    if not is_draft:  # "ngram", a kind named alone ("int8"), or load_proposer's error for a directory that is no draft
        return HybridProposer(load_proposer(str(src), target, dtype))
    return _hybrid(d, draft_dir.read_meta(d), store, target, dtype)


def _hybrid(d: Path, meta: dict, store, target, dtype) -> HybridProposer:
    """The draft directory's own model with n-gram lookups (and `store`), with its "serve" settings:
    what evaluate fitted for serving it on its machine (the tree's node budget)."""
    dtype = dtype or target.get_output_embeddings().weight.dtype
    return serve_with(HybridProposer(_model_proposer(d, meta, target, dtype), datastore=store),
                      meta.get("serve"), d / draft_dir.FILE)


def serve_with(proposer: Proposer, settings: dict | None, where) -> Proposer:
    """`proposer` with its serving settings ({"max_nodes": N, "sampled_chain": True}) set: the one place they
    are applied, for a promoted draft's "serve", evaluate's fitted budget and sampled forms and the fit's own
    replays. `where` names their source in the error for one this decoder does not know."""
    for key, val in (settings or {}).items():
        why = serve_problem(key, val)
        if why:
            raise ValueError(f"{where}: serve.{key}={val!r} is not a hybrid setting this decoder knows ({why}); "
                             f"remove it or re-run evaluate")
        setattr(proposer, key, val)
    return proposer


def serve_problem(key: str, val) -> str | None:
    """What is wrong with serving setting `key`=`val` (serve_with's check, and bench --set's before any model
    loads), None when nothing is."""
    if key not in SERVE_KEYS:
        return f"the settings are {', '.join(SERVE_KEYS)}"
    if key == "sampled_chain":
        return None if isinstance(val, bool) else "sampled_chain is true or false"
    return None if isinstance(val, int) and not isinstance(val, bool) and val >= 1 else f"{key} is a positive integer"


def _by_name() -> set[str]:
    """The kinds that store no weights: their name alone is a draft ("int8")."""
    return {k.name for k in draft_dir.kinds() if not k.stores_weights}


def _model_proposer(d: Path, meta: dict, target, dtype) -> Proposer:
    return draft_dir.get_kind(meta["kind"]).loader()(d, meta, target, dtype)
