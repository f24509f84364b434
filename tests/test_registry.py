"""pipeline.registry and pipeline.atomic on real files: entries, the champion pointer, rollback, decisions,
and what a failed or killed write leaves behind (the previous champion, always)."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval import draft_dir
from pipeline import atomic
from pipeline.atomic import copytree_atomic, write_json_atomic, write_text_atomic
from pipeline.cli import main
from pipeline.registry import Registry, RegistryError

ROOT = Path(__file__).resolve().parent.parent


def make_draft(root: Path, run: str, v: int) -> Path:
    """A run directory with a small draft in best/ (what evaluate promotes)."""
    d = root / run / "best"
    draft_dir.write_meta(d, {"kind": "medusa", "v": v})
    (d / "weights.bin").write_bytes(bytes([v]) * 64)
    return d


def admit(reg: Registry, root: Path, run: str, v: int, speedup: float = 1.5, rows: int = 100) -> dict:
    return reg.add(make_draft(root, run, v), run_dir=root / run, kind="distill" if v == 0 else "retrain",
                   metrics={"speedup": speedup, "tau": 2.0 + v, "alpha": 0.5, "accept_per_pos": [0.6, 0.4],
                            "checkpoints": [{"name": "big"}]},
                   hashes={"recipe": "r", "data": f"d{v}", "target": "t"}, traffic={"rows": rows, "new_rows": rows})


def served(reg: Registry) -> str | None:
    """The entry runs/<domain>/champion leads to (read through the link, as a server would), None without it."""
    link = reg.domain_dir / "champion"
    if not link.is_symlink():
        return None
    assert not Path(os.readlink(link)).is_absolute()  # the domain directory moves with its link
    return link.resolve().parent.name  # registry/entries/<id>/draft


def leftovers(reg: Registry) -> list[str]:
    return sorted(p.name for d in (reg.dir, reg.entries_dir) if d.is_dir() for p in d.iterdir()
                  if p.name.startswith(atomic.TMP_PREFIX))


@pytest.fixture
def reg(tmp_path):
    return Registry(tmp_path / "runs" / "code")


def test_add_promote_keep_rollback(reg, tmp_path):
    a = admit(reg, tmp_path, "run-a", 0, speedup=1.4, rows=100)
    assert reg.champion() is None  # admitting does not promote
    reg.promote(a["id"], {"reason": "first draft of the domain"})
    b = admit(reg, tmp_path, "run-b", 1, speedup=1.6, rows=150)
    reg.promote(b["id"], {"reason": "faster", "speedup_gain": 0.2})
    c = admit(reg, tmp_path, "run-c", 2, speedup=1.2, rows=200)
    kept = reg.record_decision({"outcome": "keep", "challenger": c["id"], "reason": "slower than the champion"})
    assert reg.record_decision({"reason": "faster", "speedup_gain": 0.2})["entry"] == "run-b"  # logged by promote

    assert [e["id"] for e in reg.entries()] == ["run-a", "run-b", "run-c"]
    assert reg.champion()["id"] == "run-b" and reg.champion()["reason"] == "promoted: faster"
    assert served(reg) == "run-b"  # runs/code/champion: the draft in service, not the newest run's
    e = reg.entry("run-b")
    assert e["metrics"] == {"speedup": 1.6, "tau": 3.0, "alpha": 0.5, "accept_per_pos": [0.6, 0.4]}  # summary only
    assert e["hashes"]["data"] == "d1" and e["traffic"]["rows"] == 150 and e["kind"] == "retrain"
    assert draft_dir.read_meta(e["draft_dir"])["v"] == 1 and Path(e["draft_dir"]).is_relative_to(reg.entries_dir)
    ds = reg.decisions()
    assert [(d["outcome"], d.get("entry") or d.get("challenger")) for d in ds] == \
        [("promote", "run-a"), ("promote", "run-b"), ("keep", "run-c")]
    assert ds[-1]["decision_id"] == kept["decision_id"]

    old = reg.rollback()
    assert (old["replaced"], old["id"]) == ("run-b", "run-a") and reg.champion()["id"] == "run-a"
    assert served(reg) == "run-a"
    with pytest.raises(RegistryError, match="first champion"):
        reg.rollback()  # nothing before a
    assert reg.rollback(to="run-c")["id"] == "run-c"  # any entry, promoted before or not
    assert reg.rollback()["id"] == "run-a"  # a plain rollback undoes --to
    with pytest.raises(RegistryError, match="already the champion"):
        reg.rollback(to="run-a")
    with pytest.raises(RegistryError, match="no entry nope"):
        reg.rollback(to="nope")
    h = reg.history()
    assert [x["id"] for x in h] == ["run-a", "run-b", "run-a", "run-c", "run-a"]
    assert [x["traffic_rows"] for x in h][:2] == [100, 150] and h[1]["speedup"] == 1.6 and h[1]["tau"] == 3.0
    assert h[2]["reason"] == "rollback from run-b"
    assert len(reg.entries()) == 3 and all(e["intact"] for e in reg.entries())  # rollback loses nothing
    assert len(reg.decisions()) == 3  # rollbacks are history, not gate outcomes
    assert leftovers(reg) == []


def test_a_rerun_promotion_does_not_undo_a_rollback(reg, tmp_path):
    """A retrain promoted C and died before marking its batch decided; the operator rolled back to A; the rerun
    repeats promote(C) with the same run's record: the champion stays A, and the decision is logged once."""
    a = admit(reg, tmp_path, "run-a", 0)
    reg.promote(a["id"], {"reason": "first draft", "run_dir": str(tmp_path / "run-a")})
    c = admit(reg, tmp_path, "run-c", 1)
    record = {"reason": "faster", "run_dir": str(tmp_path / "run-c"), "challenger": c["id"]}
    reg.promote(c["id"], record)
    assert reg.rollback()["id"] == "run-a"
    assert reg.promote(c["id"], record)["id"] == "run-a" and served(reg) == "run-a"
    assert [d.get("entry") for d in reg.decisions()] == ["run-a", "run-c"]
    assert [x["id"] for x in reg.history()] == ["run-a", "run-c", "run-a"]
    # another run promoting the same entry is a new decision: it moves the pointer
    assert reg.promote(c["id"], {**record, "run_dir": str(tmp_path / "run-d")})["id"] == "run-c"


