"""Stage 2: train a draft on the target's generated outputs (run_dir/generate) -> run_dir/train.

Methods (recipe.train.method), one module each in pipeline/methods/ behind `DraftMethod`:
- eagle: a decoder layer over the target's features and the next token (Li et al., 2024, EAGLE;
  truncated vocabulary and training-time test from EAGLE-3, Li et al., 2025).
- eagle3: one decoder layer over three fused target layers (Li et al., 2025, EAGLE-3), in the layout
  vLLM and SGLang load.
- medusa: heads on the target's last feature, one per further position (Cai et al., 2024, Medusa).
- draft_lm: a small LM, the target's first layers or a local HF model, fully fine-tuned or with LoRA.
- self_spec: the target's own first layers + an adapter (Zhang et al., 2023, Draft & Verify;
  Elhoushi et al., 2024, LayerSkip).
- int8: an int8 copy of the target, built at load time; nothing to train (a baseline).

Data (recipe.train.data): "generated" (the target's outputs), "raw" (raw domain text, one-hot
targets: the undistilled baseline), "onpolicy" / "mix" (GKD, Agarwal et al., 2024: some or all steps
train on continuations sampled from the draft itself and scored by the target, pipeline/onpolicy.py).
draft_lm with data=onpolicy trains through TRL's GKDTrainer instead of this loop (pipeline/gkd.py).

Teacher: the generate stage's stored top-k log-probs. They exist at completion positions only, so
the divergence is computed on completion positions only; prompt positions still feed the draft as
context, but carry no distribution loss. No target logits are recomputed (a log-softmax over the
whole vocabulary per position would cost more than the head itself).

This module is the loop (optimizer, schedule, accelerate, resume, checkpoints, tracking); the rows and
batches are in train_data.py, the target's cached features in features.py, and the checkpoints and
their keys in checkpoints.py. A rerun resumes from the newest complete checkpoint of its own recipe.

Several processes (DDP through accelerate; docs/reference/scaling.md):

    accelerate launch --num_processes 2 -m pipeline.train --recipe recipes/code.yaml --run-dir runs/code/X

(on a CPU-only machine `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 ...`: in accelerate
1.15 `--cpu` always starts a single process). train.batch_size is the global batch: each of N processes takes
batch_size / N rows of every batch, so the steps, the schedule and the rows of each step do not depend on N.
Each process's loss is the mean over its own rows and DDP averages the gradients. One process per machine
computes the feature caches while the others wait and read them; only the main process writes checkpoints,
train/log.jsonl and the manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eval.cpu import bf16_matmul_fast
from eval.datastore import FILE as DATASTORE_FILE, Datastore

from .checkpoints import BUDGET_FILE, STATE_FILE, checkpoints, restore, set_aside_foreign, trainer_state, write_checkpoint
from .features import (FEATURES_FILE, RAW_TEACHER_FILE, aux_features_file, cache_features, generated_features,
                       score_raw_windows)
from .config import stable_hash
from .data import read_jsonl
from .faults import kill_point
from .gkd import run_gkd, uses_gkd
from .methods import DraftMethod, check_applies, get_method
from .onpolicy import is_onpolicy_step, onpolicy_batch, step_seed
from .shards import read_manifest, remove_temps, write_json_atomic
from .tracking import NoOpTracker
from .train_data import (EpochSampler, RawText, Sequences, TrainError, check_vocab, collate, load_rows, raw_rows,
                         raw_windows)

__all__ = ["run_train", "TrainError", "LOG_FILE", "read_log"]

LOG_FILE = "log.jsonl"  # train/log.jsonl: one {"step", "loss", "lr", metrics...} per step, up to the last checkpoint
BUDGET_PROBE_STEPS = 10  # train.max_minutes: the steps timed before the plan (inside the default 20-step warm-up)


def run_train(recipe, run_dir, target=None, tokenizer=None, tracker=None, accelerator=None,
              init_from: Path | None = None) -> Path:
    """Train the recipe's draft on run_dir/generate; return run_dir/train. Resumes from the newest
    complete checkpoint; a finished run (checkpoint at train.steps) returns at once. Under `accelerate
    launch` each process runs this (module docstring); `accelerator` defaults to one made from the recipe.
    init_from: a draft directory of the recipe's method whose weights step 0 starts from (retrain's warm
    start from the champion); the optimizer starts fresh. It enters the train key, so a resume never mixes
    checkpoints started from different weights."""
    from .models import load_target, target_skeleton

    started = time.monotonic()  # train.max_minutes counts from here: loading rows and features is the stage's time
    tc, method = recipe.train, get_method(recipe.train.method)
    if method.layer_by_layer:  # self_spec/int8 run the target's layers themselves: refuse other families now
        check_applies(tc.method, target if target is not None else target_skeleton(recipe.target))
    train_dir = Path(run_dir) / "train"
    train_dir.mkdir(parents=True, exist_ok=True)
    key = recipe.train_key()
    if init_from is not None:
        key = stable_hash([key, warm_start_key(init_from)])
    extra = {"target": recipe.target, "method": tc.method, "divergence": tc.divergence, "data": tc.data,
             "train_key": key} | ({"init_from": str(init_from)} if init_from is not None else {})
    if _finished(train_dir, recipe):
        return train_dir  # nothing to load or recompute
    accelerator = accelerator or make_accelerator(recipe)  # before the target loads: each GPU process picks its own
    # a killed run's half-written checkpoints and caches (never resumed: they have temporary names)
    _on_main(accelerator, lambda: remove_temps(train_dir, ".checkpoint-", ".features-", ".raw-teacher-", ".tmp-"))
    if not method.trains:
        _on_main(accelerator, lambda: _untrained_checkpoint(train_dir, recipe, method, extra))
        return train_dir
    if tc.batch_size % accelerator.num_processes:
        raise TrainError(f"train.batch_size={tc.batch_size} is the global batch and must divide among "
                         f"{accelerator.num_processes} processes; set a multiple of {accelerator.num_processes}")
    gkd = uses_gkd(tc)  # refuses what GKDTrainer cannot do before the target loads
    rows, gen_manifest = load_rows(run_dir, recipe.target, recipe.train.seq_len)
    if target is None:
        target, tok = load_target(recipe.target, recipe.dtype, recipe.device)
        tokenizer = tokenizer or tok
    target.eval()
    with accelerator.local_main_process_first():  # one process per machine scores and caches, the others read
        rows, n_gen, raw_feats = _training_rows(recipe, rows, target, tokenizer, train_dir)
    _seed(recipe.seed)
    _on_main(accelerator, lambda: set_aside_foreign(train_dir, key))
    ckpts = checkpoints(train_dir)
    resume = ckpts[-1] if ckpts else None
    with accelerator.local_main_process_first():
        dataset = _dataset(method, recipe, target, rows, raw_feats, train_dir, gen_manifest)
    try:
        module = method.build(tc, target, tokenizer, rows, resume or init_from)  # weights only: loop.run restores state
    except RuntimeError as e:  # load_state_dict's missing keys and size mismatches
        if resume is not None or init_from is None:
            raise
        raise WarmStartError(f"the draft {init_from} does not fit this recipe's {tc.method} draft "
                             f"({str(e).splitlines()[-1].strip()[:200]})") from None
    store = _datastore(tc, rows[:n_gen], ckpts if accelerator.is_main_process else [])

    def save(directory: Path, step: int):
        method.save(module, directory, extra, step)
        if store is not None:
            store.save(directory)

    tracker = tracker or NoOpTracker()
    if gkd:  # exactly TRL GKDTrainer's GKD; ours: mix (stored top-k), self_spec (no generate), heads (features)
        if tc.max_minutes:
            print(f"[train] train.max_minutes={tc.max_minutes:g} does not apply to TRL's GKDTrainer: it runs "
                  f"train.steps={tc.steps} (set train.max_minutes=0 to silence this)", file=sys.stderr)
        step, loss, tps = run_gkd(recipe, method, module, rows, target, tokenizer, resume, save, train_dir,
                                  train_dir / LOG_FILE, tracker)
        _on_main(accelerator, lambda: _write_manifest(
            train_dir, recipe, step, [p.name for p in checkpoints(train_dir)], tps, loss,
            method.vocab_size(module, target), step, len(dataset), tracker, trainer="trl.GKDTrainer"))
        return train_dir
    loop = _Loop(recipe, method, module, dataset, accelerator, target, _eos(tokenizer), tracker, train_dir, save,
                 started)
    step = loop.run(resume)
    loop.finish(step, len(dataset), method.vocab_size(module, target))
    return train_dir


class WarmStartError(TrainError):
    """The draft to start from (init_from) has another shape than the recipe's draft (e.g. another draft vocabulary)."""


