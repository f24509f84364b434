"""`draftsmith export`: a trained draft directory written in the formats serving engines load.

    export_draft(src, fmt, out, verifier=None, k=None, force=False) -> out

The formats, their writers and serve commands are pipeline/formats.py's FORMATS. The final-feature EAGLE
head, self_spec and int8 have no engine format. The draft must have been trained for the verifier
(vocabulary, hidden size, layers checked against its config.json). The output is written to a temporary
directory and renamed, so a refusal or a crash leaves `out` as it was; it holds the files plus MANIFEST
(format, source, verifier, K, sha256 of every file, and the serve commands).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

from eval import draft_dir
from eval.datastore import FILE as DATASTORE_FILE

from .engines.draftsmith_vllm.proposer import k_table_ranges
from .formats import FORMATS, HEAD_FILE, ExportError, Verifier, serve_formats

MANIFEST = "draftsmith_export.json"
DEFAULT_K = 2  # evaluate.k's default: the speculative tokens per round when --k is not given


# ------------------------------------------------------------------------------- checks

def engine_format(meta: dict, engine: str) -> str | None:
    """The format `engine` loads a draft of this metadata in, None when it cannot serve it."""
    fmt = serve_formats().get(engine, {}).get(meta.get("kind"))
    return None if fmt is None or kind_problem(meta, fmt) else fmt


def kind_problem(meta: dict, fmt: str) -> str | None:
    if FORMATS[fmt].datastore:  # the draft's datastore, whatever its kind (check_files wants the file)
        return None
    kind = meta.get("kind")
    mc = meta.get("medusa_config") or {}
    if kind == "medusa" and mc.get("recurrent"):
        return ("recurrent Medusa heads read the drafted tokens, which no engine's Medusa does: no engine "
                "format holds them; train independent heads (train.medusa.recurrent=false)")
    if (kind == "medusa" and fmt == "medusa" and mc["draft_vocab_size"] < mc["vocab_size"]
            and not mc.get("shared_lm_head")):
        return (f"Medusa heads with an LM head each over a truncated draft vocabulary ({mc['draft_vocab_size']} of "
                f"{mc['vocab_size']} ids) do not load in vLLM 0.32: it truncates only a shared LM head "
                f"(original_lm_head + token_map; an LM head each must be the full vocabulary); train them with "
                f"train.medusa.shared_lm_head=true, or train.draft_vocab_size=0")
    if kind not in FORMATS[fmt].kinds:
        holders = [f.name for f in FORMATS.values() if kind in f.kinds]
        exportable = [f"{k.name} ({' or '.join(k.exports)})" for k in draft_dir.kinds() if k.exports]
        fix = (f"use --format {' or '.join(holders)}" if holders else
               f"no engine format holds this kind; train train.method={', '.join(exportable)}")
        return f"--format {fmt} holds {' or '.join(FORMATS[fmt].kinds)} drafts, not {kind!r}: {fix}"
    return None


def check_kind(meta: dict, fmt: str, src: Path) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    problem = kind_problem(meta, fmt)
    if problem:
        raise ExportError(f"{src}: {problem}")


def check_out(out: Path, force: bool, src: Path | None = None) -> None:
    if src is not None and (out.resolve() == src.resolve() or src.resolve().is_relative_to(out.resolve())):
        raise ExportError(f"--out {out} holds the draft {src} itself, which --force would delete; give another "
                          f"directory")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} exists and is not empty; give a new directory or pass --force to replace it")


def resolve_verifier(verifier: str | None, meta: dict, src: Path) -> Verifier:
    """--verifier, else the target the draft records (the embedded default resolves to its local HF dir)."""
    from .models import resolve_target

    spec = verifier or meta.get("target")
    if not spec:
        raise ExportError(f"{src} records no target; pass --verifier <the target's HF directory or hub id>")
    path = resolve_target(spec)
    local = Path(path)
    if local.is_dir():
        return Verifier(str(local.resolve()), json.loads((local / "config.json").read_text()), local)
    from transformers import PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(path)
    except OSError as e:
        raise ExportError(f"verifier {spec!r}: cannot read its config.json ({str(e).splitlines()[0]}); "
                          f"give a local HF directory") from None
    return Verifier(path, config, None)


AUX_KINDS = ("eagle3", "dflash")  # drafts over the target's aux layers: head_config names them and the target's width


def _draft_shape(meta: dict, src: Path, weights: bool = True) -> dict:
    """What the draft was built around, in the verifier config's key names (weights=False: the target it
    records only, for a format that exports no weights)."""
    shape = {k: v for k, v in (meta.get("target_config") or {}).items()
             if k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")}
    if not weights:
        return shape
    if meta["kind"] in AUX_KINDS:
        hc = meta["head_config"]
        shape |= {"vocab_size": hc["vocab_size"], "hidden_size": hc.get("target_hidden_size") or hc["hidden_size"]}
    elif meta["kind"] == "medusa":
        mc = meta["medusa_config"]
        shape |= {"vocab_size": mc["vocab_size"], "hidden_size": mc["hidden_size"]}
    elif meta["kind"] == "draft_lm":
        shape |= {"vocab_size": json.loads((src / "config.json").read_text())["vocab_size"]}
    return shape


def check_verifier(meta: dict, src: Path, v: Verifier, weights: bool = True) -> None:
    """The draft was trained for this verifier: every recorded shape equals the verifier's (weights=False:
    a datastore export, whose token ids the writer checks against the verifier's vocabulary)."""
    for key, want in _draft_shape(meta, src, weights).items():
        have = v.config.get(key)
        if have != want:
            raise ExportError(f"{src} was trained for a target with {key}={want!r}, but verifier "
                              f"{v.name_or_path} has {key}={have!r}; pass the --verifier it was trained for"
                              + (f" ({meta['target']})" if meta.get("target") else ""))
    if weights and meta["kind"] in AUX_KINDS:
        n = v.config.get("num_hidden_layers")
        bad = [i for i in meta["head_config"]["aux_layers"] if n is not None and not 0 <= i <= n]
        if bad:
            raise ExportError(f"{src}: aux_layers {bad} are not layers of verifier {v.name_or_path} "
                              f"({n} layers); pass the --verifier it was trained for")


