"""pipeline.lock: one job per domain, refused with one line naming the holder, taken over only from a holder
provably dead; run ids unique within one second. Real processes, real files."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cli import main, open_run
from pipeline.config import load_recipe
from pipeline.lock import LOCK_FILE, DomainLock, LockError, new_run_id, process_start

ROOT = Path(__file__).resolve().parent.parent


def write_holder(domain: Path, **kw) -> Path:
    domain.mkdir(parents=True, exist_ok=True)
    h = {"pid": 1, "host": socket.gethostname(), "start": None, "started": time.time() - 60,
         "what": "draftsmith distill", "run_id": "20260101-000000-abcd"} | kw
    (domain / LOCK_FILE).write_text(json.dumps(h))
    return domain / LOCK_FILE


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "30"])
    yield p
    p.kill()
    p.wait()


def test_a_live_holder_is_refused_by_name(tmp_path, sleeper, capsys):
    domain = tmp_path / "code"
    lock = write_holder(domain, pid=sleeper.pid, start=process_start(sleeper.pid))
    before = lock.read_text()
    with pytest.raises(LockError) as e:
        DomainLock(domain, "draftsmith retrain").acquire()
    msg = str(e.value)
    assert f"pid {sleeper.pid} on host {socket.gethostname()} since " in msg and "kill " in msg
    assert "\n" not in msg and "run 20260101-000000-abcd" in msg
    # through the CLI: one line, exit 2, before any model loads; the holder's lock untouched
    assert main(["distill", "--domain", "code", f"runs_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("draftsmith: error: ") and f"pid {sleeper.pid}" in err
    assert lock.read_text() == before and not (domain / "latest").exists()


def test_a_lock_held_by_another_python_process(tmp_path):
    domain = tmp_path / "code"
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
         f"from pipeline.lock import DomainLock\nwith DomainLock({str(domain)!r}, 'draftsmith distill'):\n"
         f"    print('held', flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LockError, match=f"pid {child.pid} on host"):
            DomainLock(domain, "draftsmith distill").acquire()
        child.send_signal(signal.SIGTERM)  # what a scheduler sends: the holder exits and releases
        child.wait(timeout=20)
        assert child.returncode == 128 + signal.SIGTERM and not (domain / LOCK_FILE).exists()
    finally:
        child.kill()
        child.wait()
    with DomainLock(domain, "draftsmith distill"):
        assert json.loads((domain / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_dead_holder_is_taken_over(tmp_path, capsys):
    p = subprocess.Popen(["true"])
    p.wait()
    domain = tmp_path / "code"
    write_holder(domain, pid=p.pid)
    with DomainLock(domain, "draftsmith retrain", run_id="r1") as lk:
        assert json.loads((domain / LOCK_FILE).read_text()) == lk.info
    assert "taking over the lock of pid" in capsys.readouterr().err
    assert not (domain / LOCK_FILE).exists()


def test_a_reused_pid_is_not_the_holder(tmp_path, sleeper, capsys):
    domain = tmp_path / "code"
    write_holder(domain, pid=sleeper.pid, start=process_start(sleeper.pid) - 1)  # same pid, another process
    with DomainLock(domain, "draftsmith retrain"):
        pass
    assert "no longer running" in capsys.readouterr().err


def test_a_holder_on_another_host_is_not_guessed_dead(tmp_path):
    domain = tmp_path / "code"
    lock = write_holder(domain, pid=12345, host="elsewhere-node-7")
    with pytest.raises(LockError, match=f"elsewhere-node-7.*delete {re.escape(str(lock))}"):
        DomainLock(domain, "draftsmith retrain").acquire()
    assert lock.exists()


def test_released_on_exceptions_and_records_the_run(tmp_path):
    domain = tmp_path / "code"
    with pytest.raises(KeyError):
        with DomainLock(domain, "draftsmith distill"):
            raise KeyError("boom")
    assert not (domain / LOCK_FILE).exists()
    recipe = load_recipe(domain="code", overrides=[f"runs_dir={tmp_path}"])
    with DomainLock(domain, "draftsmith distill"):
        run = open_run(recipe, for_stage=False, new=True)
        assert json.loads((domain / LOCK_FILE).read_text())["run_id"] == run.name
        with DomainLock(domain, "draftsmith retrain"):  # nested in one process (the CLI's, then a stage's)
            assert json.loads((domain / LOCK_FILE).read_text())["what"] == "draftsmith distill"
        assert (domain / LOCK_FILE).exists()  # only the outer one releases
    assert not (domain / LOCK_FILE).exists()


def test_run_ids_are_unique_within_a_second(tmp_path):
    ids = [new_run_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", i) for i in ids)
    recipe = load_recipe(domain="code", overrides=[f"runs_dir={tmp_path}"])
    runs = {open_run(recipe, for_stage=False, new=True) for _ in range(5)}  # five distills started at once
    assert len(runs) == 5 and all(r.is_dir() for r in runs)


def test_an_unwritable_runs_dir_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["distill", "--domain", "code", f"runs_dir={blocker / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the lock file" in err and "runs_dir" in err


def test_a_read_only_runs_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """A runs dir this user may not write (chmod 0o500; root writes through it, so there the refusal the OS would
    give is given by the open itself)."""
    import errno

    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o500)
    if os.geteuid() == 0:
        real = os.open

        def denied(path, *a, **kw):
            if str(path).startswith(str(runs)):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real(path, *a, **kw)

        monkeypatch.setattr(os, "open", denied)
    try:
        assert main(["distill", "--domain", "code", f"runs_dir={runs}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot write the lock file" in err and "Permission denied" in err
        assert not [p for p in runs.rglob("*") if p.is_file()]  # no lock, nothing else
    finally:
        runs.chmod(0o700)


def test_an_unreadable_old_lock_is_taken_over(tmp_path, capsys):
    domain = tmp_path / "code"
    domain.mkdir()
    (domain / LOCK_FILE).write_text('{"pid": 12')  # a writer killed mid-write, a minute ago
    os.utime(domain / LOCK_FILE, (time.time() - 60, time.time() - 60))
    with DomainLock(domain, "draftsmith distill"):
        pass
    assert "taking over an unreadable lock file" in capsys.readouterr().err
    write_holder(domain, pid=0)  # nonsense pids are nobody
    with DomainLock(domain, "draftsmith distill"):
        pass