def warm_start_key(draft: Path) -> str:
    """What a warm start depends on: the starting draft's files (names and bytes of its weights)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(draft).rglob("*") if p.is_file() and p.name != STATE_FILE):
        h.update(f.relative_to(draft).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def make_accelerator(recipe):
    """The train stage's Accelerator: split_batches, so train.batch_size is the global batch (module docstring).
    Refuses what would train wrongly: processes launched but not joined (each would train alone and write the
    same checkpoints), and FSDP/DeepSpeed, whose sharded state the draft checkpoints do not gather yet."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedType

    from .processes import not_joined

    acc = Accelerator(cpu=recipe.device == "cpu", dataloader_config=DataLoaderConfiguration(split_batches=True))
    if why := not_joined(acc):
        raise TrainError(why)
    if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise TrainError(f"train does not run under {acc.distributed_type.value} yet: its checkpoints save the main "
                         f"process's draft and optimizer, which {acc.distributed_type.value} shards; use DDP "
                         f"(configs/accelerate/ddp.yaml; docs/reference/scaling.md)")
    return acc


def _on_main(accelerator, fn):
    """fn() on the main process only (a write to the run directory); every process waits for it."""
    out = fn() if accelerator.is_main_process else None
    accelerator.wait_for_everyone()
    return out


