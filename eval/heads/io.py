"""Saving and reading a feature-reading head's draft directory (its weights in head.safetensors, its
metadata in the draft-directory file of eval/draft_dir.py)."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from .. import draft_dir

HEAD_FILE = "head.safetensors"


def save_head(module: nn.Module, directory: str | Path, meta: dict) -> None:
    """A feature-reading head's draft directory: its state dict in head.safetensors, `meta` (with
    "kind") in the draft-directory file (eval/draft_dir.py)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    # a clone each: tied weights (DFlash's shared k_norm) are one tensor under several names, which safetensors refuses
    save_file({k: v.detach().cpu().clone() for k, v in module.state_dict().items()}, str(d / HEAD_FILE))
    draft_dir.write_meta(d, meta)


def read_head(directory: str | Path, kind: str, what: str) -> tuple[dict, dict]:
    """-> (meta, state dict) of a head saved by `save_head`; ValueError ("... not <what>") when it
    holds another kind."""
    from safetensors.torch import load_file

    d = Path(directory)
    meta = draft_dir.read_meta(d)
    if meta.get("kind") != kind:
        raise ValueError(f"{d} holds a {meta.get('kind')!r} draft, not {what}")
    return meta, load_file(str(d / HEAD_FILE))


def load_head(directory: str | Path, kind: str, what: str, build, dtype=None, device=None) -> nn.Module:
    """A head saved by `save_head`: build(meta, d2t) makes the module, which then takes the saved
    weights and moves to `device` (and `dtype`, when given)."""
    meta, state = read_head(directory, kind, what)
    head = build(meta, state["d2t"])
    head.load_state_dict(state)
    return head.to(device=device, dtype=dtype) if dtype is not None else head.to(device=device)
