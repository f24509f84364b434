"""The draft registry, runs/<domain>/registry/: every admitted draft as an immutable entry, and a champion pointer.

    registry/entries/<id>/draft/        a copy of the draft directory (never changed after it appears)
    registry/entries/<id>/exports/<f>/  export directories that lived outside the draft (if any)
    registry/entries/<id>/entry.json    id, created, kind, run_dir, metrics summary, hashes, traffic, parent
    registry/champion.json              the pointer: id, since, reason, and the history of champions
    registry/decisions.jsonl            every gate outcome (promote or keep) with its figures
    champion -> registry/entries/<id>/draft   beside registry/: the draft in service, for serving and exports

Every change is atomic: an entry is built in a hidden `.tmp-*` directory and renamed into place; the pointer
and the decision log are rewritten whole through a temporary file, fsynced, renamed. The pointer carries
the champion history in the same file, so the two cannot disagree after a crash. The `champion` link follows
the pointer (a symlink renamed into place after it): a crash between the two leaves the link one move behind
until the next writer (or `draftsmith drafts`) re-points it. A crash at any moment
leaves the previous champion serving; leftover `.tmp-*` files are ignored and removed by the next writer.
Writers take a short flock on registry/.write.lock, so `drafts rollback` during a retrain is safe.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from eval import draft_dir as dd

from .atomic import TMP_PREFIX, fsync_tree, make_tmp_dir, publish_dir, write_json_atomic, write_text_atomic
from .checksum import LEGACY_REGISTRY, dir_checksum, matches
from .faults import kill_point
from .lock import new_run_id

REGISTRY = "registry"
CHAMPION_LINK = "champion"  # runs/<domain>/champion: the champion's draft directory
ENTRY_FILE = "entry.json"
SUMMARY_KEYS = ("speedup", "tau", "alpha", "accept_per_pos", "mean_acceptance_length", "draft_acceptance_rate",
                "greedy_exact", "lossless", "k", "target", "draft_method")


class RegistryError(ValueError):
    """The registry is missing, names an unknown entry, or its pointer names a broken one."""


def metrics_summary(metrics: dict) -> dict:
    """What an entry keeps of a run's metrics.json: the SUMMARY_KEYS and any other plain value."""
    return {k: v for k, v in (metrics or {}).items()
            if k in SUMMARY_KEYS or v is None or isinstance(v, (bool, int, float, str))}