def read_log(train_dir: Path) -> list[dict]:
    """train/log.jsonl: one record per step, {"step", "loss", "lr", metrics...} (the mean over processes)."""
    p = Path(train_dir) / LOG_FILE
    lines = p.read_text().splitlines() if p.exists() else []
    if lines:  # a run killed mid-append leaves a torn last line (a resume rewrites the log without it)
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return [json.loads(line) for line in lines]


def read_plan(train_dir: Path) -> dict | None:
    """train.max_minutes' plan (train/budget.json), None where no budget planned this run."""
    path = train_dir / BUDGET_FILE  # written atomically (write_json_atomic): never half a file
    return json.loads(path.read_text()) if path.exists() else None


def planned_steps(train_dir: Path, tc) -> int:
    """The run's last step: train.steps, or fewer where train.max_minutes planned them."""
    plan = read_plan(train_dir)
    return plan["steps"] if plan else tc.steps


def _finished(train_dir: Path, recipe) -> bool:
    """The manifest says this recipe finished, its last checkpoint exists, and so do its datastores."""
    tc = recipe.train
    done, last = read_manifest(train_dir), planned_steps(train_dir, tc)
    stored = not tc.datastore or all((ck / DATASTORE_FILE).exists() for ck in checkpoints(train_dir))
    return (done.get("recipe_hash") == recipe.hash() and done.get("steps") == last
            and (train_dir / f"checkpoint-{last:06d}").exists() and stored)


