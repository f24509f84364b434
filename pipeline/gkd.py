"""Stage 2 for train.method=draft_lm with train.data=onpolicy: GKD (Agarwal et al., 2024, "On-Policy Distillation
of Language Models") through TRL's GKDTrainer (trl.experimental.gkd): every batch, the draft samples continuations
of the training prompts (lmbda = 1) and the target scores them with its full-vocabulary logits.

Ours around it: the prompts (the generate stage's rows: prompt = ids[:P]; the target's stored completion is the
off-policy input that lmbda = 1 always replaces), the optimizer and schedule (AdamW, linear warm-up then cosine,
as in train.py's loop, so that a checkpoint's trainer_state.pt restores them), and the checkpoints: at every
train.save_every and at the end the draft_lm method's `save` writes train/checkpoint-NNNNNN as a draft directory
(pipeline/checkpoints.py), not an HF Trainer checkpoint, so evaluate loads it unchanged; train/log.jsonl and the
train manifest are written as the loop writes them.

Resume: a finished run is not retrained (train.run_train returns first); otherwise the newest checkpoint of the
same train key restores the draft's weights, the optimizer, the schedule and the step, and the remaining steps
run. The prompt order and the draft's samples after a resume are drawn afresh (seeded by seed + step), so a
resumed run is not bit-identical to an unbroken one (train.py's loop's is).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from eval.cpu import bf16_matmul_fast

from .checkpoints import restore, trainer_state, write_checkpoint
from .shards import read_manifest
from .train_data import TrainError

__all__ = ["gkd_beta", "run_gkd", "uses_gkd"]

GKD_BETA = {"fkl": 0.0, "rkl": 1.0}  # GKD's generalized JSD at beta 0 is KL(target||draft), at 1 KL(draft||target)


def uses_gkd(tc) -> bool:
    """The setting TRL's GKDTrainer computes exactly: a draft LM trained on its own samples at every step
    (refused here when the recipe asks for what it cannot do)."""
    if not (tc.method == "draft_lm" and tc.data == "onpolicy"):
        return False
    gkd_beta(tc)
    if tc.raw_windows:
        raise TrainError(f"train.raw_windows={tc.raw_windows} adds target-scored raw text whose stored top-k TRL's "
                         f"GKDTrainer never reads (train.method=draft_lm, train.data=onpolicy); set raw_windows=0")
    return True


def gkd_beta(tc) -> float:
    """train.divergence as GKDTrainer's beta (its generalized JSD mixes M = beta * target + (1 - beta) * draft,
    as losses.jsd does); a divergence it cannot express is refused."""
    if tc.divergence == "jsd":
        return tc.jsd_beta
    if tc.divergence not in GKD_BETA:
        raise TrainError(f"train.divergence={tc.divergence!r} is not a generalized JSD, the only loss TRL's GKDTrainer "
                         f"has (train.method=draft_lm, train.data=onpolicy); use fkl, rkl or jsd, or keep "
                         f"{tc.divergence} on our loop with train.data=mix train.onpolicy_fraction=1")
    return GKD_BETA[tc.divergence]


def run_gkd(recipe, method, module, rows: list[dict], target, tokenizer, resume: Path | None, save,
            train_dir: Path, log_file: Path, tracker) -> tuple[int, float | None, float | None]:
    """Train the draft_lm `module` (built from `resume` when given) with GKDTrainer on the rows' prompts, each
    checkpoint written by `save(directory, step)` (module docstring) -> (last step, final loss, tokens/s)."""
    from accelerate import PartialState
    from datasets import Dataset

    tc, main = recipe.train, PartialState().is_main_process
    optimizer, scheduler = _optimizer(tc, method.trainable_parameters(module))
    step = restore(resume, optimizer, scheduler) if resume is not None else 0
    if main:
        _cut_log(log_file, step)
    progress = _Progress(recipe, optimizer, scheduler, train_dir, log_file, step, save, tracker, main)
    if step >= tc.steps:  # the last checkpoint was written but not the manifest
        return step, progress.loss, read_manifest(train_dir).get("tokens_per_s")
    prompts = Dataset.from_list([{"prompt_ids": r["ids"][:r["P"]], "completion_ids": r["ids"][r["P"]:]}
                                 for r in rows])
    trainer = _trainer(recipe, module.model, target, tokenizer, prompts, (optimizer, scheduler), step,
                       max(len(r["ids"]) - r["P"] for r in rows), PartialState().num_processes, progress)
    seconds = trainer.train().metrics["train_runtime"]
    acc = trainer.accelerator
    tokens = int(acc.reduce(torch.tensor(trainer.tokens, device=acc.device), "sum"))  # every process's
    return tc.steps, progress.loss, tokens / seconds if seconds > 0 else None


def _optimizer(tc, params):
    """train.py's loop's optimizer and schedule, handed to GKDTrainer so that our checkpoints restore them."""
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    return optimizer, get_cosine_schedule_with_warmup(optimizer, min(tc.warmup_steps, tc.steps), tc.steps)


def _trainer(recipe, student, target, tokenizer, prompts, optimizers, start: int, max_new: int, world: int,
             progress):
    """GKDTrainer over the prompts for the steps after `start`: fully on-policy at temperature 1 (as the draft
    samples in train.py's loop), as many new tokens as the longest stored completion, HF checkpoints, logging
    and progress bar off (ours: `progress`)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    GKDConfig, GKDTrainer = _trl_gkd()

    tc, pad = recipe.train, _pad_id(tokenizer, target)  # run_train checked that world divides train.batch_size
    args = GKDConfig(
        output_dir=str(Path(progress.train_dir)), max_steps=tc.steps - start, seed=recipe.seed + start,
        per_device_train_batch_size=tc.batch_size // world, gradient_accumulation_steps=1, max_grad_norm=1.0,
        learning_rate=tc.lr, bf16=False, fp16=False, use_cpu=recipe.device == "cpu",
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_drop_last=len(prompts) >= tc.batch_size, max_length=tc.seq_len,
        lmbda=1.0, beta=gkd_beta(tc), temperature=1.0, max_new_tokens=max_new, seq_kd=False)
    trainer = GKDTrainer(model=student, teacher_model=target, args=args, train_dataset=prompts,
                         processing_class=tokenizer if tokenizer is not None else _id_tokenizer(target, pad),
                         data_collator=_Collator(pad), optimizers=optimizers, callbacks=[_callback(progress)])
    trainer.bf16_autocast = recipe.dtype == "bfloat16" and bf16_matmul_fast(trainer.accelerator.device)  # as train.py
    for cb in (PrinterCallback, ProgressCallback):  # they print every step's log; our bar and tracker report it
        trainer.remove_callback(cb)
    return trainer


@functools.cache
def _trl_gkd():
    """(GKDConfig, GKDTrainer counting the tokens it trains on (the manifest's tokens_per_s), under our bf16
    autocast, sending no telemetry); imported when used: trl takes seconds to import."""
    import warnings

    with warnings.catch_warnings():  # trl.experimental warns that its APIs may change: tests/test_gkd.py runs this one
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDConfig, GKDTrainer

    class CountingGKDTrainer(GKDTrainer):
        tokens, bf16_autocast = 0, False

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.tokens += int(inputs["attention_mask"].sum())
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def autocast_smart_context_manager(self, cache_enabled=True):
            # bf16 autocast as train.py's loop does, not GKDConfig(bf16=True): that remakes accelerate's state,
            # which cannot change once `distill`'s generate stage or run_train made it
            return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast)

        def _send_telemetry(self):  # a draftsmith run sends nothing to the Hub on its owner's behalf
            pass

    return GKDConfig, CountingGKDTrainer


