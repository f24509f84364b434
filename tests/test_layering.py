"""The architecture rules of docs/DESIGN.md, read from the sources' imports:
- eval/ stays below pipeline/: it never imports pipeline, datasets, trl, wandb or vllm;
- draft methods (pipeline/methods/) do not import each other, only their shared base;
- there is no import cycle anywhere in pipeline/ or eval/ (imports inside functions count too)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"pipeline", "datasets", "trl", "wandb", "vllm"}
PACKAGES = ("eval", "pipeline")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imported(path: Path, known: set[str]) -> set[str]:
    """Every module `path` imports (absolute names; `from X import Y` counts X.Y when Y is a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):  # module level and inside functions
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                keep = len(parts) - (node.level - 1)
                if keep < 1:
                    out.add("<relative import above the package>")
                    continue
                mod = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: {i for i in _imported(p, known) if i in known and i != m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_eval_modules_do_not_import_upper_layers():
    mods = {m: p for m, p in _modules().items() if m.split(".")[0] == "eval"}
    assert "eval.decoder" in mods and len(mods) > 10
    known = set(_modules())
    bad = {m: sorted(i for i in _imported(p, known)
                     if i.split(".")[0] in FORBIDDEN or i.startswith("<relative"))
           for m, p in mods.items()}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_no_import_cycles_in_pipeline_or_eval():
    graph = _graph()
    assert len(graph) > 20 and any(graph.values())
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_draft_methods_do_not_import_each_other():
    from pipeline.methods import METHODS

    graph = _graph()
    methods = {f"pipeline.methods.{name}" for name in METHODS}
    assert methods <= set(graph), sorted(methods - set(graph))
    crossing = {m: sorted(graph[m] & (methods - {m})) for m in methods}
    assert not {k: v for k, v in crossing.items() if v}, crossing


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


def test_only_the_engine_worker_imports_vllm():
    """vLLM lives in its own venv (pins an older transformers): draftsmith drives it through
    pipeline/engines/vllm_worker.py as a subprocess, and nothing else may import it."""
    known = set(_modules())
    users = sorted(m for m, p in _modules().items() if any(i.split(".")[0] == "vllm" for i in _imported(p, known)))
    assert users == ["pipeline.engines.vllm_worker"], users
