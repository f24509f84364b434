"""Leaving an accelerate process group cleanly, for the stages that run under `accelerate launch`."""

from __future__ import annotations

import gc

import torch


def leave_process_group(accelerator) -> None:
    """Every process waits for the others, drops what holds the group (the DDP-wrapped model keeps its process
    group and reducer alive through accelerator._models) and destroys the group while the interpreter still runs.
    A gloo group left to interpreter shutdown is torn down with its worker threads still live, which aborts
    the process now and then (SIGABRT, "terminate called without an active exception") after its work is done;
    see https://github.com/pytorch/pytorch/issues/190489."""
    accelerator.wait_for_everyone()
    accelerator.end_training()
    accelerator.free_memory()  # releases the prepared models, optimizers and schedulers
    gc.collect()  # the trainer's reference cycles may still hold the wrapped model
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