def _training_rows(recipe, rows, target, tokenizer, train_dir: Path):
    """The rows the draft trains on -> (rows, how many come first from generated or raw data, the
    features of the scored raw windows appended after them)."""
    tc = recipe.train
    held_path = train_dir.parent / "prompts" / "heldout.jsonl"  # the rows this run is judged on (a split, maybe)
    held = read_jsonl(held_path) if held_path.exists() else None
    text = RawText(recipe.data.source, recipe.data.heldout if held is None else held, tc.seq_len, recipe.seed)
    if tc.data == "raw":  # as many raw windows as there are generated sequences: the same budget
        rows = raw_rows(text, tokenizer, len(rows))
    n_gen, raw_feats = len(rows), []
    if tc.raw_windows:  # the data mix: raw text with the target's own teacher-forced top-k
        windows = lambda: raw_windows(text, tokenizer, tc.raw_windows, "train.raw_windows")  # noqa: E731
        raw, raw_feats = score_raw_windows(target, windows, len(rows[0]["tk_ids"][0]), train_dir / RAW_TEACHER_FILE,
                                           raw_teacher_key(recipe), tc.batch_size)
        rows = rows + raw
    check_vocab(rows, target, tokenizer)
    return rows, n_gen, raw_feats


# The caches' keys: what each cache depends on, read from the recipe here; features.py takes the key alone.

def features_key(recipe, gen_manifest: dict) -> str:
    """What the cached features depend on: the target, dtype, seq_len, data mode and shard checksums."""
    shards = {k: v.get("sha256") for k, v in gen_manifest.get("shards", {}).items()}
    d = {"target": recipe.target, "dtype": recipe.dtype, "seq_len": recipe.train.seq_len, "shards": shards,
         "data": recipe.train.data}
    return stable_hash(d)


def aux_features_key(recipe, gen_manifest: dict, layers) -> str:
    """features_key's inputs, the layers, and the scored raw windows when train.raw_windows adds them
    (the aux cache covers every training row)."""
    raw = raw_teacher_key(recipe) if recipe.train.raw_windows else None
    return stable_hash({"features": features_key(recipe, gen_manifest), "layers": list(layers), "raw": raw})


def raw_teacher_key(recipe) -> str:
    """What the scored raw windows depend on: the target, dtype, seq_len, seed, text source, n and top-k."""
    d = {"target": recipe.target, "dtype": recipe.dtype, "seq_len": recipe.train.seq_len, "seed": recipe.seed,
         "source": recipe.data.source, "heldout": recipe.data.heldout, "n": recipe.train.raw_windows,
         "k": recipe.generate.top_k_logprobs}
    if recipe.data.heldout == "split":  # which rows are held out (and so filtered from the text) depends on these
        d |= {"heldout_fraction": recipe.data.heldout_fraction, "heldout_max": recipe.data.heldout_max}
    return stable_hash(d)



def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _dataset(method: DraftMethod, recipe, target, rows, raw_feats, train_dir: Path, gen_manifest) -> Sequences:
    """The rows, with the target's features for methods that train on them (EAGLE Step 2: cached once):
    the final-norm ones, or the residual streams entering the layers the method asks to cache (eagle3)
    for every row, scored raw windows included."""
    layers = method.feature_cache(recipe.train, target, sum(len(r["ids"]) for r in rows))
    if layers is not None:
        feats = cache_features(target, rows, train_dir / aux_features_file(layers),
                               aux_features_key(recipe, gen_manifest, layers), recipe.train.batch_size, layers=layers)
        return Sequences(rows, feats)
    if not method.needs_features:
        return Sequences(rows)
    n_gen = len(rows) - len(raw_feats)
    gen = recipe.train.data == "generated"
    feats = generated_features(train_dir.parent / "generate", rows[:n_gen]) if gen else None
    if feats is None:  # the shards do not hold them: one teacher-forced target pass, cached
        feats = cache_features(target, rows[:n_gen], train_dir / FEATURES_FILE, features_key(recipe, gen_manifest),
                               batch_size=recipe.train.batch_size)
    return Sequences(rows, feats + list(raw_feats))


def _datastore(tc, rows, ckpts: list[Path]) -> Datastore | None:
    """The completions the draft learns from, as a datastore served next to it (eval/datastore.py): the
    target's own outputs on the training prompts (the raw text for data=raw), never held-out ones, and
    not the raw_windows mix (the text's tokens, not the target's outputs). Checkpoints written before
    the datastore was on get it now."""
    if not tc.datastore:
        return None
    store = Datastore([r["ids"][r["P"]:] for r in rows])
    for ck in ckpts:
        if not (ck / DATASTORE_FILE).exists():
            store.save(ck)
    return store


