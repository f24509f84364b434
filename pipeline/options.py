"""Building blocks of the recipe dataclasses, shared by pipeline/config.py and the method sections in
pipeline/methods/: a field with its help string, and value checks whose errors name the key."""

from __future__ import annotations

import math
from dataclasses import field


class RecipeError(ValueError):
    """A recipe or override is wrong; the message names the key and the fix."""


def option(default, help: str, **kw):
    """A dataclass field with its `draftsmith recipe-help` line (lists and dicts get a fresh copy)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise RecipeError(f"{name}={value!r} is not one of {sorted(allowed)}")


def positive(name: str, value, zero_ok: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):  # NaN fails no comparison
        raise RecipeError(f"{name}={value!r} must be {'>= 0' if zero_ok else '> 0'} and finite")


def sampling(prefix: str, temperature: float, top_k: int = 0, top_p: float = 1.0,
             temperature_key: str = "temperature") -> None:
    """The sampling settings of a recipe section, checked as the decoder checks them (eval.proposers.check_sampling)."""
    from eval.proposers import check_sampling

    names = (prefix + temperature_key, f"{prefix}top_k", f"{prefix}top_p")
    try:
        check_sampling(temperature, top_k, top_p, names=names)
    except ValueError as e:
        raise RecipeError(str(e)) from None