def test_entries_are_immutable_and_admitting_twice_adds_none(reg, tmp_path):
    a = admit(reg, tmp_path, "run-a", 0)
    entry_json = (reg.entries_dir / "run-a" / "entry.json").read_bytes()
    (tmp_path / "run-a" / "best" / "weights.bin").write_bytes(b"changed after admission")
    assert (Path(a["draft_dir"]) / "weights.bin").read_bytes() == bytes([0]) * 64  # a copy, not a link

    reg.promote("run-a", {"reason": "first"})
    assert (reg.entries_dir / "run-a" / "entry.json").read_bytes() == entry_json  # promotion moves only the pointer

    make_draft(tmp_path, "run-b", 1)
    first = reg.add(tmp_path / "run-b" / "best", run_dir=tmp_path / "run-b", metrics={}, kind="retrain", hashes={},
                    traffic={})
    again = reg.add(tmp_path / "run-b" / "best", run_dir=tmp_path / "run-b", metrics={}, kind="retrain", hashes={},
                    traffic={})
    assert again["id"] == first["id"] == "run-b" and len(reg.entries()) == 2  # a resumed run re-admits nothing
    # the same run with a different draft (re-evaluated) is a new entry beside the old one
    (tmp_path / "run-b" / "best" / "weights.bin").write_bytes(b"other")
    other = reg.add(tmp_path / "run-b" / "best", run_dir=tmp_path / "run-b", metrics={}, kind="retrain", hashes={},
                    traffic={})
    assert other["id"] == "run-b.2" and len(reg.entries()) == 3


