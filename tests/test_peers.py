"""pipeline/engines/llamacpp_bench.py: llama.cpp, the CPU user's engine, beside ours (make bench-peers). The
real run needs llama-cpp-python built from source (not in CI); here: its bad inputs, each one clear line."""

import subprocess
import sys

import pytest

from pipeline import llamacpp_bench


def test_a_missing_llama_cpp_venv_names_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setenv(llamacpp_bench.PEERS_PYTHON, str(tmp_path / "nope" / "python"))
    with pytest.raises(llamacpp_bench.PeerError, match="make bench-peers"):
        llamacpp_bench.peers_python()


def test_an_unknown_method_is_refused_before_anything_loads(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pipeline.llamacpp_bench", "--gguf", "x.gguf", "--prompts",
                        "p.jsonl", "--method", "suffix"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--method suffix: use plain or lookup:K" in p.stderr


def test_the_worker_imports_nothing_of_draftsmith():
    src = llamacpp_bench.WORKER.read_text()
    assert "import pipeline" not in src and "from pipeline" not in src and "from eval" not in src
