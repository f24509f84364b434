"""Evaluate stage: the per-prompt aggregation, a draft LM with another tokenizer is refused, and the
exactness rule (exact in fp32 and where the row-invariant CPU kernels ran, near-ties otherwise)."""

import json

import pytest
import torch

from pipeline.config import load_recipe
from pipeline.evaluate import run_evaluate
from pipeline.measure import aggregate
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
    from helpers import word_tokenizer as _tokenizer

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


def test_exactness_rule_is_exact_in_fp32_and_with_row_invariant_kernels():
    from eval.exactness import exactness_rule

    assert exactness_rule("float32", False) == "exact"
    assert exactness_rule("bfloat16", True) == "exact"
    assert exactness_rule("bfloat16", False) == "near-ties"


def _result(exact_match, near_ties, row_invariant):
    return {"exact_match": exact_match, "all_near_ties": near_ties, "stats": {"row_invariant": row_invariant}}


def test_greedy_exact_is_identical_output_and_lossless_is_what_the_gate_admits():
    """Issue 31: off the row-invariant paths bf16 output parted from plain at a near-tie and matched on
    18.8% of tokens, while greedy_exact read True. greedy_exact now means identical output."""
    from pipeline.evaluate import mark_exactness

    diverged, same, bad = _result(False, True, False), _result(True, True, False), _result(False, False, False)
    kernel = _result(False, True, True)  # row-invariant verifies: a near-tie is no excuse there
    rs = [diverged, same, bad, kernel]
    mark_exactness(rs, best=same, dtype="bfloat16", exact32=True)
    assert (diverged["greedy_exact"], diverged["lossless"]) == (False, True)
    assert (same["greedy_exact"], same["lossless"]) == (True, True)
    assert (bad["greedy_exact"], bad["lossless"]) == (False, False)
    assert (kernel["greedy_exact"], kernel["lossless"]) == (False, False)
    mark_exactness(rs, best=same, dtype="bfloat16", exact32=False)  # the promoted one fails the fp32 proof
    assert (same["greedy_exact"], same["lossless"]) == (False, False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_pairs_reports_whether_verifies_were_row_invariant(dtype):
    """bf16 on a CPU where eval/kernels.py builds: every verify row-invariant, so evaluate will demand
    exact bf16 output; fp32 weights take PyTorch's kernels (and fp32 is held exact anyway)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eval.cpu import small_gemm
    from eval.proposers import NgramProposer
    from pipeline.measure import decode_pairs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # head_dim 16
    target = LlamaForCausalLM(cfg).to(dtype).eval()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5]]
    plain, _, spec, stats = decode_pairs(target, NgramProposer(), prompts, 4, 8, None, "t")
    assert stats["row_invariant"] == (dtype == torch.bfloat16 and small_gemm() is not None)
    if stats["row_invariant"] or dtype == torch.float32:
        assert spec == plain


def test_decode_together_rotates_turns_and_matches_separate_runs(monkeypatch):
    """Several candidates measured together: on prompt i the turn order (plain first, then each
    candidate) is rotated by i, every candidate decodes every prompt once, and its output and
    acceptance equal those of its own decode_pairs run (only the timing is shared)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eval.decoder import SpeculativeDecoder
    from eval.proposers import NgramProposer
    from pipeline.measure import decode_pairs, decode_together

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    target = LlamaForCausalLM(cfg).float().eval()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5], [7, 8, 9, 7, 8], [3, 3, 3, 3]]
    props = {"a": (NgramProposer(), 2), "b": (NgramProposer(max_ngram=2), 4)}
    order, gen = [], SpeculativeDecoder.generate

    def logged(self, prompts_, **kw):
        if kw.get("max_new_tokens") == 8:  # not the warm-up
            order.append("plain" if self.proposer is None else "a" if self.proposer is props["a"][0] else "b")
        return gen(self, prompts_, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "generate", logged)
    plain, plain_stats, outs = decode_together(target, props, prompts, 8, None, "t")
    assert order == ["plain", "a", "b", "a", "b", "plain", "b", "plain", "a", "plain", "a", "b"]
    monkeypatch.setattr(SpeculativeDecoder, "generate", gen)
    assert plain_stats["n_tokens"] == sum(map(len, plain))
    for name, (prop, k) in props.items():
        p2, _, seqs, stats = decode_pairs(target, prop, prompts, k, 8, None, name)
        assert outs[name][0] == seqs == plain == p2
        assert (outs[name][1]["tau"], outs[name][1]["alpha"]) == (stats["tau"], stats["alpha"])


def test_measurement_cache_reads_back_only_under_the_same_key(tmp_path):
    """A measurement is read back under the key it was stored with (settings, serving revision, the
    source's files, extra settings) and missed when any of them changes, e.g. a datastore added to
    the checkpoint later."""
    from pipeline.measure import MeasurementCache

    ck = tmp_path / "checkpoint-000002"
    ck.mkdir()
    (ck / "head.safetensors").write_bytes(b"x" * 10)
    cache = MeasurementCache(tmp_path / "eval", {"n": 2})
    cache.store("a+ngram", {"speedup": 1.5}, f"hybrid:{ck}", {"max_nodes": 6})
    assert cache.read("a+ngram", f"hybrid:{ck}", {"max_nodes": 6})["speedup"] == 1.5
    assert cache.read("a+ngram", f"hybrid:{ck}", {"max_nodes": 8}) is None
    assert MeasurementCache(tmp_path / "eval", {"n": 3}).read("a+ngram", f"hybrid:{ck}", {"max_nodes": 6}) is None
    (ck / "trainer_state.pt").write_bytes(b"y")  # not part of what is served
    assert cache.read("a+ngram", f"hybrid:{ck}", {"max_nodes": 6}) is not None
    (ck / "datastore.npy").write_bytes(b"z")
    assert cache.read("a+ngram", f"hybrid:{ck}", {"max_nodes": 6}) is None
    assert cache.read("missing") is None


def test_evaluate_cache_files_written_before_still_read(tmp_path, monkeypatch):
    """eval/<name>.json as evaluate wrote it before the cache was a class (on avx512-bf16, before the CPU path
    was keyed): the result with its key, {evaluate, dtype, n, serving, files[, max_nodes]} for a checkpoint or a
    served form and no files for the n-gram baseline."""
    import types

    import pipeline.measure as measure
    from eval.decoder import SERVING_REV
    from pipeline.evaluate import BASELINE, SERVED, Candidate
    from pipeline.measure import MeasurementCache, source_fingerprint

    monkeypatch.setattr(measure, "cpu_path", lambda: types.SimpleNamespace(name="avx512-bf16"))

    ck = tmp_path / "train" / "checkpoint-000002"
    ck.mkdir(parents=True)
    (ck / "head.safetensors").write_bytes(b"x" * 10)
    settings = {"evaluate": {"k": 2}, "dtype": "float32", "n": 2}
    old = settings | {"serving": SERVING_REV}  # as written then: no CPU path in the key
    served = Candidate("checkpoint-000002+ngram", f"hybrid:{ck}", 2, SERVED, 6)
    baseline = Candidate("ngram", "ngram", 8, BASELINE)
    (tmp_path / "eval").mkdir()
    for c, key in ((served, old | {"files": source_fingerprint(ck), "max_nodes": 6}), (baseline, old)):
        (tmp_path / "eval" / f"{c.name}.json").write_text(json.dumps({"name": c.name, "key": key}))
    cache = MeasurementCache(tmp_path / "eval", settings)
    assert all(cache.read(c.name, c.files, c.settings) is not None for c in (served, baseline))
