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
    pin = [i for i, line in enumerate(lines) if re.search(r"pip install -q torch==2\.13\.0$", line)]
    pkg = [i for i, line in enumerate(lines) if re.search(r"pip install -q -e '\.\[test\]'$", line)]
    assert pin and pkg and pin[0] < pkg[0], "make setup must install torch==2.13.0 before the package"
