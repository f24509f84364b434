"""The draft methods, one module each, behind the `DraftMethod` interface (base.py). This registry is
the one list of them: the recipe's train.method, its per-method sections (train.<name>) and the train
loop read it. To add a method: a module with a DraftMethod subclass (and its options dataclass, if it
has keys), one line here, and its kind in eval/draft_dir.py."""

from __future__ import annotations

from .base import DraftMethod
from .draft_lm import DraftLM, DraftLMOptions
from .eagle import Eagle, EagleOptions
from .eagle3 import Eagle3, Eagle3Options
from .int8 import Int8
from .medusa import Medusa, MedusaOptions
from .self_spec import SelfSpec, SelfSpecOptions

METHODS: dict[str, DraftMethod] = {m.name: m for m in (Eagle(), Eagle3(), Medusa(), DraftLM(), SelfSpec(), Int8())}


def get_method(name: str) -> DraftMethod:
    if name not in METHODS:
        raise KeyError(f"unknown draft method {name!r}; one of {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "DraftMethod", "get_method", "DraftLMOptions", "Eagle3Options", "EagleOptions", "MedusaOptions",
           "SelfSpecOptions"]
