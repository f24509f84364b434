"""The draft methods, one module each, behind the `DraftMethod` interface (base.py). This registry is
the one list of them: the recipe's train.method, its help, its per-method sections (train.<name>), the
recipe hash's layout of them, `draftsmith compare`'s variants and the train loop read it. Each method
declares these on its class; the draft kind it saves (eval/draft_dir.py DraftKind) declares its files,
how the decoder serves it and the export formats that hold it.

To add a built-in method: a module with a DraftMethod subclass (and its options dataclass, if it has keys)
and one entry in BUILTIN below; its draft kind is one entry in eval/draft_dir.py, since eval/ serves drafts
without importing pipeline/ (docs/DESIGN.md, "To add a method"). A plugin makes one call, register_method,
with the method's `kind` set to its DraftKind, from its own module, before pipeline.config is imported when
the method has keys. An installed plugin names that module in its package's entry points, group
PLUGIN_GROUP (`[project.entry-points."draftsmith.methods"] toy = "toy_draft"`): it is imported here, after
the built-in methods, so the recipe, compare and the loaders see it without any import by the user."""

from __future__ import annotations

from eval import draft_dir

from ..formats import check_exports
from .base import DraftMethod
from .dflash import DFlash, DFlashOptions
from .draft_lm import DraftLM, DraftLMOptions
from .eagle import Eagle, EagleOptions
from .eagle3 import Eagle3, Eagle3Options
from .int8 import Int8
from .medusa import Medusa, MedusaOptions
from .self_spec import SelfSpec, SelfSpecOptions

METHODS: dict[str, DraftMethod] = {}
_sections_read = False  # set once the recipe's sections were built from METHODS (pipeline/config.py)


def register_method(method: DraftMethod) -> DraftMethod:
    """Add a draft method, and its draft kind when it declares one (`kind`, a plugin's); otherwise its name
    must be a registered kind (eval/draft_dir.py), so that what it saves can be loaded and served. A method
    with keys must come before the recipe's sections are built, since train.<name> is a field of the recipe."""
    if method.name in METHODS:
        raise ValueError(f"draft method {method.name!r} is registered already")
    if method.kind is not None and method.kind.name != method.name:
        raise ValueError(f"draft method {method.name!r} declares the kind {method.kind.name!r}; a method saves "
                         f"the kind of its own name")
    kind = method.kind if method.kind is not None else draft_dir.get_kind(method.name)
    check_exports(kind)
    if method.config is not None and _sections_read:
        raise ValueError(f"draft method {method.name!r} has recipe keys (train.{method.name}), so it must be "
                         f"registered before pipeline.config is imported")
    taken = [v for v in method.variants if any(v in m.variants for m in METHODS.values())]
    if taken:
        raise ValueError(f"draft method {method.name!r}: compare variant {taken[0]!r} is another method's")
    if method.kind is not None:
        draft_dir.register_kind(method.kind)
    METHODS[method.name] = method
    return method


BUILTIN = (Eagle(), Eagle3(), Medusa(), DraftLM(), SelfSpec(), Int8(), DFlash())
for _m in BUILTIN:
    register_method(_m)

PLUGIN_GROUP = "draftsmith.methods"  # entry points naming the modules that register a method
PLUGIN_ERRORS: list[str] = []  # one line per installed plugin that failed to load (the CLI refuses to run)


def load_plugins() -> list[str]:
    """Import every installed plugin module (entry points in PLUGIN_GROUP), each registering its kind, loader
    and method -> the names loaded. A plugin that fails is kept out and named in PLUGIN_ERRORS."""
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin must not stop the import of draftsmith itself
            PLUGIN_ERRORS.append(f"draftsmith plugin {ep.name!r} ({ep.value}) failed to load: {type(e).__name__}: "
                                 f"{e}; fix it or uninstall its package")
            continue
        loaded.append(ep.name)
    return loaded


PLUGINS = load_plugins()


def sections() -> dict[str, DraftMethod]:
    """The methods with a recipe section train.<name>, in registration order (read once by pipeline/config.py)."""
    global _sections_read
    _sections_read = True
    return {n: m for n, m in METHODS.items() if m.config is not None}


def variants() -> dict[str, dict]:
    """`draftsmith compare`'s variants: name -> train overrides, "method" included."""
    return {v: {"method": n, **over} for n, m in METHODS.items() for v, over in m.variants.items()}


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


__all__ = ["BUILTIN", "METHODS", "DraftMethod", "check_applies", "get_method", "methods_for", "register_method",
           "sections", "variants", "DFlashOptions", "DraftLMOptions", "Eagle3Options", "EagleOptions", "MedusaOptions",
           "SelfSpecOptions"]
