"""The method registry (pipeline/methods/): one DraftMethod per draft kind, each building a trainable
module, computing a finite loss on a collated batch and saving a draft directory of its kind; method
modules do not import each other, and the recipe's sections come from the registry."""

import dataclasses
from pathlib import Path

import pytest
import torch

from eval import draft_dir
from pipeline.config import TrainConfig, recipe_from_dict
from pipeline.methods import METHODS, DraftMethod, get_method
from pipeline.train_data import Sequences, collate

from helpers import TRAIN_V as V, greedy_rows, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
METHODS_DIR = Path(__file__).resolve().parents[1] / "pipeline" / "methods"


@pytest.fixture(scope="module")
def target():
    return tiny_llama(num_layers=3)


@pytest.fixture(scope="module")
def rows(target):
    return greedy_rows(target, V)


def _tc(method: str):
    sections = {"eagle": {"unroll": 2}, "medusa": {"heads": 2}, "draft_lm": {"num_layers": 1},
                "self_spec": {"num_layers": 2, "adapter_rank": 4}}
    train = {"method": method, "draft_vocab_size": 40, **({method: sections[method]} if method in sections else {})}
    return recipe_from_dict({"target": "tiny", "train": train}).train


def _batch(method: DraftMethod, target, rows):
    feats = None
    if method.needs_features:
        with torch.no_grad():
            feats = [target.model(input_ids=torch.tensor([r["ids"]])).last_hidden_state[0] for r in rows]  # [n, H]
    ds = Sequences(rows, feats)
    return collate([ds[i] for i in range(len(ds))])


def test_registry_lists_every_draft_kind():
    assert tuple(METHODS) == draft_dir.kind_names()
    assert all(callable(k.loader()) for k in draft_dir.kinds())  # every kind is served, its reference resolves
    assert all(callable(k.wrapper()) and isinstance(k.module_class(), type) for k in draft_dir.kinds() if k.module)
    for name, m in METHODS.items():
        assert isinstance(m, DraftMethod) and m.name == name and get_method(name) is m
    with pytest.raises(KeyError, match="eagle"):
        get_method("magic")


def test_recipe_sections_are_the_methods_configs():
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, m in METHODS.items():
        if m.config is not None:
            assert fields[name].default_factory is m.config, name
        else:
            assert name not in fields


@pytest.mark.parametrize("name", [n for n, m in METHODS.items() if m.trains])
def test_method_builds_trains_and_saves_a_draft_dir(tmp_path, target, rows, name):
    method = get_method(name)
    tc = _tc(name)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    module = method.build(tc, target, None, rows, None)
    params = method.trainable_parameters(module)
    assert params and all(p.requires_grad for p in params)
    loss, metrics = method.loss(module, _batch(method, target, rows))
    assert loss.ndim == 0 and torch.isfinite(loss) and metrics
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert all(p.grad is None for p in target.parameters())  # the target is never trained
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    assert method.vocab_size(module, target) == (V if name == "draft_lm" else 40)
    with torch.no_grad():  # a trained step's change: a fresh build must not pass for the resumed one
        for p in params:
            p.add_(torch.randn_like(p) * 0.01)
    method.save(module, tmp_path, {"target": "tiny", "train_key": "k"}, 3)
    meta = draft_dir.read_meta(tmp_path)
    assert meta["kind"] == name and meta["step"] == 3 and meta["train_key"] == "k"
    resumed = method.build(tc, target, None, rows, tmp_path)  # a checkpoint resumes to the same weights
    fresh = method.build(tc, target, None, rows, None)
    for a, b in zip(method.trainable_parameters(resumed), params):
        assert torch.equal(a.detach(), b.detach())
    assert any(not torch.equal(a.detach(), b.detach())
               for a, b in zip(method.trainable_parameters(fresh), params))


def test_int8_has_nothing_to_train(tmp_path):
    method = get_method("int8")
    assert not method.trains and method.config is None
    method.save(None, tmp_path, {"target": "tiny"}, 0)
    assert draft_dir.read_meta(tmp_path) == {"kind": "int8", "target": "tiny", "step": 0}


@pytest.mark.parametrize("name", [n for n, m in METHODS.items() if m.token_level])
def test_token_level_methods_sample_seeded_continuations(target, rows, name):
    method = get_method(name)
    module = method.build(_tc(name), target, None, rows, None)
    prompts, firsts = [r["ids"][:5] for r in rows], [r["ids"][5] for r in rows]
    a = method.sample(module, target, prompts, firsts, 6, seed=1)
    assert [len(s[:6]) for s in a] == [6] * len(rows) and all(0 <= t < V for s in a for t in s)
    assert method.sample(module, target, prompts, firsts, 6, seed=1) == a
    assert module.training  # sampling leaves the module in the mode it had


def test_feature_methods_cannot_sample():
    for m in METHODS.values():
        if not m.token_level:
            with pytest.raises(NotImplementedError):
                m.sample(None, None, [[1]], [2], 1, 0)
