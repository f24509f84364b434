"""Stand-in for helper A's pipeline/registry.py (same interface as issue 24's common spec; the lead keeps
A's): runs/<domain>/registry/ holds immutable entries, a champion pointer and the gate's decisions."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .atomic import copytree_atomic, fsync_dir, write_json_atomic
from .lock import new_run_id


class RegistryError(ValueError):
    pass


class Registry:
    def __init__(self, domain_dir):
        self.dir = Path(domain_dir) / "registry"

    def _pointer(self) -> dict:
        p = self.dir / "champion.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def entries(self) -> list[dict]:
        root = self.dir / "entries"
        out = [json.loads(p.read_text()) for p in root.glob("*/entry.json")] if root.exists() else []
        return sorted(out, key=lambda e: (e["created"], e["id"]))

    def entry(self, id: str) -> dict:
        p = self.dir / "entries" / id / "entry.json"
        if not p.exists():
            raise RegistryError(f"no registry entry {id!r} in {self.dir}; `draftsmith drafts list` shows them")
        return json.loads(p.read_text())

    def champion(self) -> dict | None:
        ptr = self._pointer()
        if not ptr.get("id"):
            return None
        e = self.entry(ptr["id"])
        if not Path(e["draft_dir"]).is_dir():
            raise RegistryError(f"champion {e['id']}'s draft {e['draft_dir']} is missing; roll back with "
                                f"`draftsmith drafts rollback`")
        return e

    def add(self, draft_dir, *, run_dir, metrics, kind, hashes, traffic, parent=None, exports=None) -> dict:
        id = new_run_id()
        d = self.dir / "entries" / id
        d.parent.mkdir(parents=True, exist_ok=True)
        copytree_atomic(draft_dir, d.parent / f".{id}-draft")
        entry = {"id": id, "created": time.time(), "kind": kind, "run_dir": str(run_dir),
                 "draft_dir": str((d / "draft").resolve()), "metrics": metrics, "hashes": hashes,
                 "traffic": traffic, "parent": parent, "exports": exports}
        d.mkdir()
        (d.parent / f".{id}-draft").rename(d / "draft")
        write_json_atomic(d / "entry.json", entry)
        fsync_dir(d.parent)
        return entry

    def promote(self, id: str, decision: dict) -> None:
        self.entry(id)
        hist = self._pointer().get("history", [])
        write_json_atomic(self.dir / "champion.json", {"id": id, "since": time.time(),
                                                       "history": hist + [{"id": id, "since": time.time()}]})

    def rollback(self, to=None) -> dict:
        hist = self._pointer().get("history", [])
        if to is None:
            if len(hist) < 2:
                raise RegistryError("no earlier champion to roll back to")
            to = hist[-2]["id"]
        self.promote(to, {"rollback": True})
        return self.entry(to)

    def record_decision(self, decision: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "decisions.jsonl", "a") as fh:
            fh.write(json.dumps(decision, sort_keys=True) + "\n")

    def decisions(self) -> list[dict]:
        p = self.dir / "decisions.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []

    def history(self) -> list[dict]:
        return self._pointer().get("history", [])
