"""One checksum of a directory's files: what a shard manifest and a registry entry store to tell whether the files
are still the ones written.

The value carries its version: "sha256-v2:<hex>" hashes, for each file in sorted relative-path order, its path, a
NUL, its size (8 bytes, big-endian) and its bytes, so two different trees never give one byte stream. Values written
before the version had no prefix and came from two formulas: a shard manifest's (the path, then the bytes) and a
registry entry's (the path, a NUL, then the bytes). `matches` reads every version, so old runs resume and old
registries still verify.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

VERSION = "sha256-v2:"
# the unprefixed formulas, by who wrote them: what separated a file's path from its bytes
LEGACY_SHARD = b""
LEGACY_REGISTRY = b"\0"


def _digest(d: Path, sep: bytes, sized: bool) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in Path(d).rglob("*") if p.is_file()):
        h.update(f.relative_to(d).as_posix().encode() + sep)
        if sized:
            h.update(f.stat().st_size.to_bytes(8, "big"))
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def dir_checksum(d: str | Path) -> str:
    """The checksum of every file under `d` (their relative paths included), as written from now on."""
    return VERSION + _digest(Path(d), b"\0", sized=True)


def matches(d: str | Path, stored: str | None, legacy: bytes) -> bool:
    """Whether the files under `d` still have checksum `stored`: a versioned value, or an unprefixed one computed
    with the formula `legacy` names (LEGACY_SHARD or LEGACY_REGISTRY, by who stored it)."""
    if not isinstance(stored, str) or not Path(d).is_dir():
        return False
    if stored.startswith(VERSION):
        return dir_checksum(d) == stored
    return _digest(Path(d), legacy, sized=False) == stored