def _eos(tokenizer) -> set[int]:
    return {int(tokenizer.eos_token_id)} if tokenizer is not None and tokenizer.eos_token_id is not None else set()


class _Loop:
    """The optimizer, schedule and data order around the method's module: steps until train.steps (or the
    fewer that train.max_minutes plans), checkpoints every train.save_every, and the train manifest at the end."""

    def __init__(self, recipe, method: DraftMethod, module, dataset, accelerator, target, eos: set[int],
                 tracker, train_dir: Path, save, started: float):
        tc = self.tc = recipe.train
        self.recipe, self.method, self.module, self.accelerator = recipe, method, module, accelerator
        self.device, self.world = accelerator.device, accelerator.num_processes
        self.target, self.eos, self.tracker, self.train_dir, self.save = target, eos, tracker, train_dir, save
        self.started, self.steps = started, planned_steps(train_dir, tc)  # the last step: a recorded plan stands
        self.params = method.trainable_parameters(module)
        self.optimizer = torch.optim.AdamW(self.params, lr=tc.lr, weight_decay=tc.weight_decay)
        # transformers' cosine schedule with warm-up, over self.steps read at each step, so a budget's plan
        # (made within the warm-up) anneals to its own last step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: cosine_lr(s, tc.warmup_steps,
                                                                                              self.steps))
        self.sampler = EpochSampler(len(dataset), recipe.seed)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=tc.batch_size, sampler=self.sampler,
                                                  collate_fn=collate, drop_last=len(dataset) >= tc.batch_size)
        self.tokens, self.seconds, self.n_onpolicy = 0, 0.0, 0
        self.last_loss = read_manifest(train_dir).get("final_loss")
        self.records: list[dict] = []  # log.jsonl lines since the last checkpoint
        self.names = [p.name for p in checkpoints(train_dir)]

    def run(self, resume: Path | None) -> int:
        """Restore `resume`'s state, prepare with accelerate and step to train.steps; -> the last step."""
        from tqdm.auto import tqdm

        tc = self.tc
        step = restore(resume, self.optimizer, self.scheduler) if resume is not None else 0
        if self.accelerator.is_main_process:
            self.cut_log(step)
        # bf16 autocast on CPU too, master weights in fp32 (docs/reference/training.md), except on a CPU without
        # oneDNN's bf16 matmul, where fp32 is ~20x faster (eval.cpu.bf16_matmul_fast). torch.autocast rather than
        # Accelerator(mixed_precision=...): `distill` runs every stage in one process, and accelerate's state,
        # once made by the generate stage, cannot change.
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                       enabled=self.recipe.dtype == "bfloat16" and bf16_matmul_fast(self.device))
        self.wrapped, self.optimizer, self.loader, self.scheduler = self.accelerator.prepare(
            self.module, self.optimizer, self.loader, self.scheduler)
        self.module = self.accelerator.unwrap_model(self.wrapped)
        self.wrapped.train()
        bar = tqdm(total=self.steps, initial=step, desc=f"train {tc.method}",
                   disable=not self.accelerator.is_main_process)
        first, timed = step, None  # timed: when this call's first step ended (the first runs slow)
        # read once, before any process can write the plan: every process then makes the same choice (plan gathers)
        to_plan = bool(tc.max_minutes) and read_plan(self.train_dir) is None
        while step < self.steps:
            epoch, skip = divmod(step, len(self.loader))
            self.sampler.use_epoch(epoch)
            for batch in self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader:
                loss, metrics = self.step(batch, step)
                step += 1
                self.log(step, loss, metrics, bar)
                timed = timed or time.monotonic()
                if to_plan and step - first == BUDGET_PROBE_STEPS:
                    self.plan(step, (time.monotonic() - timed) / (BUDGET_PROBE_STEPS - 1), bar)
                if step % tc.save_every == 0 or step == self.steps:
                    self.checkpoint(step)
                if step >= self.steps:
                    break
        bar.close()
        return step

    def plan(self, step: int, per_step: float, bar) -> None:
        """train.max_minutes: the last step that the measured step time fits in the budget (at most
        train.steps), agreed by every process (the slowest one's), recorded in train/budget.json."""
        tc = self.tc
        left = 60 * tc.max_minutes - (time.monotonic() - self.started)
        fit = torch.tensor([step + max(int(left / per_step), 1)], device=self.device)
        self.steps = min(tc.steps, int(self.accelerator.gather(fit).min()))  # one plan for all processes
        if self.accelerator.is_main_process:
            write_json_atomic(self.train_dir / BUDGET_FILE, {
                "steps": self.steps, "train_steps": tc.steps, "max_minutes": tc.max_minutes,
                "seconds_per_step": round(per_step, 4), "planned_at": step})
            if self.steps < tc.steps:
                print(f"[train] train.max_minutes={tc.max_minutes:g}: {per_step:.2f} s a step here, so {self.steps} of "
                      f"{tc.steps} steps (the schedule anneals to step {self.steps})", file=sys.stderr)
        bar.total = self.steps
        bar.refresh()

    def step(self, batch: dict, step: int) -> tuple[float, dict]:
        """One optimizer step on `batch`, or on the draft's own samples when this is an on-policy step."""
        t0 = time.perf_counter()
        self.on_policy = is_onpolicy_step(self.tc.data, self.tc.onpolicy_fraction, self.recipe.seed, step)
        if self.on_policy:  # data=mix, or self_spec: our GKD step, not TRL's GKDTrainer (why: onpolicy.py)
            with self.autocast:
                batch = onpolicy_batch(batch, self.method, self.module, self.target, self.eos,
                                       step_seed(self.recipe.seed, step))
            batch = {k: v.to(self.device) for k, v in batch.items()}
            self.n_onpolicy += 1
        with self.autocast:
            loss, metrics = self.method.loss(self.wrapped, batch)
        self.accelerator.backward(loss)
        self.accelerator.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.seconds += time.perf_counter() - t0
        self.tokens += int(batch["valid"].sum())
        self.last_loss = float(loss.detach())
        return self.last_loss, metrics

    def log(self, step: int, loss: float, metrics: dict, bar) -> None:
        if self.world > 1:
            loss, metrics = self.mean_over_processes(loss, metrics)
            self.last_loss = loss
        if not self.accelerator.is_main_process:
            return
        lr = self.scheduler.get_last_lr()[0]
        self.records.append({"step": step, "loss": loss, "lr": lr, **metrics})
        self.tracker.log({"train/loss": loss, "train/lr": lr, "train/on_policy": float(self.on_policy),
                          **{f"train/{k}": v for k, v in metrics.items()}}, step=step)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{metrics.get('acc_0', 0):.2f}")

    def mean_over_processes(self, loss: float, metrics: dict) -> tuple[float, dict]:
        """The step's loss and metrics averaged over the processes (one all-reduce): the global batch's."""
        names = [k for k, v in metrics.items() if isinstance(v, (int, float))]
        vals = torch.tensor([loss] + [float(metrics[k]) for k in names], dtype=torch.float64, device=self.device)
        vals = self.accelerator.reduce(vals, "mean").tolist()
        return vals[0], {**metrics, **dict(zip(names, vals[1:]))}

    def cut_log(self, step: int) -> None:
        """A resumed run's log keeps the steps up to its checkpoint (a fresh run's starts empty)."""
        kept = [r for r in read_log(self.train_dir) if r["step"] <= step]
        tmp = self.train_dir / f".tmp-{LOG_FILE}"  # aside and renamed: a kill mid-write loses no line
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.train_dir / LOG_FILE)
        if kept:  # a run killed before its manifest: the final loss is the last checkpoint's
            self.last_loss = kept[-1]["loss"]

    def checkpoint(self, step: int) -> None:
        if self.accelerator.is_main_process:
            # the log first: a run killed before the checkpoint's rename resumes earlier and cuts these lines
            # (after it, they would be lost: a resume keeps the lines up to its checkpoint)
            with open(self.train_dir / LOG_FILE, "a") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in self.records)
            self.records = []
            p = write_checkpoint(self.train_dir, step, lambda d: self.save(d, step),
                                 lambda: trainer_state(self.optimizer, self.scheduler, step))
            self.names = sorted(set(self.names) | {p.name})
            kill_point("train.after_rename")
        self.accelerator.wait_for_everyone()

    def finish(self, step: int, n_sequences: int, draft_vocab_size: int) -> None:
        """The train manifest (what evaluate and compare read) and the run's training throughput."""
        if self.world > 1:  # every process's tokens over the main process's time
            self.tokens = int(self.accelerator.reduce(torch.tensor(self.tokens, device=self.device), "sum"))
        tps = self.tokens / self.seconds if self.seconds > 0 else None
        if self.accelerator.is_main_process:
            plan = read_plan(self.train_dir)
            more = {"budget": plan} if plan else {}
            _write_manifest(self.train_dir, self.recipe, step, self.names, tps, self.last_loss, draft_vocab_size,
                            self.n_onpolicy, n_sequences, self.tracker, **more)


