"""The promotion gate on hand-computed per-prompt measurements: the paired bootstrap against a reference, each
rule deciding alone, the evidence minimum, the floors' lower bounds and the per-position rule's serving
setting. tests/test_gate_measured.py runs the same gate on real timing."""

import numpy as np
import pytest

from pipeline.bootstrap import speed_ratio
from pipeline.gate import Serving, decide, table_rows

TOKENS = [10, 20, 30, 40, 10, 20, 30, 40]  # 8 prompts, 200 tokens
PLAIN = [t / 10 for t in TOKENS]  # plain decoding: 10 tokens/s on every prompt
EVIDENCE = {"min_prompts": 8, "min_tokens": 200}


def _pp(tokens, walls):
    return [{"n_tokens": t, "wall_s": w} for t, w in zip(tokens, walls)]


def _result(name, speedups, per_pos=(0.8, 0.6), exact=True, tokens=TOKENS, hist=None):
    """A measurement whose prompt i ran speedups[i] times faster than the plain run it took turns with."""
    walls = [t / 10 / s for t, s in zip(tokens, speedups)]
    plain = [t / 10 for t in tokens]
    stats = {"per_prompt": _pp(tokens, walls), "accept_per_pos": list(per_pos), "tau": 2.0, "alpha": 0.7,
             "tokens_per_s": sum(tokens) / sum(walls)}
    if hist is not None:
        stats["accept_len_hist"] = hist
    return {"name": name, "speedup": sum(plain) / sum(walls), "greedy_exact": exact, "lossless": exact,
            "stats": stats, "plain_stats": {"per_prompt": _pp(tokens, plain)}}


def _const(name, s, n=8, **kw):
    return _result(name, [s] * n, tokens=TOKENS[:n], **kw)


def test_speed_ratio_matches_a_reference_loop():
    """The vectorised bootstrap against a plain loop over the same resampled indices."""
    rng = np.random.default_rng(3)
    a = _result("a", list(rng.uniform(0.8, 2.0, 8)))
    b = _result("b", list(rng.uniform(0.8, 2.0, 8)))
    got = speed_ratio(a, b, n_boot=300, seed=5)
    idx = np.random.default_rng(5).integers(0, 8, size=(300, 8))

    def speed(r, ix):
        s, p = r["stats"]["per_prompt"], r["plain_stats"]["per_prompt"]
        return (sum(s[i]["n_tokens"] for i in ix) / sum(s[i]["wall_s"] for i in ix)) / \
            (sum(p[i]["n_tokens"] for i in ix) / sum(p[i]["wall_s"] for i in ix))

    boots = sorted(speed(a, ix) / speed(b, ix) for ix in idx)
    assert got["ratio"] == pytest.approx(speed(a, range(8)) / speed(b, range(8)))
    assert got["lower"] == pytest.approx(np.quantile(boots, 0.05, method="lower"))
    assert got["upper"] == pytest.approx(np.quantile(boots, 0.95, method="higher"))
    assert got["n_prompts"] == 8 and got["n_tokens"] == sum(TOKENS)


def test_constant_ratio_is_its_own_bound():
    b = speed_ratio(_const("c", 1.875), _const("h", 1.5))
    assert [b["ratio"], b["lower"], b["upper"]] == pytest.approx([1.25] * 3)


def test_two_prompts_bound_is_the_worse_prompt():
    """Two prompts: a resample is {0,0} (p 1/4), {0,1} (1/2) or {1,1} (1/4); the 5% quantile lies in the mass of
    the worse single prompt, 0.9, and the 95% one in the better's, 1.5."""
    b = speed_ratio(_result("c", [1.5, 0.9], tokens=[10, 10]), None)
    assert b["lower"] == pytest.approx(0.9) and b["upper"] == pytest.approx(1.5)
    assert b["ratio"] == pytest.approx(20 / (1 / 1.5 + 1 / 0.9) / 10)


def test_plain_runs_shared_by_both_cancel_and_lists_must_pair():
    a, b = _result("a", [1.2, 1.5, 0.9, 2.0, 1.1, 1.3, 1.4, 1.6]), _const("b", 1.0)
    assert speed_ratio(a, b) == speed_ratio(a, None) | {"n_tokens": sum(TOKENS)}
    with pytest.raises(ValueError, match="same prompts"):
        speed_ratio(a, _const("short", 1.0, n=4))


