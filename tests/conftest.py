"""Shared fixtures: the embedded target's tokenizer (converted once, cached), the gpu marker, and each CPU
kernel path this machine runs (`kernel_path`)."""

import os

import pytest
import torch

# Tests never reach a hub, and never upload to W&B.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")

# Under pytest-xdist (`make test` runs one worker a core) each worker, and the processes its tests start,
# gets its share of the cores, not all of them: more threads than cores only take turns.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


_WARMUPS = []  # the controller's background processes (pytest_configure)


def pytest_configure(config):
    """Under xdist the controller converts the embedded target (its tokenizer is most modules' first fixture)
    and builds this CPU path's kernels (eval/kernels.py) while the workers import and collect: on a fresh
    machine each worker's first test otherwise waits on them, or repeats the conversion (docs/reference/cold-start.md)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for code in ("from eval.loading import convert_embedded; convert_embedded()", "from eval import cpu; cpu.cpu_path()"):
        _WARMUPS.append(subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL))


def pytest_unconfigure(config):
    for proc in _WARMUPS:  # never left half-done behind the run (a kernel build's lock would stay)
        proc.wait()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not item.keywords: keywords also hold every directory name on the path (a checkout in gpu/)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: handing matmuls of a few hundred numbers to a second thread costs more than the
    work (the decoder tests ran 13x slower with 2 threads on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2-135M-Instruct as a bf16 HF checkpoint directory (converted on first use)."""
    from pipeline.models import convert_embedded

    return convert_embedded()


@pytest.fixture(scope="session")
def real_tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, real_tokenizer):
    """A 2-layer Llama with the real tokenizer's vocabulary, saved as an HF checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = real_tokenizer
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id)
    d = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def trained(target):
    """Independent Medusa heads trained on the module's `target`'s greedy continuations, so that their
    drafts are accepted: (heads, metrics before, metrics after, items)."""
    from helpers import train_medusa_heads

    return train_medusa_heads(target, recurrent=False)


@pytest.fixture(scope="module")
def trained_rec(target):
    """Recurrent Medusa heads trained like `trained`."""
    from helpers import train_medusa_heads

    return train_medusa_heads(target, recurrent=True)


KERNEL_PATHS = ("amx-bf16", "avx512-bf16", "avx2")  # eval/cpu.py's paths with kernels; generic is PyTorch's own ops
EXERCISED: set[str] = set()  # the CPU paths this session ran tests on, printed at the end


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request, monkeypatch):
    """Each kernel path this CPU runs, in turn, as this process's path (eval.cpu.cpu_path), so one machine
    tests both: AVX2 code runs on AVX-512 CPUs too. Skipped only where this CPU cannot execute the path, or
    where DRAFTSMITH_CPU_PATH makes this session a CPU without it (a forced path hides what is above it)."""
    import os

    from eval import cpu

    name = request.param
    flags = cpu.cpu_info()[1]
    if os.environ.get(cpu.ENV_PATH):
        flags = cpu._capped(flags, cpu.cpu_path().name)
    if not cpu.runs(name, flags):
        pytest.skip(f"this CPU cannot run the {name} path: it lacks "
                    f"{' '.join(cpu.missing(name, flags))}")
    if name == "amx-bf16" and cpu._kernels(name) is None:
        pytest.skip("the OS does not grant this process AMX (Linux 5.16 or later does)")
    path = cpu.decide({cpu.ENV_PATH: name})
    monkeypatch.setattr(cpu, "cpu_path", lambda: path)
    EXERCISED.add(name)
    return path


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand its paths to the controller
        session.config.workeroutput["cpu_paths_exercised"] = sorted(EXERCISED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    EXERCISED.update(getattr(node, "workeroutput", {}).get("cpu_paths_exercised", ()))


def pytest_terminal_summary(terminalreporter):
    from eval import cpu

    p = cpu.cpu_path()
    EXERCISED.add(p.name)
    terminalreporter.write_line(f"{p.line()}; paths exercised: {', '.join(sorted(EXERCISED))}")
