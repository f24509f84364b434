"""A draft method is one registration: a package of its own (written here into tmp_path, never imported
by draftsmith) registers a toy method, a low-rank bigram draft, with one register_method call whose
method declares its draft kind (files, loader, export formats), and then runs through the pipeline's own
stages, generate -> train -> evaluate, and loads back with load_proposer, with no other file of draftsmith
edited."""

import dataclasses
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eval import draft_dir
from eval.proposers import load_proposer
from pipeline import methods
from pipeline.cli import stage_generate, stage_train
from pipeline.compare import check_choices
from pipeline.config import SECTIONS, help_table, load_recipe
from pipeline.evaluate import run_evaluate
from pipeline.models import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]

# The eval half: the draft and its proposer (eval/ imports only).
EVAL_SIDE = '''
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from eval import draft_dir
from eval.proposers import Proposer
from eval.proposers.base import draw

FILE = "toy.safetensors"


class Bigram(nn.Module):
    """Next-token logits from the current token alone: emb [V, r] then out [r, V]."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, rank), nn.Linear(rank, vocab, bias=False)

    def save(self, directory, meta):
        draft_dir.write_meta(directory, {"kind": "toy", "rank": self.emb.embedding_dim, **meta})
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / FILE))

    @classmethod
    def load(cls, directory):
        sd = load_file(str(directory / FILE))
        m = cls(*sd["emb.weight"].shape)
        m.load_state_dict(sd)
        return m


class BigramProposer(Proposer):
    name = "toy"

    def __init__(self, draft):
        self.draft = draft.eval()

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.cur, self.sampling = first.clone(), sampling

    @torch.no_grad()
    def propose(self, k):
        toks, qs, t = [], [], self.cur
        for _ in range(k):
            t, q = draw(self.draft.out(self.draft.emb(t)), self.sampling)
            toks.append(t)
            qs.append(q)
        return torch.stack(toks, 1), None if self.sampling.greedy else torch.stack(qs, 1)

    def accept(self, tokens, start, n_acc, bonus, features=None):
        self.cur = bonus.clone()


def load(directory, meta, target, dtype):
    return BigramProposer(Bigram.load(directory))
'''

# The pipeline half: the trainer and the kind of draft it saves, registered as a method in one call.
PIPELINE_SIDE = '''
import torch.nn as nn

from eval.draft_dir import DraftKind
from pipeline.methods import register_method
from pipeline.methods.base import DraftMethod, next_token_distillation

from .draft import Bigram, load


class ToyTrainer(nn.Module):
    def __init__(self, draft, tc):
        super().__init__()
        self.draft, self.tc = draft, tc

    def forward(self, batch):
        return next_token_distillation(self.tc, batch, self.draft.emb(batch["ids"]), head=self.draft.out)


class Toy(DraftMethod):
    name = "toy"
    kind = DraftKind("toy", load=load)  # holds toy.safetensors, a low-rank bigram table; no engine format
    help = "a low-rank bigram table"
    variants = {"toy": {}}

    def build(self, tc, target, tokenizer, rows, resume):
        if resume is not None:
            return ToyTrainer(Bigram.load(resume), tc)
        draft = Bigram(target.config.vocab_size, 8)
        nn.init.normal_(draft.emb.weight, std=0.02)
        nn.init.normal_(draft.out.weight, std=0.02)
        return ToyTrainer(draft, tc)

    def trainable_parameters(self, module):
        return list(module.draft.parameters())

    def vocab_size(self, module, target):
        return target.config.vocab_size

    def save(self, module, directory, extra, step):
        module.draft.save(directory, {**extra, "step": step})


register_method(Toy())
'''

BUDGET = ["data.max_prompts=12", "data.max_prompt_tokens=48", "generate.max_new_tokens=8", "generate.batch_size=4",
          "generate.batches_per_shard=2", "train.steps=2", "train.save_every=2", "train.batch_size=4",
          "train.seq_len=64", "evaluate.n_prompts=1", "evaluate.max_new_tokens=8", "evaluate.fp32_prompts=1",
          "evaluate.fit_prompts=1", "evaluate.tree_budgets=[4]", "evaluate.baselines=false"]


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """tmp_path/toy_draft, imported; afterwards the two registries are as they were."""
    pkg = tmp_path / "plugins" / "toy_draft"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import draft, method  # each half registers itself\n")
    (pkg / "draft.py").write_text(textwrap.dedent(EVAL_SIDE))
    (pkg / "method.py").write_text(textwrap.dedent(PIPELINE_SIDE))
    registries = (methods.METHODS, draft_dir._KINDS)
    before = [dict(r) for r in registries]
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    try:
        yield importlib.import_module("toy_draft")
    finally:
        for r, old in zip(registries, before):
            r.clear()
            r.update(old)
        for name in [m for m in sys.modules if m == "toy_draft" or m.startswith("toy_draft.")]:
            del sys.modules[name]