def test_faster_challenger_is_promoted_with_its_figures():
    d = decide(_const("challenger", 1.8, per_pos=(0.82, 0.58)), _const("champion", 1.5), _const("ngram", 1.2),
               min_gain=0.02, **EVIDENCE)
    assert d.promote and d.outcome == "promote", d.summary()
    by = {c.name: c for c in d.reasons}
    assert set(by) == {"evidence", "speedup_over_plain", "speedup_over_ngram", "lossless", "gain_over_champion",
                       "acceptance_per_position"}
    assert by["gain_over_champion"].value == pytest.approx(0.2)
    assert by["speedup_over_plain"].value == pytest.approx(1.8) and by["speedup_over_ngram"].value == pytest.approx(1.5)
    f = d.to_dict()["figures"]
    assert f["bootstrap"]["ratio"] == pytest.approx(1.2) and f["evidence"] == {
        "n_prompts": 8, "n_tokens": 200, "min_prompts": 8, "min_tokens": 200}
    assert f["serving"] == {"engine": "draftsmith", "k": 2}
    cols, rows = table_rows(d)
    assert cols[0] == "check" and len(rows) == 6


@pytest.mark.parametrize("case, failing", [
    ("small_gain", "gain_over_champion"),  # 1% faster: below min_gain 2%
    ("noisy_gain", "gain_over_champion"),  # faster on average, but slower on the long prompts
    ("inexact", "lossless"),
    ("below_plain", "speedup_over_plain"),
    ("below_ngram", "speedup_over_ngram"),
])
def test_each_rule_alone_keeps_the_champion(case, failing):
    speeds = {"small_gain": [1.515] * 8, "noisy_gain": [3.0, 3.0, 3.0, 1.1, 3.0, 3.0, 3.0, 1.1],
              "below_plain": [0.95] * 8}.get(case, [1.8] * 8)
    champ = _const("champion", 1.5 if case != "below_plain" else 0.9)
    chal = _result("challenger", speeds, exact=case != "inexact")
    d = decide(chal, champ, _const("ngram", 2.0 if case == "below_ngram" else 1.2), min_gain=0.02, **EVIDENCE)
    if case == "noisy_gain":
        assert d.figures["bootstrap"]["ratio"] > 1.02
    assert not d.promote and d.outcome == "keep"
    assert failing in {c.name for c in d.failed}, d.summary()
    assert d.summary().startswith("keep the champion")


def test_floors_use_the_paired_lower_bound_not_the_point_estimate():
    """A first draft 1.05x plain overall, within noise of 1.0x (1.6x on half the prompts, 0.85x on the other):
    the point estimates would admit it over plain and over an n-gram at 1.0x; the lower bounds do not."""
    first = _result("first", [1.6, 0.85] * 4)
    d = decide(first, None, _const("ngram", 1.0), **EVIDENCE)
    assert first["speedup"] > 1.0 and d.figures["bootstrap_plain"]["ratio"] > 1.0
    assert not d.promote and {c.name for c in d.failed} == {"speedup_over_plain", "speedup_over_ngram"}
    assert "lower bound" in d.summary() and d.summary().startswith("not promoted (no champion yet)")
    steady = decide(_const("first", 1.4), None, _const("ngram", 1.2), **EVIDENCE)
    assert steady.promote and {c.name for c in steady.reasons} == {
        "evidence", "speedup_over_plain", "speedup_over_ngram", "lossless"}


@pytest.mark.parametrize("n, min_prompts, min_tokens", [(1, 8, 10), (4, 8, 10), (8, 8, 500)])
def test_below_the_minimum_evidence_the_verdict_is_not_enough_evidence(n, min_prompts, min_tokens):
    """One prompt makes every resample that prompt, so its 'bound' is the point ratio: a 3x challenger on one
    prompt is not promoted; the counts are recorded with the verdict."""
    chal, champ = _const("challenger", 3.0, n=n), _const("champion", 1.5, n=n)
    d = decide(chal, champ, _const("ngram", 1.2, n=n), min_prompts=min_prompts, min_tokens=min_tokens)
    assert not d.promote and d.outcome == "not enough evidence"
    assert [c.name for c in d.reasons] == ["evidence"] and "bootstrap" not in d.figures
    assert d.summary().startswith("not enough evidence: kept the champion")
    assert d.figures["evidence"]["n_prompts"] == n and d.to_dict()["outcome"] == "not enough evidence"
    first = decide(chal, None, None, min_prompts=min_prompts, min_tokens=min_tokens)
    assert first.summary().startswith("not enough evidence: not promoted")