def cosine_lr(step: int, warmup: int, total: int) -> float:
    """The LR factor of transformers' get_cosine_schedule_with_warmup (linear warm-up to 1 over min(warmup,
    total) steps, then a half cosine to 0 at `total`), with `total` free to change between steps."""
    warmup = min(warmup, total)
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def _write_manifest(train_dir: Path, recipe, step: int, names: list[str], tps: float | None, final_loss,
                    draft_vocab_size: int, onpolicy_steps: int, n_sequences: int, tracker, **more) -> None:
    """The train manifest (what evaluate and compare read) and the run's training throughput (a run that
    trained nothing now keeps its earlier figure)."""
    tc = recipe.train
    kill_point("train.before_manifest")
    if tps is None:
        tps = read_manifest(train_dir).get("tokens_per_s")
    write_json_atomic(train_dir / "manifest.json", {
        "method": tc.method, "divergence": tc.divergence, "data": tc.data, "checkpoints": names,
        "tokens_per_s": tps, "final_loss": final_loss, "draft_vocab_size": int(draft_vocab_size),
        "onpolicy_steps": onpolicy_steps, "steps": step, "recipe_hash": recipe.hash(), "n_sequences": n_sequences,
        **more})
    tracker.log({"train/tokens_per_s": tps or 0.0}, step=step)


