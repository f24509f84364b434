"""New traffic for `draftsmith retrain`: read, checked, deduplicated against everything used before, split.

runs/<domain>/traffic/
  ledger.jsonl            one line per prompt ever used for training or held out: {"key", "batch", "split"}
                          (key: a hash of the prompt, whitespace-insensitive), rewritten atomically
  batches/<batch id>/     train.jsonl, fresh.jsonl (the held-out slice no draft has seen), manifest.json
                          ({"status": "ingested" | "decided", "run_dir", counts, sources})

A batch is committed when its ledger lines are written: a batch directory the ledger does not name (a
crash between the two) is removed and its traffic ingested again. Traffic is read with pipeline.data's
readers, so every format distill accepts works here (prompt rows, served logs, OpenAI request/response,
Parquet, save_to_disk directories); bad traffic raises TrafficError naming file:line before anything changes.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from pathlib import Path

from .atomic import make_tmp_dir, publish_dir, write_json_atomic, write_text_atomic
from .data import FILE_SUFFIXES, DataError, dedupe, load_source, normalise, prompt_text
from .faults import kill_point
from .lock import new_run_id

LEDGER = "ledger.jsonl"


class TrafficError(ValueError):
    """Unusable traffic; the message names file:line and the fix."""


def prompt_key(row: dict) -> str:
    """A prompt's identity across batches: whitespace-insensitive text, chat turns as given (data.dedupe's)."""
    k = normalise(prompt_text(row)) if "prompt" in row else json.dumps(row["messages"], sort_keys=True)
    return hashlib.sha256(k.encode()).hexdigest()[:24]


def _check_utf8(path: Path) -> None:
    """A .jsonl (not gzipped) that is not UTF-8 names its first bad line (the reader would only say 'codec')."""
    if not path.name.endswith(".jsonl"):
        return
    blob = path.read_bytes()
    if not blob.strip():
        raise TrafficError(f"{path}:1: the traffic file is empty; give a JSONL file with one request per line "
                           f"(data/README.md lists the formats)")
    try:
        blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line = blob[:e.start].count(b"\n") + 1
        raise TrafficError(f"{path}:{line}: not UTF-8 text (byte 0x{blob[e.start]:02x}); re-export the log as "
                           f"UTF-8") from None


def read_traffic(paths: list[str]) -> list[dict]:
    """Every row of the traffic files or folders, in order, with `source` (file) kept; TrafficError on
    the first bad one (missing, empty, not UTF-8, truncated JSON, wrong types)."""
    rows = []
    for spec in paths:
        p = Path(spec)
        if not p.exists():
            raise TrafficError(f"traffic {p} does not exist; give a .jsonl, .jsonl.gz or .parquet file or a folder "
                               f"of them")
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*")
                                                if f.is_file() and f.name.endswith(FILE_SUFFIXES))
        for f in files:
            _check_utf8(f)
        try:
            got = load_source(str(p), "--traffic")
        except DataError as e:
            raise TrafficError(str(e)) from None
        except (UnicodeDecodeError, EOFError, OSError) as e:  # a gzipped log that is not UTF-8 or is cut short
            raise TrafficError(f"{p}: unreadable traffic ({type(e).__name__}: {e}); re-export it as UTF-8 "
                               f"JSONL") from None
        rows += got
    return rows


class Ledger:
    """runs/<domain>/traffic: the ledger of prompts used and the batches they came in."""

    def __init__(self, domain_dir):
        self.dir = Path(domain_dir) / "traffic"

    @property
    def path(self) -> Path:
        return self.dir / LEDGER

    def lines(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]

    def keys(self) -> set[str]:
        return {x["key"] for x in self.lines()}

    def batch_ids(self) -> list[str]:
        return list(dict.fromkeys(x["batch"] for x in self.lines()))

    def batch_dir(self, batch_id: str) -> Path:
        return self.dir / "batches" / batch_id

    def manifest(self, batch_id: str) -> dict:
        return json.loads((self.batch_dir(batch_id) / "manifest.json").read_text())

    def update(self, batch_id: str, **kw) -> dict:
        m = self.manifest(batch_id) | kw
        write_json_atomic(self.batch_dir(batch_id) / "manifest.json", m)
        return m

    def pending(self) -> dict | None:
        """The oldest committed batch not yet decided (an interrupted retrain resumes it), else None."""
        for b in self.batch_ids():
            m = self.manifest(b)
            if m["status"] != "decided":
                return m
        return None

    def rows(self, batch_id: str, split: str) -> list[dict]:
        p = self.batch_dir(batch_id) / f"{split}.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]

    def remove_orphans(self) -> None:
        """Batch directories the ledger does not name: written before a crash, never committed."""
        known = set(self.batch_ids())
        root = self.dir / "batches"
        for d in (root.iterdir() if root.exists() else []):
            if d.name not in known:
                shutil.rmtree(d, ignore_errors=True)


def fresh_count(n: int, cfg) -> int:
    """How many of n new prompts are held out: at most retrain.fresh_prompts and fresh_fraction of them, at least 1."""
    return max(1, min(cfg.fresh_prompts, int(n * cfg.fresh_fraction)))


def ingest(domain_dir, paths: list[str], cfg, seed: int = 0) -> dict | None:
    """Read `paths`, drop prompts the ledger has seen, split off the fresh slice and commit a batch; returns
    its manifest, or None when nothing is new (nothing is written then)."""
    rows = read_traffic(paths)
    ledger = Ledger(domain_dir)
    seen = ledger.keys()
    uniq = dedupe(rows)
    new = []
    for r in uniq:
        k = prompt_key(r)
        if k not in seen:
            new.append({**r, "id": f"t-{k}", "source_id": r["id"]})
    if not new:
        return None
    ledger.remove_orphans()
    new.sort(key=lambda r: r["id"])  # the split depends on the prompts, not on the files' order
    random.Random(seed + 3).shuffle(new)
    n_fresh = fresh_count(len(new), cfg)
    fresh, train = new[:n_fresh], new[n_fresh:]
    batch_id = new_run_id()
    manifest = {"id": batch_id, "created": time.time(), "status": "ingested", "run_dir": None,
                "sources": [str(Path(p).resolve()) for p in paths], "rows_read": len(rows),
                "duplicates": len(rows) - len(new), "new_rows": len(new), "n_train": len(train), "n_fresh": len(fresh)}
    tmp = make_tmp_dir(ledger.dir / "batches", batch_id)
    for name, rs in (("train", train), ("fresh", fresh)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rs))
    write_json_atomic(tmp / "manifest.json", manifest)
    publish_dir(tmp, ledger.batch_dir(batch_id))
    kill_point("retrain.after_ingest")
    old = ledger.path.read_text() if ledger.path.exists() else ""
    lines = [{"key": r["id"][2:], "batch": batch_id, "split": s} for s, rs in (("train", train), ("fresh", fresh))
             for r in rs]
    write_text_atomic(ledger.path, old + "".join(json.dumps(x) + "\n" for x in lines))
    kill_point("retrain.after_ledger")
    return manifest
