"""Writes that a crash cannot leave half-done: write aside in the same directory, fsync, rename, fsync the directory.

A reader sees the old file or the new one, never a mixture. A failed write (disk full, permission denied)
raises its OSError as it is, after removing its temporary file, and leaves the old file untouched. A process
killed mid-write leaves at most a hidden `.tmp-*` sibling, which readers never open.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

TMP_PREFIX = ".tmp-"


def fsync_dir(d: str | Path) -> None:
    """Make a rename or a new file in directory `d` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename itself is still atomic
        pass
    finally:
        os.close(fd)


def _unlink_quietly(p: str | Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def write_bytes_atomic(path: str | Path, data: bytes, *, before_replace=None) -> None:
    """`path` holds `data` or what it held before, whatever happens; `before_replace()` runs with the
    temporary file complete (the fault-injection tests kill the process there)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str, *, before_replace=None) -> None:
    write_bytes_atomic(path, text.encode(), before_replace=before_replace)


def write_json_atomic(path: str | Path, obj, *, before_replace=None) -> None:
    write_bytes_atomic(path, json.dumps(obj, indent=2, sort_keys=True).encode(), before_replace=before_replace)


def fsync_tree(d: str | Path) -> None:
    """fsync every file and directory under `d` (after a copy, before the rename that publishes it)."""
    d = Path(d)
    for root, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def make_tmp_dir(parent: str | Path, name: str) -> Path:
    """A hidden temporary directory beside `parent/name`, for building it before one rename publishes it."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=parent, prefix=f"{TMP_PREFIX}{name}-"))


def publish_dir(tmp: str | Path, dst: str | Path) -> None:
    """Rename the finished `tmp` to `dst` (which must not exist) and make the rename durable."""
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(f"{dst} already exists; refusing to replace it")
    os.rename(tmp, dst)
    fsync_dir(dst.parent)


def copytree_atomic(src: str | Path, dst: str | Path) -> Path:
    """Copy directory `src` to `dst` (which must not exist): into a temporary sibling, fsync, rename.
    Symlinks are copied as the files they point at, so `dst` does not change when `src` does."""
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(f"{dst} already exists; refusing to replace it")
    tmp = make_tmp_dir(dst.parent, dst.name)
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        fsync_tree(tmp)
        publish_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
