"""The parser every command line of the project uses: a bad argument is one line, like every other bad input; and
the check of an output path given on one, made before the work whose result it would hold."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse, its errors printed as `<lead>: error: <what> (<prog> --help lists the arguments)` and exit 2,
    without the usage block it prints above them (`lead`: draftsmith, or a measuring tool's own name)."""

    def __init__(self, *args, lead: str = "draftsmith", **kwargs):
        super().__init__(*args, **kwargs)
        self.lead = lead

    def error(self, message: str):
        self.exit(2, f"{self.lead}: error: {message} (`{self.prog} --help` lists the arguments)\n")


def out_file_problem(path: str | Path, flag: str) -> str | None:
    """Why a file cannot be written at `path` (given as `flag`), or None: a directory there, or a file, not a
    directory, where its parent would be."""
    p = Path(path)
    if p.is_dir():
        return f"cannot write {flag} {path}: it is a directory; give a file's path"
    up = p.parent
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir():
        return f"cannot write {flag} {path}: {up} is a file, not a directory; give a path under a directory"
    if not os.access(up, os.W_OK):
        return f"cannot write {flag} {path}: this user may not write in {up}; give another path"
    return None
