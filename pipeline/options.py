"""Building blocks of the recipe dataclasses, shared by pipeline/config.py and the method sections in
pipeline/methods/: a field with its help string, and value checks whose errors name the key."""

from __future__ import annotations

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
    if value < 0 or (value == 0 and not zero_ok):
        raise RecipeError(f"{name}={value!r} must be {'>= 0' if zero_ok else '> 0'}")