def test_exports_outside_the_draft_are_copied_with_it(reg, tmp_path):
    d = make_draft(tmp_path, "run-a", 0)
    (d / "export-hf").mkdir()
    (d / "export-hf" / "config.json").write_text("{}")  # inside best/: comes with the draft
    out = tmp_path / "exports" / "speculators"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"x")
    e = reg.add(d, run_dir=tmp_path / "run-a", metrics={}, kind="distill", hashes={}, traffic={},
                exports={"hf": {"dir": "best/export-hf"}, "speculators": str(out)})
    assert sorted(e["exports"]) == ["speculators"]
    assert (Path(e["exports"]["speculators"]) / "model.safetensors").read_bytes() == b"x"
    assert (Path(e["draft_dir"]) / "export-hf" / "config.json").exists()
    with pytest.raises(RegistryError, match="not a directory"):
        reg.add(d, run_dir=tmp_path / "run-x", metrics={}, kind="distill", hashes={}, traffic={},
                exports=[tmp_path / "missing"])


def test_a_failed_pointer_write_leaves_the_previous_champion(reg, tmp_path, monkeypatch):
    admit(reg, tmp_path, "run-a", 0)
    reg.promote("run-a", {"reason": "first"})
    admit(reg, tmp_path, "run-b", 1)
    before = reg.pointer_path.read_bytes()
    real = os.replace

    def disk_full(src, dst):
        if Path(dst).name == "champion.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        reg.promote("run-b", {"reason": "faster"})
    monkeypatch.setattr(os, "replace", real)
    assert reg.pointer_path.read_bytes() == before and reg.champion()["id"] == "run-a"
    assert leftovers(reg) == []  # the temporary file went with the error
    assert [d["entry"] for d in reg.decisions()] == ["run-a"]  # the failed promotion logged nothing


def test_a_failed_entry_copy_leaves_no_entry(reg, tmp_path, monkeypatch):
    admit(reg, tmp_path, "run-a", 0)
    reg.promote("run-a", {"reason": "first"})

    def fails(*a):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "rename", fails)
    with pytest.raises(OSError, match="Permission denied"):
        admit(reg, tmp_path, "run-b", 1)
    monkeypatch.undo()
    assert [e["id"] for e in reg.entries()] == ["run-a"] and leftovers(reg) == []
    assert reg.champion()["id"] == "run-a"


def test_what_a_killed_writer_leaves_is_ignored_then_cleaned(reg, tmp_path):
    admit(reg, tmp_path, "run-a", 0)
    reg.promote("run-a", {"reason": "first"})
    # a process killed mid-copy and mid-rewrite: a half entry and a half pointer, both still temporary
    half = reg.entries_dir / f"{atomic.TMP_PREFIX}run-b-x1"
    (half / "draft").mkdir(parents=True)
    (reg.dir / f"{atomic.TMP_PREFIX}champion.json-x2").write_text('{"id": "run-b", "hist')
    assert [e["id"] for e in reg.entries()] == ["run-a"] and reg.champion()["id"] == "run-a"
    admit(reg, tmp_path, "run-b", 1)  # the next writer removes them
    assert leftovers(reg) == [] and [e["id"] for e in reg.entries()] == ["run-a", "run-b"]


KILL_SCRIPT = """
import sys
from pathlib import Path
sys.path[:0] = [{root!r}, {root!r} + "/tests"]
from faulted import kill_at
from pipeline.registry import Registry
if len(sys.argv) > 1:
    kill_at(sys.argv[1])
reg = Registry(Path({domain!r}))
e = reg.add(Path({draft!r}), run_dir=Path({run!r}), metrics={{"speedup": 2.0}}, kind="retrain", hashes={{}},
            traffic={{"rows": 5}})
reg.promote(e["id"], {{"reason": "faster"}})
"""


