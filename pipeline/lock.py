"""One job per domain: `runs/<domain>/.lock`, and run ids that stay unique within one second.

The lock file is JSON: the holder's pid, host, the process start time from /proc/<pid>/stat (so a pid the
kernel has since reused is not mistaken for the holder), when it started, what it runs and its run id. It
appears complete or not at all (written aside, then hard-linked into place, which fails if it exists).
A lock held by a live process is refused with one line naming the holder. A holder on this host that is
provably dead (no such pid, or a different process under that pid) is taken over, with a note on stderr.
A holder on another host cannot be proven dead from here: refused, with how to clear it by hand.
Within one process it nests: an inner `with` on a domain this process holds is a no-op (the CLI holds it
for the whole command; a stage may take it again). The lock goes when its outer `with` block ends, on an
exception too; SIGTERM (what schedulers send) is turned into an exit that releases it. Only SIGKILL or a
power cut leaves it behind, and then the rules above apply.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .atomic import TMP_PREFIX, fsync_dir, write_json_atomic

LOCK_FILE = ".lock"
_held: dict[Path, "DomainLock"] = {}


class LockError(RuntimeError):
    """The domain is locked by another job (or the lock cannot be written); the message names the holder."""


def new_run_id() -> str:
    """"YYYYmmdd-HHMMSS-xxxx": the time, then 4 random hex digits, never repeated within this process
    (open_run also creates the directory exclusively, so two processes cannot share one)."""
    while True:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        issued = _issued.setdefault(stamp, set())
        if len(issued) >= 1 << 15:  # half the space used this second: wait for the next one
            time.sleep(0.05)
            continue
        rid = f"{stamp}-{os.urandom(2).hex()}"
        if rid not in issued:
            issued.add(rid)
            for old in [s for s in _issued if s != stamp]:
                del _issued[old]
            return rid


_issued: dict[str, set[str]] = {}


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing one
    return int(stat[stat.rindex(")") + 2:].split()[19])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _when(t) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))
    except (TypeError, ValueError):
        return "an unknown time"


def describe(h: dict) -> str:
    run = f", run {h['run_id']}" if h.get("run_id") else ""
    return f"pid {h.get('pid')} on host {h.get('host')} since {_when(h.get('started'))} ({h.get('what')}{run})"


def holder_state(h: dict) -> str:
    """'alive', 'dead' (provably) or 'unknown' (another host) for the holder recorded in lock file `h`."""
    if h.get("host") != socket.gethostname():
        return "unknown"
    pid = h.get("pid")
    if not isinstance(pid, int) or pid <= 0 or not pid_alive(pid):
        return "dead"
    start = process_start(pid)
    if h.get("start") is not None and start is not None and start != h["start"]:
        return "dead"  # the pid was reused by another process
    return "alive"


class DomainLock:
    """`with DomainLock(runs/<domain>, "draftsmith distill"):` one writing job per domain at a time."""

    def __init__(self, domain_dir: str | Path, what: str, run_id: str | None = None):
        self.domain_dir = Path(domain_dir)
        self.path = self.domain_dir / LOCK_FILE
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid()),
                     "started": time.time(), "what": what, "run_id": run_id}
        self._old_term = None
        self._nested = False
        self._made: list[Path] = []  # directories acquire created, removed again on release when left empty

    # ------------------------------------------------------------ acquiring
    def _read(self) -> dict | None:
        """The lock file's holder; None if it vanished; {} if it cannot be parsed."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            h = json.loads(text)
        except json.JSONDecodeError:
            return {}
        return h if isinstance(h, dict) else {}

    def _create(self) -> bool:
        """Create the lock file with our record in one step; False if it exists."""
        tmp = self.domain_dir / f"{TMP_PREFIX}lock-{os.getpid()}-{os.urandom(3).hex()}"
        write_json_atomic(tmp, self.info)
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        except OSError as e:  # no hard links on this filesystem: exclusive create, then write
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as fh:
                json.dump(self.info, fh)
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            os.unlink(tmp)
        fsync_dir(self.domain_dir)
        return True

    def _take_over(self, seen: dict) -> bool:
        """Replace a dead holder's lock with ours, unless someone else changed it since we read `seen`."""
        with open(self.domain_dir / f"{LOCK_FILE}.takeover", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel even if we die
            if self._read() != seen:
                return False
            write_json_atomic(self.path, self.info)
        return True

    def acquire(self) -> "DomainLock":
        outer = _held.get(self.domain_dir.resolve())
        if outer is not None and outer.info["pid"] == os.getpid():
            self._nested = True  # this process holds it already (the CLI for the whole command): nothing to do
            return self
        try:
            # the directories this lock had to create go again on release when nothing else was written there
            self._made = [d for d in (self.domain_dir, *self.domain_dir.parents) if not d.exists()][::-1]
            self.domain_dir.mkdir(parents=True, exist_ok=True)
            for _ in range(20):
                if self._create():
                    break
                h = self._read()
                if h is None:
                    continue  # released between our two looks
                if h == {}:
                    # a lock that is not JSON: only a writer without hard links, killed mid-write, leaves one
                    try:
                        young = time.time() - self.path.stat().st_mtime < 10
                    except FileNotFoundError:
                        continue
                    if young:
                        time.sleep(0.5)
                        continue
                    why = "an unreadable lock file"
                else:
                    state = holder_state(h)
                    if state == "alive":
                        raise LockError(f"{self.domain_dir} is locked by {describe(h)}; wait for it to finish, or "
                                        f"stop it (kill {h.get('pid')}) and rerun")
                    if state == "unknown":
                        raise LockError(f"{self.domain_dir} is locked by {describe(h)}, another host, so draftsmith "
                                        f"cannot tell whether it still runs; if that job is gone, delete {self.path} "
                                        f"and rerun")
                    why = f"the lock of {describe(h)}, which is no longer running"
                if self._take_over(h):
                    print(f"draftsmith: taking over {why} ({self.path})", file=sys.stderr)
                    break
            else:
                raise LockError(f"{self.path} keeps changing under us; is another draftsmith starting? rerun")
        except OSError as e:
            raise LockError(f"cannot write the lock file {self.path} ({e.strerror or e}); make "
                            f"{self.domain_dir.parent} writable or choose another runs_dir") from None
        _held[self.domain_dir.resolve()] = self
        if threading.current_thread() is threading.main_thread():  # a scheduler's SIGTERM still releases it
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_term)
        return self

    # ------------------------------------------------------------ holding and releasing
    def note_run(self, run_id: str) -> None:
        """Record the run id once the run directory is chosen (the lock is taken before)."""
        if self._nested:
            return _held[self.domain_dir.resolve()].note_run(run_id)
        if self.info.get("run_id") != run_id and self._read() == self.info:
            self.info["run_id"] = run_id
            write_json_atomic(self.path, self.info)

    def release(self) -> None:
        if self._nested:
            self._nested = False
            return
        _held.pop(self.domain_dir.resolve(), None)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        if self._read() == self.info:  # never remove a lock someone took over from us
            self.path.unlink(missing_ok=True)
            fsync_dir(self.domain_dir)
        for d in reversed(self._made):
            try:
                d.rmdir()  # only when empty: a failed command leaves no trace
            except OSError:
                break

    def __enter__(self) -> "DomainLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _exit_on_term(signum, frame):
    raise SystemExit(128 + signum)


def note_run(domain_dir: str | Path, run_id: str) -> None:
    """Tell the lock this process holds on `domain_dir` (if any) which run it is working on."""
    lock = _held.get(Path(domain_dir).resolve())
    if lock is not None:
        lock.note_run(run_id)