def _callback(progress):
    """`progress` as the TrainerCallback GKDTrainer calls (its on_log and on_train_end)."""
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        on_log = staticmethod(progress.on_log)
        on_train_end = staticmethod(progress.on_train_end)

    return Callback()


def _pad_id(tokenizer, target) -> int:
    """The id that pads prompts and batches: the tokenizer's pad, else its EOS, else the target config's, else 0."""
    for t in (tokenizer.pad_token_id if tokenizer is not None else None,
              tokenizer.eos_token_id if tokenizer is not None else None, target.config.pad_token_id):
        if t is not None:
            return int(t)
    return 0


def _id_tokenizer(target, pad: int):
    """A tokenizer over the target's ids, for a caller that passes none (GKDTrainer reads only its pad id)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(target.config.vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=str(pad))),
                                   pad_token=str(pad))


class _Collator:
    """Our rows are token ids, so not DataCollatorForChatML (it applies a chat template to text): the same keys,
    left-padded as generate needs. input_ids/labels hold the target's completion, which lmbda = 1 replaces."""

    def __init__(self, pad: int):
        self.pad = pad

    def __call__(self, examples: list[dict]) -> dict:
        prompts = [e["prompt_ids"] for e in examples]
        full = [e["prompt_ids"] + e["completion_ids"] for e in examples]
        labels = [[-100] * len(e["prompt_ids"]) + e["completion_ids"] for e in examples]
        ids, am = self.left_padded(full, self.pad)  # [B, L] each
        p_ids, p_am = self.left_padded(prompts, self.pad)  # [B, P] each
        return {"input_ids": ids, "attention_mask": am, "labels": self.left_padded(labels, -100)[0],
                "prompts": p_ids, "prompt_attention_mask": p_am}

    @staticmethod
    def left_padded(seqs: list[list[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), value, dtype=torch.long)
        am = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, L - len(s):], am[b, L - len(s):] = torch.tensor(s, dtype=torch.long), 1
        return ids, am


