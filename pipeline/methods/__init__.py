"""The draft methods, one module each, behind the `DraftMethod` interface (base.py). This registry is
the one list of them: the recipe's train.method, its per-method sections (train.<name>) and the train
loop read it. To add a method: a module with a DraftMethod subclass (and its options dataclass, if it
has keys), one line here, its kind in eval/draft_dir.py and its loader in eval/proposers/kinds.py."""

from __future__ import annotations

from .base import DraftMethod
from .draft_lm import DraftLM, DraftLMOptions
from .eagle import Eagle, EagleOptions
from .eagle3 import Eagle3, Eagle3Options
from .int8 import Int8
from .medusa import Medusa, MedusaOptions
from .self_spec import SelfSpec, SelfSpecOptions

METHODS: dict[str, DraftMethod] = {m.name: m for m in (Eagle(), Eagle3(), Medusa(), DraftLM(), SelfSpec(), Int8())}


def methods_for(target) -> list[str]:
    """The methods that apply to `target` (every method on the families the lean forward runs layer by
    layer; the others lack self_spec and int8)."""
    from eval.drafts import runs_layer_by_layer

    lean = runs_layer_by_layer(target)
    return [n for n, m in METHODS.items() if lean or not m.layer_by_layer]


def check_applies(name: str, target, what: str | None = None) -> None:
    """Refuse method `name` on a target it cannot apply to, in one line (eval.drafts.DraftError) naming the
    architecture and the methods that can; `what` names the choice in the message (train.method=NAME)."""
    from eval.drafts import check_layer_by_layer

    if get_method(name).layer_by_layer:
        check_layer_by_layer(what or f"train.method={name}", target)


def get_method(name: str) -> DraftMethod:
    if name not in METHODS:
        raise KeyError(f"unknown draft method {name!r}; one of {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "DraftMethod", "check_applies", "get_method", "methods_for", "DraftLMOptions", "Eagle3Options", "EagleOptions", "MedusaOptions",
           "SelfSpecOptions"]
