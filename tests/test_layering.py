"""eval/ stays below pipeline/: it never imports pipeline, datasets, trl or wandb (docs/DESIGN.md)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"pipeline", "datasets", "trl", "wandb"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    mods = set()
    for node in ast.walk(tree):  # module level and inside functions alike
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level >= 2:
            mods.add("<relative import above eval>")
    return mods


def test_eval_modules_do_not_import_upper_layers():
    files = sorted((ROOT / "eval").glob("*.py"))
    assert any(f.name == "decoder.py" for f in files)
    bad = {f.name: sorted(_imports(f) & (FORBIDDEN | {"<relative import above eval>"})) for f in files}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_decoder_imports_with_upper_layers_blocked():
    script = (
        "import sys\n"
        "for m in ('pipeline', 'datasets', 'trl', 'wandb'):\n"
        "    sys.modules[m] = None  # any import of these raises ImportError\n"
        "import eval.decoder, eval.proposers, eval.exactness, eval.target, eval.heads, eval.replay\n"
        "from eval.decoder import SpeculativeDecoder, GenerationResult\n"
        "from eval.proposers import load_proposer, NgramProposer, DraftLMProposer, EagleProposer, Proposer\n"
        "from eval.exactness import compare_greedy\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
