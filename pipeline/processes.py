"""The stage commands under `accelerate launch`: every launched process joined, and the group left cleanly."""

from __future__ import annotations

import gc
import os

import torch


def not_joined(accelerator) -> str:
    """"" when accelerate joined every process the launcher started, else one line saying so and how to launch:
    processes launched but not joined each run the whole stage alone and write the same files."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes == launched:
        return ""
    return (f"{launched} processes were launched but accelerate joined {accelerator.num_processes} "
            f"({accelerator.distributed_type.value}); on CPU launch with `ACCELERATE_USE_CPU=1 accelerate launch "
            f"--multi_gpu --num_processes {launched} ...` (FSDP and DeepSpeed configs need CUDA)")


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
