"""Draft heads (eval/heads/): Medusa heads' shapes, identity start and save/load, recurrent heads, and
the head directories' kind check against the EAGLE head."""

import json

import pytest
import torch

from eval.draft_dir import FILE as DRAFT_FILE
from eval.heads import EagleHead, MedusaHeads
from helpers import MEDUSA_NH as NH, TRAIN_V as V, medusa_target, perturbed_recurrent_heads


@pytest.fixture(scope="module")
def target():
    return medusa_target()


def test_shapes_and_identity_start(target):
    heads = MedusaHeads.from_target(target, NH)
    f = torch.randn(2, 5, target.config.hidden_size)
    h = heads(f)
    assert h.shape == (2, 5, NH, 32) and heads(f, 2).shape == (2, 5, 2, 32)
    lg = heads.logits(h)
    assert lg.shape == (2, 5, NH, V)
    # fresh heads: identity blocks + the target's LM head, so every head starts as the target's LM head
    torch.testing.assert_close(lg[:, :, 1], target.lm_head(f))
    torch.testing.assert_close(heads.head_logits(f, 2), lg[:, :, 2])


def test_save_load_roundtrip(tmp_path, target):
    ids = torch.tensor([0, 3, 4, 10, 50, 127])
    heads = MedusaHeads.from_target(target, NH, draft_ids=ids)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    heads.save(tmp_path / "m", extra={"step": 7, "target": "tiny"})
    back = MedusaHeads.load(tmp_path / "m")
    f = torch.randn(4, 32)
    torch.testing.assert_close(back.logits(back(f)), heads.logits(heads(f)), rtol=0, atol=0)
    assert back.d2t.tolist() == ids.tolist() and back.num_heads == NH
    meta = json.loads((tmp_path / "m" / DRAFT_FILE).read_text())
    assert meta["kind"] == "medusa" and meta["step"] == 7 and meta["medusa_config"]["draft_vocab_size"] == 6
    assert MedusaHeads.load(tmp_path / "m", dtype=torch.bfloat16).lm_heads[0].weight.dtype == torch.bfloat16
    EagleHead.from_target(target).save(tmp_path / "e")
    with pytest.raises(ValueError, match="not medusa"):
        MedusaHeads.load(tmp_path / "e")
    with pytest.raises(ValueError, match="not an eagle"):
        EagleHead.load(tmp_path / "m")


def test_recurrent_identity_start_and_roundtrip(tmp_path, target):
    """Fresh recurrent heads are the target's LM head whatever tokens they read; the config survives a
    save/load."""
    heads = MedusaHeads.from_target(target, NH, recurrent=True)
    f, e = torch.randn(5, 32), torch.randn(5, NH, 32)
    st = heads.states(f, e)  # [5, NH, H]
    assert st.shape == (5, NH, 32)
    torch.testing.assert_close(heads.logits(st)[:, 2], target.lm_head(f))
    heads = perturbed_recurrent_heads(target)
    heads.save(tmp_path / "r")
    back = MedusaHeads.load(tmp_path / "r")
    assert back.recurrent and json.loads((tmp_path / "r" / DRAFT_FILE).read_text())["medusa_config"]["recurrent"]
    torch.testing.assert_close(back.logits(back.states(f, e)), heads.logits(heads.states(f, e)), rtol=0, atol=0)
    assert not torch.allclose(heads.states(f, e), heads.states(f, e + 1))  # the tokens matter