def _cut_log(log_file: Path, step: int) -> None:
    """A resumed run's log keeps the steps up to its checkpoint (a fresh run's starts empty), as the loop's."""
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    log_file.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))


class _Progress:
    """Our side of each GKDTrainer step: the bar, the tracker, log.jsonl, and a draft directory at every
    train.save_every and at the end (with trainer_state.pt: our optimizer, schedule and step)."""

    def __init__(self, recipe, optimizer, scheduler, train_dir: Path, log_file: Path, start: int, save, tracker,
                 main: bool):
        from tqdm.auto import tqdm

        self.recipe, self.optimizer, self.scheduler, self.train_dir, self.log_file = (recipe, optimizer, scheduler,
                                                                                       train_dir, log_file)
        self.start, self.save, self.tracker, self.main = start, save, tracker, main
        self.loss = read_manifest(train_dir).get("final_loss")
        self.records: list[dict] = []  # log.jsonl lines since the last checkpoint
        self.bar = tqdm(total=recipe.train.steps, initial=start, desc="train draft_lm (trl GKD)", disable=not main)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # the end-of-training summary
            return
        tc, step = self.recipe.train, self.start + state.global_step
        self.loss, lr = float(logs["loss"]), float(logs["learning_rate"])
        if not self.main:
            return
        self.records.append({"step": step, "loss": self.loss, "lr": lr})
        self.tracker.log({"train/loss": self.loss, "train/lr": lr, "train/on_policy": 1.0}, step=step)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{self.loss:.3f}")
        if step % tc.save_every == 0 or step == tc.steps:
            self.checkpoint(step)

    def checkpoint(self, step: int) -> None:
        write_checkpoint(self.train_dir, step, lambda d: self.save(d, step),
                         lambda: trainer_state(self.optimizer, self.scheduler, step))
        with open(self.log_file, "a") as fh:  # written with the checkpoint: a resume repeats the rest
            fh.writelines(json.dumps(r) + "\n" for r in self.records)
        self.records = []

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()