class Registry:
    def __init__(self, domain_dir: str | Path):
        self.domain_dir = Path(domain_dir)
        self.dir = self.domain_dir / REGISTRY
        self.entries_dir = self.dir / "entries"
        self.pointer_path = self.dir / "champion.json"
        self.decisions_path = self.dir / "decisions.jsonl"
        self.link_path = self.domain_dir / CHAMPION_LINK

    def exists(self) -> bool:
        return self.dir.is_dir()

    def command(self, rest: str) -> str:
        """A `draftsmith drafts ...` command line for this registry, for messages."""
        where = f" --runs-dir {self.domain_dir.parent}" if self.domain_dir.parent != Path("runs") else ""
        return f"`draftsmith drafts {rest} --domain {self.domain_dir.name}{where}`"

    # ------------------------------------------------------------------ reading
    def _read_entry(self, d: Path) -> dict | None:
        """Entry d's record, None where it has none; a record that cannot be read is refused, never skipped:
        the entry would vanish from the list, the history and rollback's choices."""
        path = d / ENTRY_FILE
        try:
            e = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            e = err
        if not isinstance(e, dict) or not isinstance(e.get("id"), str):
            why = f"cannot be read ({e})" if isinstance(e, Exception) else "is not an entry record"
            raise RegistryError(f"{path} {why}; restore it from a backup, or move {d} out of {self.entries_dir} "
                                f"to drop that entry")
        # paths are where the registry is now (it may have been moved as a whole)
        e["draft_dir"] = str((d / "draft").resolve())
        e["exports"] = {name: str((d / "exports" / name).resolve()) for name in e.get("exports") or {}}
        e["intact"] = dd.is_draft_dir(d / "draft")
        return e

    def entries(self) -> list[dict]:
        """Every complete entry, oldest first (half-written `.tmp-*` ones are not entries)."""
        if not self.entries_dir.is_dir():
            return []
        found = [self._read_entry(d) for d in self.entries_dir.iterdir()
                 if d.is_dir() and not d.name.startswith(".")]
        return sorted((e for e in found if e is not None), key=lambda e: (e.get("created", 0), e["id"]))

    def entry(self, id: str) -> dict:
        if not id or "/" in id or id.startswith("."):
            raise RegistryError(f"{id!r} is not an entry id; {self.command('list')} lists them")
        e = self._read_entry(self.entries_dir / id)
        if e is None:
            if not self.exists():
                raise RegistryError(self._none_yet())
            raise RegistryError(f"no entry {id} in {self.dir}; {self.command('list')} lists them")
        return e

    def _none_yet(self) -> str:
        return (f"no draft registry under {self.domain_dir}; `draftsmith distill` or `draftsmith retrain` admits "
                f"drafts to it")

    def _pointer(self) -> dict | None:
        try:
            p = json.loads(self.pointer_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as e:
            raise RegistryError(f"{self.pointer_path} cannot be read ({e}); {self.command('rollback --to ID')} "
                                f"rewrites it") from None
        if not isinstance(p, dict) or not isinstance(p.get("id"), str):
            raise RegistryError(f"{self.pointer_path} does not name an entry; {self.command('rollback --to ID')} "
                                f"rewrites it")
        return p

    def _latest_intact(self, besides: str | None = None) -> str | None:
        ids = [h["id"] for h in reversed(self.history())] + [e["id"] for e in reversed(self.entries())]
        for i in ids:
            if i != besides and dd.is_draft_dir(self.entries_dir / i / "draft"):
                return i
        return None

    def _broken(self, id: str, what: str) -> RegistryError:
        ok = self._latest_intact(besides=id)
        hint = f" (e.g. --to {ok})" if ok else ""
        return RegistryError(f"the registry {self.dir} points at entry {id} whose {what}; "
                             f"{self.command('rollback --to ID')} to an intact entry{hint}")

    def champion(self) -> dict | None:
        """The champion's entry (with the pointer's since and reason), None before the first promotion."""
        p = self._pointer()
        if p is None:
            return None
        e = self._read_entry(self.entries_dir / p["id"])
        if e is None:
            d = self.entries_dir / p["id"]
            raise self._broken(p["id"], f"entry.json is missing ({d / ENTRY_FILE})" if (d / "draft").is_dir()
                               else f"draft is missing ({d / 'draft'})")
        if not e["intact"]:
            raise self._broken(p["id"], f"draft is missing ({e['draft_dir']})")
        return e | {"since": p.get("since"), "reason": p.get("reason")}

    def verify(self, id: str) -> bool:
        """Whether entry `id`'s draft files are still the ones admitted (its draft_sha256, of any version)."""
        e = self.entry(id)
        return matches(e["draft_dir"], e.get("draft_sha256"), LEGACY_REGISTRY)

    def check_target(self, target: str) -> None:
        """A draft for `target` is compared only with a champion of `target`: where the champion serves another,
        one line, so a distill is refused before its compute rather than at admission (retrain.check_target)."""
        champ = self.champion() if self.exists() else None
        theirs = (champ or {}).get("metrics", {}).get("target")
        if champ is not None and theirs != target:
            raise RegistryError(f"the champion {champ['id']} serves target {theirs!r} but this recipe's target is "
                                f"{target!r}; a draft for another target is never compared with it: use a new "
                                f"domain for the new target (--domain/domain=NAME), or roll back to a champion of "
                                f"{target!r} ({self.command('rollback --to ID')})")

    def history(self) -> list[dict]:
        """Champion changes, oldest first: id, since, reason, replaced, rollback_to, speedup, tau, traffic_rows."""
        p = self._pointer()
        return list(p.get("history", [])) if p else []

    def decisions(self) -> list[dict]:
        """Every gate outcome, oldest first (a promotion whose log line a crash cut off is taken from history)."""
        out = self._read_decisions()
        logged = {d.get("decision_id") for d in out}
        out += [h["decision"] for h in self.history() if h.get("decision")
                and h["decision"].get("decision_id") not in logged]
        return sorted(out, key=lambda d: d.get("decided_at", 0))

    def _read_decisions(self) -> list[dict]:
        try:
            lines = self.decisions_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise RegistryError(f"{self.decisions_path} line {n} is not JSON; fix or remove that line") from None
        return out

    # ------------------------------------------------------------------ writing
    @contextmanager
    def _writing(self):
        """One writer at a time (flock: released by the kernel if we die); stale temporaries removed."""
        self.entries_dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".write.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            for d in (self.dir, self.entries_dir):
                for t in d.glob(f"{TMP_PREFIX}*"):
                    shutil.rmtree(t) if t.is_dir() and not t.is_symlink() else t.unlink(missing_ok=True)
            self._point_link()  # a writer killed between the pointer and the link left it one move behind
            yield

    def _point_link(self) -> None:
        """runs/<domain>/champion -> the pointer's entry's draft (relative, renamed into place); none without a
        champion. A directory of that name that is not our link is left alone."""
        for t in self.domain_dir.glob(f"{TMP_PREFIX}{CHAMPION_LINK}-*"):  # a link left by a killed writer
            t.unlink(missing_ok=True)
        try:
            p = self._pointer()
        except RegistryError:  # unreadable: the link stays as it is until a rollback rewrites the pointer
            return
        link = self.link_path
        if link.exists() and not link.is_symlink():
            return
        if p is None:  # no champion yet (or any more): no link
            if link.is_symlink():
                link.unlink()
            return
        want = f"{REGISTRY}/entries/{p['id']}/draft"
        if link.is_symlink() and os.readlink(link) == want:
            return
        tmp = self.domain_dir / f"{TMP_PREFIX}{CHAMPION_LINK}-{os.getpid()}"
        tmp.symlink_to(want)
        os.replace(tmp, link)

    def add(self, draft_dir: str | Path, *, run_dir: str | Path | None, metrics: dict, kind: str, hashes: dict,
            traffic: dict, parent: str | None = None, exports: dict | list | None = None) -> dict:
        """Admit a draft: an immutable copy under entries/<id>/ (id: the run's id). The pointer does not move.
        Admitting the same draft of the same run again returns the existing entry (a resumed run adds none)."""
        src = Path(draft_dir)
        dd.read_meta(src)  # a draft directory, or a one-line error naming what is wrong
        if kind not in ("distill", "retrain"):
            raise RegistryError(f"entry kind {kind!r} is not 'distill' or 'retrain'")
        run = str(Path(run_dir).resolve()) if run_dir is not None else None
        extra = _export_dirs(exports, src, run_dir)
        digest = dir_checksum(src)
        with self._writing():
            for e in self.entries():
                if e.get("run_dir") == run and matches(src, e.get("draft_sha256"), LEGACY_REGISTRY):
                    return e
            base = Path(run_dir).name if run_dir is not None else new_run_id()
            id, n = base, 2
            while (self.entries_dir / id).exists():
                id, n = f"{base}.{n}", n + 1
            tmp = make_tmp_dir(self.entries_dir, id)
            try:
                shutil.copytree(src, tmp / "draft")
                for name, d in extra.items():
                    shutil.copytree(d, tmp / "exports" / name)
                entry = {"id": id, "created": time.time(), "kind": kind, "run_dir": run,
                         "metrics": metrics_summary(metrics), "hashes": dict(hashes or {}),
                         "traffic": dict(traffic or {}), "parent": parent, "exports": sorted(extra),
                         "draft_sha256": digest, "source_draft": str(src.resolve())}
                (tmp / ENTRY_FILE).write_text(json.dumps(entry, indent=2, sort_keys=True))
                fsync_tree(tmp)
                kill_point("registry.entry_copied")
                publish_dir(tmp, self.entries_dir / id)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            kill_point("registry.entry_published")
            return self.entry(id)

    def _usable(self, id: str) -> dict:
        e = self.entry(id)
        if not e["intact"]:
            raise RegistryError(f"entry {id}'s draft is missing ({e['draft_dir']}); pick an intact entry "
                                f"({self.command('list')})")
        return e

    def _move(self, e: dict, reason: str, replaced: str | None, rollback_to: str | None,
              decision: dict | None = None) -> None:
        """Point at entry `e`, appending to the history in the same atomic write."""
        p = self._pointer() or {}
        rec = {"id": e["id"], "since": time.time(), "reason": reason, "replaced": replaced,
               "rollback_to": rollback_to, "speedup": e["metrics"].get("speedup"), "tau": e["metrics"].get("tau"),
               "traffic_rows": (e.get("traffic") or {}).get("rows")}
        if decision is not None:
            rec["decision"] = decision
        new = {"id": e["id"], "since": rec["since"], "reason": reason, "history": p.get("history", []) + [rec]}
        write_json_atomic(self.pointer_path, new, before_replace=lambda: kill_point("registry.pointer_tmp"))
        kill_point("registry.pointer_moved")
        self._point_link()

    def _stamp(self, decision: dict) -> dict:
        d = dict(decision)
        d.setdefault("decided_at", time.time())
        d.setdefault("decision_id", new_run_id())
        return d

    def _append_decision(self, d: dict) -> None:
        if any(x.get("decision_id") == d["decision_id"] for x in self._read_decisions()):
            return
        text = self.decisions_path.read_text() if self.decisions_path.exists() else ""
        if text and not text.endswith("\n"):
            text += "\n"
        write_text_atomic(self.decisions_path, text + json.dumps(d, sort_keys=True, default=str) + "\n",
                          before_replace=lambda: kill_point("registry.decisions_tmp"))

    def record_decision(self, decision: dict) -> dict:
        """Log one gate outcome (promote or keep) with its figures; returns it stamped (decided_at, decision_id).
        A decision already logged (promote logs its own; a rerun repeats one) is not logged twice."""
        plain = json.loads(json.dumps(decision, default=str))
        with self._writing():
            for x in self.decisions():
                if all(k in x and x[k] == v for k, v in plain.items()):
                    return x
            d = self._stamp(decision)
            self._append_decision(d)
        return d

    def promote(self, id: str, decision: dict) -> dict:
        """Make entry `id` the champion (a pointer move) and log the decision; returns the champion entry."""
        d = self._stamp({"outcome": "promote", **decision, "entry": id})
        with self._writing():
            e = self._usable(id)
            p = self._pointer()
            cur = p["id"] if p else None
            # this run's promotion already moved the pointer once (a rerun after a crash before the run was marked
            # decided): where the champion has moved on since (a rollback), the rerun must not move it back
            run = decision.get("run_dir")
            before = [h["decision"] for h in (p or {}).get("history") or []
                      if (h.get("decision") or {}).get("entry") == id and h["decision"].get("run_dir") == run] \
                if run is not None else []
            if cur != id and not before:
                why = d.get("reason")
                self._move(e, f"promoted: {why}" if why else "promoted", cur, cur, d)
            else:  # promoted already: finish that promotion's log line if a crash cut it off, else log nothing
                last = before[-1] if before else (p.get("history") or [{}])[-1].get("decision")
                if last and last.get("decision_id") in {x.get("decision_id") for x in self._read_decisions()}:
                    return self.champion()
                d = last or d
            self._append_decision(d)
        return self.champion()

    def rollback(self, to: str | None = None) -> dict:
        """Move the pointer back: to the champion before the current one, or to entry `to`. Nothing is deleted;
        the move is recorded in the history. Returns the new champion's entry with `replaced` (the old id)."""
        with self._writing():
            p = self._pointer()
            if p is None:
                raise RegistryError(self._none_yet() if not self.exists() else
                                    f"no champion in {self.dir} yet; nothing to roll back")
            cur, hist = p["id"], p.get("history", [])
            if to is None:
                to = hist[-1].get("rollback_to") if hist else None
                if to is None:
                    raise RegistryError(f"{cur} is the first champion, there is none before it to roll back to; "
                                        f"{self.command('rollback --to ID')} picks any entry")
                # rolling back again continues down the chain that made `to` the champion
                made = [h for h in hist if h["id"] == to]
                nxt = made[-1].get("rollback_to") if made else None
            else:
                if to == cur:
                    raise RegistryError(f"{to} is already the champion")
                nxt = cur  # a plain rollback afterwards undoes this move
            e = self._usable(to)
            self._move(e, f"rollback from {cur}", cur, nxt)
        return e | {"replaced": cur}


def _export_dirs(exports, draft: Path, run_dir) -> dict[str, Path]:
    """Export directories to copy into the entry: {name: dir} or [dir, ...] or metrics.json's
    {format: {"dir": relative to the run}}; those inside the draft directory come with it already."""
    if not exports:
        return {}
    items = exports.items() if isinstance(exports, dict) else ((Path(x).name, x) for x in exports)
    out = {}
    for name, v in items:
        d = Path(v["dir"] if isinstance(v, dict) else v)
        if not d.is_absolute() and run_dir is not None and not d.exists():
            d = Path(run_dir) / d
        if not d.is_dir():
            raise RegistryError(f"export {name}: {d} is not a directory; export the draft again "
                                f"(`draftsmith export`) or leave it out")
        if d.resolve().is_relative_to(draft.resolve()):
            continue
        out[str(name)] = d
    return out


# ---------------------------------------------------------------------- `draftsmith drafts`
def add_parser(sub) -> None:
    p = sub.add_parser("drafts", help="the draft registry: list entries, show one, roll the champion back")
    acts = p.add_subparsers(dest="action", required=True)
    for name, h in (("list", "every entry, the champion marked *"),
                    ("show", "one entry's record and files (default: the champion)"),
                    ("rollback", "move the champion pointer back (instant; nothing is deleted)")):
        a = acts.add_parser(name, help=h)
        a.add_argument("--domain", required=True, help="the domain (runs/<domain>/registry)")
        a.add_argument("--runs-dir", default="runs", help="where run directories are (default: runs)")
        if name == "show":
            a.add_argument("id", nargs="?", help="entry id (default: the champion)")
        if name == "rollback":
            a.add_argument("--to", help="entry id to make the champion (default: the champion before this one)")


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _table(reg: Registry, champ: str | None) -> list[str]:
    rows = [f"  {'ID':24s} {'CREATED':16s} {'KIND':8s} {'SPEEDUP':>8s} {'TAU':>6s} {'ALPHA':>6s} {'TRAFFIC':>8s}"]
    for e in reg.entries():
        m = e.get("metrics", {})
        mark = "*" if e["id"] == champ else " "
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(e.get("created", 0)))
        speed = _fmt(m.get("speedup"), ".2f") + ("x" if isinstance(m.get("speedup"), (int, float)) else "")
        rows.append(f"{mark} {e['id']:24s} {created:16s} {e.get('kind', '-'):8s} {speed:>8s} "
                    f"{_fmt(m.get('tau'), '.2f'):>6s} {_fmt(m.get('alpha'), '.3f'):>6s} "
                    f"{_fmt((e.get('traffic') or {}).get('rows'), 'd'):>8s}"
                    + ("" if e["intact"] else "  (draft missing)"))
    return rows