@pytest.mark.parametrize("point, champion, entries", [
    ("registry.entry_copied", "run-a", ["run-a"]),  # the copy done, not yet renamed: no entry
    ("registry.entry_published", "run-a", ["run-a", "run-b"]),  # an entry, not promoted
    ("registry.pointer_tmp", "run-a", ["run-a", "run-b"]),  # the new pointer written aside only
    ("registry.pointer_moved", "run-b", ["run-a", "run-b"]),  # promoted; its log line comes from history
    ("registry.decisions_tmp", "run-b", ["run-a", "run-b"]),  # promoted, the link moved, the log line not written
])
def test_sigkill_at_each_registry_point(reg, tmp_path, point, champion, entries):
    admit(reg, tmp_path, "run-a", 0)
    reg.promote("run-a", {"reason": "first"})
    draft = make_draft(tmp_path, "run-b", 1)
    script = KILL_SCRIPT.format(root=str(ROOT), domain=str(reg.domain_dir), draft=str(draft),
                                run=str(tmp_path / "run-b"))
    r = subprocess.run([sys.executable, "-c", script, point], capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr
    assert reg.champion()["id"] == champion and [e["id"] for e in reg.entries()] == entries
    # the link moves after the pointer: killed between the two, it is one move behind
    assert served(reg) == ("run-b" if point == "registry.decisions_tmp" else "run-a")
    assert [d["entry"] for d in reg.decisions()] == ["run-a"] + (["run-b"] if champion == "run-b" else [])
    # the rerun finishes the job without a second entry or a second promotion
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert reg.champion()["id"] == "run-b" and [e["id"] for e in reg.entries()] == ["run-a", "run-b"]
    assert served(reg) == "run-b" and not list(reg.domain_dir.glob(".tmp-*"))
    assert [h["id"] for h in reg.history()] == ["run-a", "run-b"] and leftovers(reg) == []
    assert [d["entry"] for d in reg.decisions()] == ["run-a", "run-b"]


def _drafts(tmp_path, *args):
    return main(["drafts", *args, "--domain", "code", "--runs-dir", str(tmp_path / "runs")])


def test_cli_lists_shows_and_rolls_back(reg, tmp_path, capsys):
    admit(reg, tmp_path, "run-a", 0, speedup=1.4)
    reg.promote("run-a", {"reason": "first"})
    admit(reg, tmp_path, "run-b", 1, speedup=1.75, rows=321)
    reg.promote("run-b", {"reason": "faster"})
    capsys.readouterr()
    (reg.domain_dir / "champion").unlink()  # a registry written before the link existed
    assert _drafts(tmp_path, "list") == 0
    assert served(reg) == "run-b"  # the command puts the link back where the pointer says
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "CREATED", "KIND", "SPEEDUP", "TAU", "ALPHA", "TRAFFIC"]
    assert out[2].startswith("* run-b") and "1.75x" in out[2] and out[2].endswith("321")
    assert out[1].startswith("  run-a") and "distill" in out[1]
    assert _drafts(tmp_path, "show", "run-a") == 0
    out = capsys.readouterr().out
    assert json.loads(out[:out.index("\ndraft: ") + 1])["id"] == "run-a" and "weights.bin  64 bytes" in out
    assert _drafts(tmp_path, "rollback") == 0
    assert capsys.readouterr().out.startswith("draftsmith: champion run-b -> run-a")
    assert served(reg) == "run-a"
    assert _drafts(tmp_path, "rollback", "--to", "run-b") == 0
    assert reg.champion()["id"] == "run-b" and served(reg) == "run-b"


def test_cli_pointer_at_a_deleted_draft_is_one_line(reg, tmp_path, capsys):
    for i, run in enumerate(("run-a", "run-b")):
        admit(reg, tmp_path, run, i)
        reg.promote(run, {"reason": "gate"})
    import shutil

    shutil.rmtree(reg.entries_dir / "run-b" / "draft")
    capsys.readouterr()
    assert _drafts(tmp_path, "show") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "points at entry run-b whose draft is missing" in err
    assert "draftsmith drafts rollback --to ID" in err and "--to run-a" in err
    assert _drafts(tmp_path, "list") == 2  # the table, then the same line
    out, err = capsys.readouterr()
    assert "(draft missing)" in out and err.count("\n") == 1
    with pytest.raises(RegistryError, match="whose draft is missing"):
        reg.champion()
    shutil.rmtree(reg.entries_dir / "run-b")  # the whole entry gone
    assert _drafts(tmp_path, "show") == 2 and "whose draft is missing" in capsys.readouterr().err
    assert _drafts(tmp_path, "rollback", "--to", "run-a") == 0  # what the message says to do
    assert reg.champion()["id"] == "run-a"


