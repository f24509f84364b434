"""Stand-in for helper A's pipeline/lock.py (same interface; the lead keeps A's): one job per domain."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path


class LockError(RuntimeError):
    pass


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DomainLock:
    def __init__(self, domain_dir, what: str):
        self.path = Path(domain_dir) / "lock.json"
        self.what = what

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": self.what}
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    h = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    h = {}
                if h.get("host") == me["host"] and h.get("pid") and not _alive(h["pid"]):
                    self.path.unlink(missing_ok=True)
                    continue
                raise LockError(f"{self.path} is held by {h.get('what', '?')} pid {h.get('pid')} on {h.get('host')} "
                                f"since {time.ctime(h.get('since', 0))}; wait for it to finish") from None
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
            return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)
        return False
