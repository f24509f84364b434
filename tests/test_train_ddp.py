"""`accelerate launch --num_processes 2 -m pipeline.train` (DDP over gloo, two CPU processes) against one
process: the same loss curve and weights, checkpoints and logs written once by the main process, and a
checkpoint of one process resumed by two."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.config import load_recipe
from pipeline.train import LOG_FILE, read_log, run_train

from helpers import free_port, launch_env, make_generate, tiny_llama, train_recipe, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
# float32 sums taken in another order (two shards, then gloo's mean) drift by ~1e-7 relative over these
# steps (measured <= 1.3e-7 for medusa, eagle and draft_lm); 1e-5 is that with margin, far below a real
# difference (a shard dropped or counted twice changes the loss by percents).
RTOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


def launch(recipe: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """`python -m pipeline.train` under accelerate with two CPU processes, from the shipped DDP config.
    accelerate 1.15: `--cpu` always takes the single-process launcher; a MULTI_GPU config goes through
    torchrun, and ACCELERATE_USE_CPU=1 makes each process a CPU (gloo) worker."""
    env = launch_env(ROOT)
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
           str(ROOT / "configs/accelerate/ddp.yaml"), "--num_processes", "2", "--main_process_port", str(free_port()),
           "-m", "pipeline.train", "--recipe", str(recipe), "--run-dir", str(run_dir)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama target saved with a tokenizer, its generate stage (16 rows of equal length) and a medusa
    recipe (the default method) with global batch 4: two processes take 2 rows each."""
    root = tmp_path_factory.mktemp("ddp")
    target = tiny_llama()
    target.save_pretrained(root / "target")
    word_tokenizer().save_pretrained(root / "target")
    make_generate(root / "gen", target, n_rows=16, clen=24, target_name=str(root / "target"))
    d = train_recipe(method="medusa", steps=STEPS, save_every=2, batch_size=4, datastore=False).to_dict()
    d["target"], d["wandb"]["mode"] = str(root / "target"), "disabled"
    (root / "recipe.yaml").write_text(yaml.safe_dump(d))
    return root, target


def weights(run: Path, step: int) -> dict:
    return load_file(str(run / f"train/checkpoint-{step:06d}/head.safetensors"))


def test_two_processes_resume_one_and_match_its_curve(setup):
    """A one-process run is cut back to its first checkpoint (step 2, as if it had stopped there) and two
    processes resume it: they restore its optimizer and data position and train steps 3..8. The rows of
    every batch are the same with one and two processes (train.batch_size is the global batch) and every
    row carries as many teacher positions, so the mean of the two processes' losses is the global batch's
    loss: the curves and the final weights agree to RTOL. Only the main process writes: one log line per
    step, each checkpoint once, no leftover temporary directory. (One launch: each costs ~25 s here.)"""
    root, target = setup
    one = root / "one"
    shutil.copytree(root / "gen" / "generate", one / "generate")
    run_train(load_recipe(root / "recipe.yaml"), one, target=target)  # one process, as `draftsmith distill` runs
    two = root / "two"
    shutil.copytree(one, two)
    for step in range(4, STEPS + 1, 2):
        shutil.rmtree(two / "train" / f"checkpoint-{step:06d}")
    (two / "train" / "manifest.json").unlink()
    res = launch(root / "recipe.yaml", two)
    assert "complete (2 process(es))" in res.stdout
    curve_one, curve_two = read_log(one / "train"), read_log(two / "train")
    assert [r["step"] for r in curve_two] == list(range(1, STEPS + 1))
    assert len((two / "train" / LOG_FILE).read_text().splitlines()) == STEPS
    for a, b in zip(curve_one[2:], curve_two[2:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=RTOL), (a["step"], a["loss"], b["loss"])
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12)  # one scheduler step per optimizer step
    assert sorted(p.name for p in (two / "train").iterdir() if p.name.startswith((".", "checkpoint"))) == [
        f"checkpoint-{s:06d}" for s in range(2, STEPS + 1, 2)]
    for k, v in weights(one, STEPS).items():
        torch.testing.assert_close(weights(two, STEPS)[k], v, rtol=RTOL, atol=1e-6)


def test_two_processes_agree_on_a_time_budgets_plan(setup):
    """train.max_minutes under DDP: both processes time their probe steps and gather, so they stop at the same
    planned step (here the budget is spent before the first step: one step past the probe) and neither waits on
    the other; the main process writes the plan, the log and the checkpoints once."""
    from pipeline.train import BUDGET_PROBE_STEPS

    root, _ = setup
    d = yaml.safe_load((root / "recipe.yaml").read_text())
    d["train"] |= {"steps": 14, "save_every": 7, "max_minutes": 1e-6}
    (root / "budget.yaml").write_text(yaml.safe_dump(d))
    run = root / "budget"
    shutil.copytree(root / "gen" / "generate", run / "generate")
    launch(root / "budget.yaml", run)
    last = BUDGET_PROBE_STEPS + 1
    assert yaml.safe_load((run / "train" / "budget.json").read_text())["steps"] == last
    assert [r["step"] for r in read_log(run / "train")] == list(range(1, last + 1))
    assert sorted(p.name for p in (run / "train").iterdir() if p.name.startswith((".", "checkpoint"))) == [
        "checkpoint-000007", f"checkpoint-{last:06d}"]


def test_accelerate_configs_load():
    """The shipped configs (docs/reference/scaling.md) are what accelerate's own loader reads them as."""
    from accelerate.commands.config.config_args import load_config_from_file

    want = {"ddp": ("MULTI_GPU", 1), "multi-node": ("MULTI_GPU", 2), "fsdp": ("FSDP", 1),
            "deepspeed-zero2": ("DEEPSPEED", 1)}
    assert sorted(p.stem for p in (ROOT / "configs/accelerate").glob("*.yaml")) == sorted(want)
    for name, (kind, machines) in want.items():
        c = load_config_from_file(str(ROOT / f"configs/accelerate/{name}.yaml"))
        assert (c.distributed_type.value, c.num_machines) == (kind, machines), name
        assert c.mixed_precision == "no"  # the loop autocasts itself; accelerate's state must not differ
    assert load_config_from_file(str(ROOT / "configs/accelerate/fsdp.yaml")).fsdp_config["fsdp_version"] == 2
    assert load_config_from_file(str(ROOT / "configs/accelerate/deepspeed-zero2.yaml")).deepspeed_config[
        "zero_stage"] == 2


def test_leaving_the_group_frees_the_ddp_model_that_holds_it(tmp_path):
    """leave_process_group drops the prepared DDP model (it holds the gloo group and its reducer) before it
    destroys the group, so nothing of the group is left for interpreter shutdown to tear down under live
    worker threads (the abort CI saw once after a DDP run's last step). One process, a gloo group of one."""
    import gc
    import weakref

    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    from pipeline.processes import leave_process_group

    acc = Accelerator(cpu=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    acc._models.append(ddp)  # what accelerator.prepare keeps under DDP
    alive = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert alive() is not None  # the accelerator still holds it, as after a training run
    leave_process_group(acc)
    assert alive() is None
    assert not dist.is_initialized()