def command(args) -> int:
    """`draftsmith drafts list|show|rollback`; RegistryError (one line, exit 2) for what a user can fix."""
    reg = Registry(Path(args.runs_dir) / args.domain)
    if not reg.exists():
        raise RegistryError(reg._none_yet())
    with reg._writing():  # a registry from before the link, or a writer killed before moving it: the link follows
        pass
    if args.action == "list":
        p = reg._pointer()
        print("\n".join(_table(reg, p["id"] if p else None)))
        reg.champion()  # a broken pointer: the table, then the one-line error
        return 0
    if args.action == "show":
        e = reg.entry(args.id) if args.id else reg.champion()
        if e is None:
            raise RegistryError(f"no champion in {reg.dir} yet; give an entry id ({reg.command('list')})")
        print(json.dumps(e, indent=2, sort_keys=True))
        d = Path(e["draft_dir"])
        state = " (missing)" if not e["intact"] else "" if reg.verify(e["id"]) else " (files changed since admission)"
        print(f"draft: {d}{state}")
        for f in sorted(x for x in d.rglob("*") if x.is_file()) if d.is_dir() else []:
            print(f"  {f.relative_to(d)}  {f.stat().st_size} bytes")
        return 0
    e = reg.rollback(args.to)
    print(f"draftsmith: champion {e['replaced']} -> {e['id']} ({e['draft_dir']})")
    return 0
