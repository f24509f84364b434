"""pipeline/checksum.py, the one directory checksum shard manifests and registry entries store: versioned, and the
values written before the version (two formulas, by who wrote them) still verify, so old runs resume and old
registries still read."""

import hashlib
import json
from pathlib import Path

from eval import draft_dir
from pipeline.checksum import LEGACY_REGISTRY, LEGACY_SHARD, VERSION, dir_checksum, matches
from pipeline.registry import ENTRY_FILE, Registry
from pipeline.shards import complete_shards, verify_shard


def written_before(d: Path, sep: bytes) -> str:
    """The unversioned value as the old code wrote it: shards._dir_checksum (sep b"") or registry.dir_checksum
    (sep b"\\0"), copied here as they were, so the test does not read them through the code it checks."""
    h = hashlib.sha256()
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        h.update(f.relative_to(d).as_posix().encode() + sep)
        h.update(f.read_bytes())
    return h.hexdigest()


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_versioned_and_unambiguous(tmp_path):
    """Where a file's bytes end is part of the value: two trees whose path-and-bytes streams are equal under both
    old formulas (a path ending where a file's bytes began) differ now."""
    a = tree(tmp_path / "a", {"x": b"1y\x001"})
    b = tree(tmp_path / "b", {"x": b"1", "y": b"1"})
    assert written_before(a, b"\0") == written_before(b, b"\0")
    assert dir_checksum(a).startswith(VERSION) and dir_checksum(a) != dir_checksum(b)
    assert matches(a, dir_checksum(a), LEGACY_SHARD) and not matches(b, dir_checksum(a), LEGACY_SHARD)
    assert not matches(a, None, LEGACY_SHARD) and not matches(tmp_path / "gone", dir_checksum(a), LEGACY_SHARD)


def test_an_old_shard_manifest_still_verifies(tmp_path):
    """A manifest written before the version: its shards are complete (a resumed run keeps them), and a changed
    shard still fails."""
    stage = tmp_path / "generate"
    shard = tree(stage / "shard-00000", {"data-00000-of-00001.arrow": b"rows" * 100, "state.json": b"{}"})
    entry = {"rows": 4, "sha256": written_before(shard, LEGACY_SHARD)}
    (stage / "manifest.json").write_text(json.dumps({"shards": {"shard-00000": entry}, "complete": True}))
    assert not entry["sha256"].startswith(VERSION)
    assert verify_shard(stage, "shard-00000", entry) and set(complete_shards(stage)) == {"shard-00000"}
    (shard / "state.json").write_bytes(b'{"x": 1}')
    assert not verify_shard(stage, "shard-00000", entry) and complete_shards(stage) == {}


def test_an_old_registry_entry_still_verifies_and_is_not_admitted_twice(tmp_path):
    """An entry whose draft_sha256 was written before the version verifies (`drafts show` says nothing changed),
    and the resumed run that admitted it adds no second entry; a changed draft file fails the check."""
    reg = Registry(tmp_path / "runs" / "code")
    run = tmp_path / "run-a"
    best = run / "best"
    draft_dir.write_meta(best, {"kind": "medusa"})
    (best / "weights.bin").write_bytes(b"w" * 64)
    e = reg.add(best, run_dir=run, metrics={}, kind="distill", hashes={}, traffic={})
    assert e["draft_sha256"].startswith(VERSION) and reg.verify(e["id"])
    path = reg.entries_dir / e["id"] / ENTRY_FILE
    old = json.loads(path.read_text()) | {"draft_sha256": written_before(Path(e["draft_dir"]), LEGACY_REGISTRY)}
    path.write_text(json.dumps(old))

    assert reg.verify(e["id"])
    again = reg.add(best, run_dir=run, metrics={}, kind="distill", hashes={}, traffic={})
    assert again["id"] == e["id"] and len(reg.entries()) == 1
    (Path(e["draft_dir"]) / "weights.bin").write_bytes(b"x" * 64)
    assert not reg.verify(e["id"])