def _untrained_checkpoint(train_dir: Path, recipe, method: DraftMethod, extra: dict) -> Path:
    """A method with nothing to train (int8): one checkpoint that only names the kind."""
    final = train_dir / "checkpoint-000000"
    if not (final / STATE_FILE).exists():
        write_checkpoint(train_dir, 0, lambda d: method.save(None, d, extra, 0))
    if read_manifest(train_dir).get("recipe_hash") == recipe.hash():
        return train_dir
    write_json_atomic(train_dir / "manifest.json", {
        "method": method.name, "divergence": None, "checkpoints": [final.name], "tokens_per_s": None,
        "final_loss": None, "draft_vocab_size": None, "steps": 0, "recipe_hash": recipe.hash(), "n_sequences": 0})
    return train_dir


def main(argv=None) -> int:
    from .config import RecipeError, load_recipe
    from .processes import leave_process_group
    from .tracking import make_tracker

    ap = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", required=True, help="recipe YAML")
    ap.add_argument("--run-dir", required=True, help="run directory holding generate/ (train/ is written there)")
    ap.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    args = ap.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        accelerator = make_accelerator(recipe)
        tracker = make_tracker(recipe, Path(args.run_dir), "train") if accelerator.is_main_process else NoOpTracker()
        try:
            out = run_train(recipe, args.run_dir, tracker=tracker, accelerator=accelerator)
        finally:
            tracker.finish()
    except (RecipeError, TrainError) as e:
        print(f"draftsmith train: {e}", file=sys.stderr)
        return 2
    if accelerator.is_main_process:
        print(f"[train] {out} complete ({accelerator.num_processes} process(es))")
    leave_process_group(accelerator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
