"""Loading the target: the embedded GGUF or any `.gguf` file transformers reads (converted once to a bf16
HF checkpoint and cached by the file's hash), a local HF checkpoint directory, or a hub id where a network
exists."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from eval.cpu import bf16_matmul_fast
from eval.loading import convert_embedded, convert_gguf, embedded_dir, gguf_dir, is_gguf, tokenizers_match

from .config import EMBEDDED_TARGET


class ModelError(RuntimeError):
    """A model cannot be loaded; the message says why and what to do."""


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    return torch.device(device)


def pick_dtype(dtype: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]


def served_path(spec: str) -> str:
    """The checkpoint directory a recipe's `target` names on this machine, for a serve command: the embedded
    target's and a GGUF's conversion directories (where any run that loaded them put them), else the spec
    itself. Converts nothing: a report only names it."""
    if spec == EMBEDDED_TARGET:
        return str(embedded_dir())
    if is_gguf(spec) and Path(spec).expanduser().is_file():
        return str(gguf_dir(spec))
    return spec


def resolve_target(spec: str) -> str:
    """Map a recipe's `target` to something `from_pretrained` takes."""
    if spec == EMBEDDED_TARGET:
        return str(convert_embedded())  # LoadError (a user-facing error) when the wheel is missing
    if is_gguf(spec):
        return str(convert_gguf(spec))  # LoadError (a user-facing error) when the file is missing or unreadable
    p = Path(spec)
    if p.exists():
        if not (p / "config.json").exists():
            raise ModelError(f"target path {spec} has no config.json; give an HF checkpoint directory")
        return str(p)
    if spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") != 1:
        raise ModelError(f"target path {spec} does not exist; give an HF checkpoint directory, a .gguf file, "
                         f"a hub id, or {EMBEDDED_TARGET}")
    if os.environ.get("HF_HUB_OFFLINE", "1") == "1" and not os.environ.get("DRAFTSMITH_ALLOW_HUB"):
        raise ModelError(f"target {spec!r} is neither a local directory nor the embedded default, and hub "
                         f"downloads are off; set DRAFTSMITH_ALLOW_HUB=1 to fetch it, or give a local path")
    return spec


def target_skeleton(spec: str):
    """The target's modules on the meta device, no weights read: enough to ask what it is (a method's
    refusal, pipeline.methods.check_applies) before a stage loads it or writes anything."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(resolve_target(spec))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


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


def check_tokenizers(target_tok, draft_tok, draft_name: str = "draft") -> None:
    if not tokenizers_match(target_tok, draft_tok):
        raise ModelError(f"{draft_name} tokenizer differs from the target's (vocab "
                         f"{len(draft_tok)} vs {len(target_tok)}); a draft must share the target's tokenizer")


def compute_copy(target):
    """The model a teacher-forced pass runs: `target` itself, or an fp32 copy where its dtype is bf16 and
    PyTorch's bf16 matmuls are slow here (a CPU without oneDNN's bf16 path: ~2.5x slower than fp32 forward,
    eval.cpu.bf16_matmul_fast). Outputs are cast back to the target's dtype, so caches hold what they held."""
    p = next(target.parameters())
    if p.dtype != torch.bfloat16 or bf16_matmul_fast(p.device):
        return target
    return copy.deepcopy(target).float()
