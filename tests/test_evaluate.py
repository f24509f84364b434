"""Evaluate stage: the per-prompt aggregation, and a draft LM with another tokenizer is refused."""

import json

import pytest

from pipeline.config import load_recipe
from pipeline.evaluate import aggregate, run_evaluate
from pipeline.models import ModelError


def test_aggregate_recomputes_rates_from_counts():
    a = {"n_tokens": 10, "wall_s": 1.0, "target_forwards": 4, "proposed": 8, "accepted": 6,
         "accept_len_hist": [0, 0, 2, 0, 0], "c": 0.1, "k": 4, "tree_rounds": 2}  # 2 rounds, 2 accepted each
    b = {"n_tokens": 6, "wall_s": 1.0, "target_forwards": 5, "proposed": 16, "accepted": 0,
         "accept_len_hist": [4, 0, 0, 0, 0], "c": 0.3, "k": 4}
    out = aggregate([a, b])
    assert out["tokens_per_s"] == 8.0 and out["tau"] == 16 / 9
    assert out["tree_rounds"] == 2  # b (chains) has none: the report flags the prediction as a bound
    assert out["alpha"] == 6 / 24
    assert out["accept_len_hist"] == [4, 0, 2, 0, 0]
    # position 1 reached 6 times, passed 2; position 2 reached 2, passed 2; position 3 reached 2, passed 0
    assert out["accept_per_pos"] == [2 / 6, 1.0, 0.0, 0.0]
    reached = 4 * 1 + 2 * 3  # four rounds rejected at position 1, two rounds reached position 3
    assert out["alpha_hat"] == pytest.approx(6 / reached)
    assert out["c"] == pytest.approx((0.1 * 8 + 0.3 * 16) / 24)


def test_draft_lm_with_another_tokenizer_is_refused(tmp_path, real_tokenizer):
    from test_bench import _tokenizer

    run = tmp_path / "run"
    (run / "prompts").mkdir(parents=True)
    (run / "prompts" / "heldout.jsonl").write_text(json.dumps({"id": "a", "prompt": "def f():"}) + "\n")
    ck = run / "train" / "checkpoint-000001"
    ck.mkdir(parents=True)
    (ck / "draftsmith_draft.json").write_text(json.dumps({"kind": "draft_lm"}))
    _tokenizer().save_pretrained(ck)
    (run / "train" / "manifest.json").write_text(json.dumps({"checkpoints": [ck.name]}))
    recipe = load_recipe(domain="code")
    with pytest.raises(ModelError, match="checkpoint-000001.*tokenizer differs"):
        run_evaluate(recipe, run, target=None, tokenizer=real_tokenizer)
