"""The target's side of training data, computed once and cached on disk: its final-norm features
for the feature-reading heads (eagle, medusa) where the generate stage did not keep them
(`generated_features`), the residual streams entering a method's chosen layers
(eagle3's aux features, `DraftMethod.feature_cache`), and raw domain text scored by it (train.raw_windows).

Both caches are one safetensors file whose metadata holds a key of their inputs; a file with another
key is computed again, and files are written to a temporary name and renamed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from eval.family import aux_hidden_states, final_features

from .faults import kill_point
from .models import compute_copy
from .shards import load_row_tensors, save_row_tensors, shard_features
from .train_data import TrainError, right_padded

FEATURES_FILE = "features.safetensors"
RAW_TEACHER_FILE = "raw-teacher.safetensors"


def aux_features_file(layers) -> str:
    """The aux-feature cache of `layers` (its own file: the final-norm cache stays valid beside it)."""
    return f"features-aux-{'-'.join(map(str, layers))}.safetensors"


def generated_features(gen_dir: Path, rows) -> list[torch.Tensor] | None:
    """The final-norm features the generate stage kept for `rows` (train_data.load_rows' rows, each naming
    its stage row "src"), cut to each row's tokens: the decoder's own, as it serves the draft, at no forward.
    None where the shards do not hold them (HF or vLLM generated them, or an older run)."""
    every = shard_features(gen_dir)
    if every is None:
        return None
    feats = [every[r["src"]][:len(r["ids"])] for r in rows]
    bad = next((r["src"] for r, f in zip(rows, feats) if len(f) != len(r["ids"])), None)
    if bad is not None:
        raise TrainError(f"{gen_dir}: row {bad}'s stored features are shorter than its tokens; delete {gen_dir} "
                         f"and rerun the generate stage")
    return feats


def padded_batches(seqs: list[list[int]], batch_size: int, desc: str):
    """Length-sorted (little padding) right-padded batches of token-id lists, with a progress bar:
    yields (indices into seqs, ids [b, L], attention mask [b, L])."""
    from tqdm.auto import tqdm

    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for s in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
        idx = order[s:s + batch_size]
        yield (idx, *right_padded([seqs[i] for i in idx]))


@torch.no_grad()
def cache_features(target, rows, path: Path, key: str, batch_size: int = 8, device=None,
                   layers=None) -> list[torch.Tensor]:
    """EAGLE Step 2: one teacher-forced target forward per sequence -> final-norm hidden states
    (the decoder's last_hidden_state, any family) [n, H], or with `layers` the residual streams entering
    those layers concatenated [n, len(layers) * H] (eval.family.aux_hidden_states), stored in the target's
    dtype (bf16 by default) in one safetensors file with per-row offsets. Reused when the key (target,
    dtype, seq_len, shard checksums, layers) matches; written to a temporary file and renamed."""
    path = Path(path)
    cached = load_row_tensors(path, key) if path.exists() else None
    if cached is not None:
        return cached
    device = device or next(target.parameters()).device
    dtype, model = next(target.parameters()).dtype, compute_copy(target)
    feats: list = [None] * len(rows)
    for idx, ids, am in padded_batches([r["ids"] for r in rows], batch_size, "target features"):
        ids, am = ids.to(device), am.to(device)
        if layers is None:
            h = final_features(model, ids, am)  # [b, L, H]
        else:
            h = aux_hidden_states(model, ids, am, layers)  # [b, L, len(layers) * H]
        for b, i in enumerate(idx):
            feats[i] = h[b, :len(rows[i]["ids"])].to(dtype).cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".features-", suffix=".safetensors")
    os.close(fd)
    save_row_tensors(Path(tmp), feats, key)
    kill_point("features.before_rename")
    os.replace(tmp, path)
    return feats


@torch.no_grad()
def score_raw_windows(target, windows, k: int, path: Path, key: str, batch_size: int = 8):
    """Data mix (train.raw_windows): windows of the domain's raw text scored by the target in one
    teacher-forced forward each, which yields both the teacher (the target's top-k log-probs for every
    token after the first, as generate stores them for completions) and the target's final-norm
    features (what eagle and medusa train on). Medusa-1 trains its heads on such teacher-forced data;
    it costs one batched forward per window where generation costs one forward per token.

    Returns (rows in `train_data.load_rows`' format with P=1 and tensor teachers, features [n, H] per row).
    Cached in one safetensors file keyed by (target, dtype, seq_len, seed, source, n, k); written to a
    temporary file and renamed, so an interrupted run scores again rather than reading half a file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    t = None
    if path.exists():
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("key") == key:
                t = {n: f.get_tensor(n) for n in f.keys()}
    if t is None:
        windows = windows() if callable(windows) else windows  # tokenizing the raw text: only when not cached
        device = next(target.parameters()).device
        dtype, model = next(target.parameters()).dtype, compute_copy(target)
        feats, tk_ids, tk_lp = [None] * len(windows), [None] * len(windows), [None] * len(windows)
        for idx, ids, am in padded_batches(windows, batch_size, "score raw text"):
            # the whole model, not head(last_hidden_state): some families post-process logits (Gemma 2's soft-cap)
            out = model(input_ids=ids.to(device), attention_mask=am.to(device), output_hidden_states=True,
                        use_cache=False)
            h = out.hidden_states[-1].to(dtype)  # [B, L, H]: last_hidden_state, after the final norm
            lp, ix = torch.log_softmax(out.logits[:, :-1].float(), -1).topk(k, -1)  # [B, L-1, k] x2
            for b, i in enumerate(idx):
                n = len(windows[i])
                feats[i], tk_ids[i], tk_lp[i] = h[b, :n].cpu(), ix[b, :n - 1].cpu().int(), lp[b, :n - 1].cpu()
        lens = torch.tensor([len(w) for w in windows])
        t = {"ids": torch.tensor([x for w in windows for x in w], dtype=torch.int32), "lens": lens,
             "features": torch.cat(feats).contiguous(), "tk_ids": torch.cat(tk_ids).contiguous(),
             "tk_lp": torch.cat(tk_lp).contiguous()}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".raw-teacher-", suffix=".safetensors")
        os.close(fd)
        save_file(t, tmp, metadata={"key": key})
        os.replace(tmp, path)
    rows, feats = [], []
    o = ot = 0
    for n in t["lens"].tolist():
        rows.append({"ids": t["ids"][o:o + n].tolist(), "P": 1, "tk_ids": t["tk_ids"][ot:ot + n - 1].long(),
                     "tk_lp": t["tk_lp"][ot:ot + n - 1]})
        feats.append(t["features"][o:o + n])
        o, ot = o + n, ot + n - 1
    return rows, feats
