"""How the decoder serves each draft kind (eval/draft_dir.py): the registry of kind -> loader, which
load_proposer reads, with the built-in kinds' loaders registered at the end. A kind declared in
draft_dir is served once its loader is registered here, or from a plugin's own module
(register_loader), with no other change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import draft_dir
from ..drafts import SelfSpecDraft, int8_draft
from ..heads import Eagle3Head, EagleHead, MedusaHeads
from .draft_lm import DraftLMProposer
from .eagle import EagleProposer
from .eagle3 import Eagle3Proposer
from .medusa import MedusaProposer


@dataclass(frozen=True)
class KindLoader:
    """How a draft kind becomes the Proposer that serves it."""

    kind: str
    load: Callable  # (directory, meta, target, dtype) -> Proposer; directory None for a kind that stores no weights
    module: type | None = None  # an in-memory draft of this class (a trained head) is served by `wrap`
    wrap: Callable | None = None  # (module, target) -> Proposer


_LOADERS: dict[str, KindLoader] = {}


def register_loader(loader: KindLoader) -> KindLoader:
    """Serve a declared draft kind (draft_dir.register_kind first), once."""
    draft_dir.get_kind(loader.kind)
    if loader.kind in _LOADERS:
        raise ValueError(f"draft kind {loader.kind!r} has a loader already")
    if (loader.module is None) != (loader.wrap is None):
        raise ValueError(f"draft kind {loader.kind!r}: give both `module` and `wrap`, or neither")
    _LOADERS[loader.kind] = loader
    return loader


def loader_for(kind: str) -> KindLoader:
    if kind not in _LOADERS:
        raise draft_dir.DraftDirError(f"draft kind {kind!r} has no loader registered (eval/proposers/kinds.py)")
    return _LOADERS[kind]


def loaders() -> tuple[KindLoader, ...]:
    return tuple(_LOADERS.values())


def _device(target):
    return target.get_output_embeddings().weight.device


def _eagle(d, meta, target, dtype):
    return EagleProposer(EagleHead.load(d, dtype=dtype, device=_device(target)), target)


def _eagle3(d, meta, target, dtype):
    return Eagle3Proposer(Eagle3Head.load(d, dtype=dtype, device=_device(target)), target)


def _medusa(d, meta, target, dtype):
    return MedusaProposer(MedusaHeads.load(d, dtype=dtype, device=_device(target)), target)


def _draft_lm(d, meta, target, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).to(_device(target))
    return DraftLMProposer(model, target.config.vocab_size)


def _self_spec_draft(draft: SelfSpecDraft, target):  # its truncated vocabulary's rows map to target ids by d2t
    return DraftLMProposer(draft, target.config.vocab_size, d2t=draft.d2t, fuse=False)  # its layers are the target's


def _self_spec(d, meta, target, dtype):  # the adapter alone is stored: rebuilt around `target`, its own target
    return _self_spec_draft(SelfSpecDraft.load(d, target, dtype=dtype, device=_device(target)), target)


def _int8(d, meta, target, dtype):  # nothing stored: the int8 copy is built from the target now
    return DraftLMProposer(int8_draft(target), target.config.vocab_size)


for _loader in (KindLoader("eagle", _eagle, module=EagleHead, wrap=EagleProposer),
                KindLoader("eagle3", _eagle3, module=Eagle3Head, wrap=Eagle3Proposer),
                KindLoader("medusa", _medusa), KindLoader("draft_lm", _draft_lm),
                KindLoader("self_spec", _self_spec, module=SelfSpecDraft, wrap=_self_spec_draft),
                KindLoader("int8", _int8)):
    register_loader(_loader)
