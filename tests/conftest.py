"""Shared fixtures: the embedded target's tokenizer (converted once, cached) and the gpu marker."""

import os

import pytest
import torch

# Tests never reach a hub, and never upload to W&B.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
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