def test_a_plugin_method_trains_evaluates_and_loads(toy_package, tiny_target, tmp_path):
    assert "toy" in methods.METHODS and "toy" in draft_dir.kind_names()
    assert check_choices(["toy"], ["fkl"]) == ["toy"]  # compare reads the method's variants
    assert "toy" not in SECTIONS  # no keys: no recipe section, and no other recipe's hash moves
    runs = tmp_path / "runs"
    recipe = load_recipe("recipes/code.yaml", [f"target={tiny_target}", "dtype=float32", "device=cpu",
                                               f"runs_dir={runs}", "wandb.mode=disabled", *BUDGET,
                                               "train.method=toy"])
    assert "'toy' (a low-rank bigram table)" in dict((k, h) for k, _, h in help_table())["train.method"]
    model, tok = load_target(str(tiny_target), "float32", "cpu")
    run = runs / "code" / "toy"
    stage_generate(recipe, run, model, tok)
    stage_train(recipe, run, model, tok)
    ck = sorted((run / "train").glob("checkpoint-*"))[-1]
    assert draft_dir.read_meta(ck)["kind"] == "toy" and draft_dir.read_meta(ck)["step"] == 2
    metrics = run_evaluate(recipe, run, model, tok)
    assert metrics["draft_method"].split("+")[0] == "toy" and metrics["greedy_exact"] is True
    best = run / "best"
    proposer = load_proposer(str(ck), model)
    assert type(proposer).__name__ == "BigramProposer"
    trained = toy_package.draft.Bigram.load(ck)
    assert all(torch.equal(a, b) for a, b in zip(proposer.draft.state_dict().values(),
                                                  trained.state_dict().values()))
    assert draft_dir.read_meta(best)["kind"] == "toy"
    served = load_proposer(f"hybrid-nostore:{best}", model)  # the promoted draft, with lookups, through the same loader
    assert type(served.model).__name__ == "BigramProposer"


def test_registering_checks_what_it_is_given(toy_package):
    """A kind or method registered twice, a kind nothing serves, a method whose kind is unknown or another
    name's, one exporting to a format that does not exist, and a method with recipe keys after the recipe's
    sections were built are refused; a kind that names a format is in that format's kinds at once."""
    serve = toy_package.draft.load
    with pytest.raises(ValueError, match="taken"):
        draft_dir.register_kind(draft_dir.DraftKind("toy", load=serve))
    with pytest.raises(ValueError, match="registered already"):
        methods.register_method(toy_package.method.Toy())
    with pytest.raises(ValueError, match="give `load`"):
        draft_dir.DraftKind("warp")

    class Warp(toy_package.method.Toy):
        name, kind, variants = "warp", None, {}

    with pytest.raises(draft_dir.DraftDirError, match="'warp' is not one of"):
        methods.register_method(Warp())
    Warp.kind = draft_dir.DraftKind("weft", load=serve)
    with pytest.raises(ValueError, match="declares the kind 'weft'"):
        methods.register_method(Warp())
    Warp.kind = draft_dir.DraftKind("warp", load=serve, exports=("onnx",))
    with pytest.raises(ValueError, match="'onnx', which is not an export format"):
        methods.register_method(Warp())
    assert "warp" not in draft_dir.kind_names()  # a refused method leaves no kind behind
    Warp.kind = draft_dir.DraftKind("warp", load=serve, exports=("medusa",))
    methods.register_method(Warp())
    from pipeline.export import kind_problem
    from pipeline.formats import FORMATS, serve_formats

    assert FORMATS["medusa"].kinds == ("medusa", "warp") and serve_formats()["vllm"]["warp"] == "medusa"
    assert kind_problem({"kind": "warp"}, "medusa") is None
    assert "use --format medusa" in kind_problem({"kind": "warp"}, "hf")
    methods.METHODS.pop("warp")

    @dataclasses.dataclass
    class WarpOptions:
        width: int = 1

    Warp.config = WarpOptions
    Warp.kind = None  # the kind "warp" is registered now
    with pytest.raises(ValueError, match="before pipeline.config is imported"):
        methods.register_method(Warp())


def _installed(root, group_line: str):
    """A distribution's metadata in `root` (what pip writes), naming one entry point in draftsmith's group."""
    info = root / "toy_draft-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-draft\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{methods.PLUGIN_GROUP}]\n{group_line}\n")


def _cli(root, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_an_installed_plugin_is_found_by_its_entry_point(toy_package, tmp_path):
    """Installed with an entry point in draftsmith.methods, the plugin registers itself when draftsmith starts:
    the recipe's train.method names it, with no import by the user."""
    _installed(tmp_path / "plugins", "toy = toy_draft")
    out = _cli(tmp_path / "plugins", "recipe-help")
    assert out.returncode == 0, out.stderr
    assert "'toy' (a low-rank bigram table)" in out.stdout


def test_a_broken_plugin_is_one_clear_line(tmp_path):
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('needs torch 9')\n")
    _installed(tmp_path, "bad = broken_plugin")
    out = _cli(tmp_path, "recipe-help")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "draftsmith: error: draftsmith plugin 'bad' (broken_plugin) failed to load: RuntimeError: needs torch 9; "
        "fix it or uninstall its package"]
