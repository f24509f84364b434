"""The parser every `draftsmith` command line uses: a bad argument is one line, like every other bad input."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """argparse, its errors printed as `draftsmith: error: <what> (<prog> --help lists the arguments)` and exit 2,
    without the usage block it prints above them."""

    def error(self, message: str):
        self.exit(2, f"draftsmith: error: {message} (`{self.prog} --help` lists the arguments)\n")