def test_a_measurement_without_per_prompt_figures_is_not_enough_evidence():
    old = _const("first", 1.5)
    old["stats"].pop("per_prompt")
    d = decide(old, None, None, **EVIDENCE)
    assert d.outcome == "not enough evidence" and d.figures["evidence"]["n_prompts"] == 0


def test_positions_are_compared_over_the_union_up_to_the_served_k():
    """The challenger's histogram stops at position 1 (it never reached position 2); the champion accepts 0.3 per
    draft there. The old zip dropped position 2; over the union it reads 0 for the challenger. Served by vLLM at
    K=3 that position is reached and the dip vetoes, naming the setting; at K=2 it is never reached."""
    champ = _const("champion", 1.5, hist=[300, 100, 300, 300])  # acceptance_at_pos 0.7, 0.6, 0.3
    chal = _const("challenger", 1.8, hist=[200, 200, 600])  # 0.8, 0.6, -
    d = decide(chal, champ, None, serving=Serving("vllm", 3), **EVIDENCE)
    pos = {c.name: c for c in d.reasons}["acceptance_per_position"]
    assert not d.promote and not pos.passed and "acceptance_at_pos_2 0.000" in pos.detail
    assert "protects vllm K=3" in pos.detail and d.figures["serving"] == {"engine": "vllm", "k": 3}
    assert decide(chal, champ, None, serving=Serving("vllm", 2), **EVIDENCE).promote


def test_a_dip_does_not_veto_a_significant_gain_measured_in_the_serving_decoder():
    """Issue 32's OLMo2 retrain: a significant gain with acceptance_at_pos_2 0.06 below the champion's. Served by
    draftsmith, the gain is the serving speed itself: promoted, the dip reported. Served by vLLM, where this
    speed was not measured, the dip keeps the champion."""
    champ = _const("champion", 1.43, hist=[100, 150, 255, 495])  # acceptance_at_pos 0.9, 0.75, 0.495
    chal = _const("challenger", 1.98, hist=[80, 160, 326, 434])  # 0.92, 0.76, 0.434
    ours = decide(chal, champ, None, serving=Serving("draftsmith", 4), **EVIDENCE)
    pos = {c.name: c for c in ours.reasons}["acceptance_per_position"]
    assert ours.promote and pos.passed and "not a veto" in pos.detail and "draftsmith K=4" in pos.detail
    vllm = decide(chal, champ, None, serving=Serving("vllm", 4), **EVIDENCE)
    assert not vllm.promote and [c.name for c in vllm.failed] == ["acceptance_per_position"]


def test_positions_compare_vllms_acceptance_not_the_conditional_one():
    """The chat retrain of docs/retraining-demo.md: the champion reached position 3 in 112 of 1,251 rounds and
    accepted there 68% of the time; the challenger reached it in 186 of 1,062 and accepted 40%. Conditional
    acceptance reads the challenger worse there; per draft (vLLM's acceptance_at_pos_i) it is better at every
    position, which is what serving sees. One that accepts less per draft is kept where positions veto."""
    vllm4 = Serving("vllm", 4)
    champ = _const("champion", 1.1, hist=[926, 213, 36, 14, 62], per_pos=[0.26, 0.345, 0.679, 0.816])
    chal = _const("challenger", 1.3, hist=[616, 260, 111, 13, 62], per_pos=[0.42, 0.417, 0.403, 0.827])
    d = decide(chal, champ, None, min_gain=0.02, serving=vllm4, **EVIDENCE)
    assert d.promote, d.summary()
    worse = _const("challenger", 1.3, hist=[1000, 150, 50, 20, 31], per_pos=[0.2, 0.4, 0.5, 0.6])
    d = decide(worse, champ, None, min_gain=0.02, serving=vllm4, **EVIDENCE)
    assert not d.promote and [c.name for c in d.failed] == ["acceptance_per_position"], d.summary()