def test_cli_errors_are_one_line(reg, tmp_path, capsys):
    assert _drafts(tmp_path, "list") == 2
    assert capsys.readouterr().err.strip().startswith("draftsmith: error: no draft registry under")
    admit(reg, tmp_path, "run-a", 0)
    assert _drafts(tmp_path, "show") == 2 and "no champion" in capsys.readouterr().err
    assert _drafts(tmp_path, "rollback") == 2 and "nothing to roll back" in capsys.readouterr().err
    for bad in ("nope", "../x"):
        assert _drafts(tmp_path, "show", bad) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "drafts list --domain code" in err
    reg.pointer_path.write_text("{not json")
    assert _drafts(tmp_path, "show") == 2 and "cannot be read" in capsys.readouterr().err
    assert _drafts(tmp_path, "rollback", "--to", "run-a") == 2  # an unreadable pointer is not guessed at


@pytest.mark.parametrize("damage", [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"created": 1}'])
def test_a_damaged_entry_record_is_one_line_not_a_missing_entry(reg, tmp_path, capsys, damage):
    """An entry.json that cannot be read is named with the fix, by list, show and rollback alike: skipping it
    would drop the entry from the list, the history and rollback's choices."""
    for i, run in enumerate(("run-a", "run-b")):
        admit(reg, tmp_path, run, i)
        reg.promote(run, {"reason": "gate"})
    (reg.entries_dir / "run-a" / "entry.json").write_bytes(damage)
    capsys.readouterr()
    for args in (["list"], ["show", "run-a"], ["rollback"]):
        assert _drafts(tmp_path, *args) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(reg.entries_dir / "run-a" / "entry.json") in err, (args, err)
    assert reg.pointer_path.exists() and json.loads(reg.pointer_path.read_text())["id"] == "run-b"  # nothing moved


# ------------------------------------------------------------------ pipeline.atomic
def test_failed_atomic_writes_keep_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "m.json"
    write_json_atomic(p, {"v": 1})
    real = os.fsync

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_json_atomic(p, {"v": 2})
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(tmp_path / "new.txt", "x")
    monkeypatch.setattr(os, "fsync", real)
    assert json.loads(p.read_text()) == {"v": 1} and sorted(x.name for x in tmp_path.iterdir()) == ["m.json"]
    from pipeline.shards import write_json_atomic as from_shards

    assert from_shards is write_json_atomic


def test_copytree_atomic_copies_and_refuses_to_replace(tmp_path):
    src = make_draft(tmp_path, "run", 3)
    (tmp_path / "link").symlink_to(src / "weights.bin")
    (src / "sub").mkdir()
    os.symlink(tmp_path / "link", src / "sub" / "w")
    dst = copytree_atomic(src, tmp_path / "copy")
    assert (dst / "weights.bin").read_bytes() == bytes([3]) * 64
    assert not (dst / "sub" / "w").is_symlink() and (dst / "sub" / "w").read_bytes() == bytes([3]) * 64
    with pytest.raises(FileExistsError, match="refusing to replace"):
        copytree_atomic(src, dst)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(atomic.TMP_PREFIX)]


def test_monitor_refuses_a_champion_without_a_recorded_tau(reg, tmp_path, capsys):
    """Drift is τ against the champion's recorded τ: without one, monitor says so in one line before any work,
    rather than writing a 'no drift' verdict it never measured."""
    from pipeline.cli import main

    e = reg.add(make_draft(tmp_path, "run-a", 0), run_dir=tmp_path / "run-a", kind="distill", metrics={"speedup": 1.5},
                hashes={}, traffic={"rows": 1})
    reg.promote(e["id"], {"reason": "first"})
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    capsys.readouterr()
    assert main(["monitor", "--domain", "code", f"runs_dir={tmp_path / 'runs'}", "--traffic", str(traffic)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no recorded tau" in err and "rollback --to ID" in err, err
    assert not (reg.domain_dir / "monitor").exists()
