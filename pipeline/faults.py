"""Named points where a crash leaves the most half-done state: between a write made aside and its rename, or
between two files that must agree. A program that drives draftsmith in-process can watch them (`watch`):
tests/faulted.py SIGKILLs a run at one to prove every stage resumes. Nothing else watches them."""
from typing import Callable

_watchers: list[Callable[[str], None]] = []


def watch(fn: Callable[[str], None]) -> None:
    """Call fn(point name) each time a kill point is reached, in this process."""
    _watchers.append(fn)


def kill_point(name: str) -> None:
    for fn in _watchers:
        fn(name)