def check_files(src: Path, meta: dict, fmt: str) -> None:
    if FORMATS[fmt].datastore:
        if not (src / DATASTORE_FILE).is_file():
            raise ExportError(f"{src} holds no {DATASTORE_FILE}: --format {fmt} exports a draft's datastore (the "
                              f"target's own outputs); export a checkpoint trained with train.datastore=true "
                              f"(runs/<domain>/<run>/train/checkpoint-N/; best/ keeps it only when promoted with it)")
        return
    need = {"eagle3": [HEAD_FILE], "dflash": [HEAD_FILE], "medusa": [HEAD_FILE], "draft_lm": ["config.json"]}[meta["kind"]]
    if meta["kind"] == "draft_lm" and not any(src.glob("*.safetensors")) and not (src / "pytorch_model.bin").exists():
        need.append("model.safetensors")
    for name in need:
        if not (src / name).is_file():
            raise ExportError(f"{src} has no {name}: not a complete {meta['kind']} draft; export a checkpoint "
                              f"directory written by `draftsmith train` (or best/)")


# ------------------------------------------------------------------------------- export

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(fmt: str, src: Path, meta: dict, tmp: Path, out: Path, v: Verifier, k: int,
             k_by_batch: list | None = None) -> dict:
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    m = {"format": fmt, "kind": meta["kind"], "source": str(src.resolve()), "step": meta.get("step"),
         "train_key": meta.get("train_key"), "verifier": v.name_or_path, "k": k, "k_by_batch": k_by_batch,
         "files": {str(p.relative_to(tmp)): _sha256(p) for p in files},
         "serve": FORMATS[fmt].serve(out.resolve(), v.name_or_path, k, k_by_batch, files=tmp)}
    if meta.get("proposer") == "hybrid" and not FORMATS[fmt].datastore:
        m["note"] = "promoted as a hybrid with n-gram lookups in our decoder; an engine serves the draft alone"
    return m


def k_table(text: str) -> list:
    """--k-by-batch (argparse type): vLLM's num_speculative_tokens_per_batch_size as JSON, checked by vLLM's
    rules before anything is written or any engine starts."""
    try:
        table = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: give [[start, end, K], ...] ranges from "
                                         f"batch 1, e.g. '[[1, 4, 4], [5, 256, 0]]'") from None
    try:
        k_table_ranges(table)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return table


def check_k_by_batch(table: list | None, k: int | None) -> int | None:
    """--k-by-batch against --k: the table by vLLM's own rules, and no K in it above --k (vLLM would cap it
    there unannounced). Returns --k, or the table's largest K (at least 1) when --k is not given."""
    if not table:
        return k
    try:
        ranges = k_table_ranges(table)
    except ValueError as e:
        raise ExportError(f"--k-by-batch: {e}") from None
    top = max(c for *_, c in ranges)
    if k is not None and top > k:
        raise ExportError(f"--k-by-batch asks K={top} but --k is {k}: vLLM caps every K of the table at "
                          f"num_speculative_tokens; pass --k {top} or lower the table")
    return max(top, 1) if k is None else k


def export_draft(src: str | Path, fmt: str, out: str | Path, verifier: str | None = None, k: int | None = None,
                 force: bool = False, k_by_batch: list | None = None) -> Path:
    """Write the draft directory `src` as `fmt` into `out` (see the module doc); returns `out`. k_by_batch:
    vLLM's `num_speculative_tokens_per_batch_size` (the owner report's recommended table) for the vLLM serve
    command. ExportError (or DraftDirError) with one line naming the fix when it cannot, `out` untouched."""
    src, out = Path(src), Path(out)
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    meta = draft_dir.read_meta(src)
    check_kind(meta, fmt, src)
    check_files(src, meta, fmt)
    check_out(out, force, src)
    if k is not None and k < 1:
        raise ExportError(f"--k {k}: the speculative tokens per round must be >= 1")
    k = check_k_by_batch(k_by_batch, k)
    k = DEFAULT_K if k is None else k
    v = resolve_verifier(verifier, meta, src)
    check_verifier(meta, src, v, weights=not FORMATS[fmt].datastore)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        FORMATS[fmt].writer(src, meta, tmp, v, k)
        m = manifest(fmt, src, meta, tmp, out, v, k, k_by_batch or None)
        (tmp / MANIFEST).write_text(json.dumps(m, indent=2))
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(tmp: Path, out: Path) -> None:
    """tmp becomes out; an existing out (empty, or replaced with --force) is removed only after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
