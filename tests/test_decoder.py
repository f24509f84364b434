"""Greedy exactness of the speculative decoder (fp32, tiny models): for every proposer and K, the
output equals plain greedy decoding token for token — HF generate and our own plain mode — at
batch 1 and in ragged batches, with EOS and max_new_tokens stopping exactly."""

import random

import time

import pytest
import torch

import eval.decoder as D
from eval.decoder import K_MAX_AUTO, GenerationResult, KController, SpeculativeDecoder
from eval.heads import EagleHead
from eval.proposers import DraftLMProposer, EagleProposer, HybridProposer, NgramProposer, load_proposer
from eval.speedup import best_k

from helpers import DECODER_V as V, N_NEW, PROMPTS, decoder_llama as tiny, first_drafts


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_paths]


@pytest.fixture(scope="module")
def target():
    return tiny(0)


@pytest.fixture(scope="module")
def draft():
    return tiny(1, layers=1, hidden=32, heads=2, kv=1)


@pytest.fixture(scope="module")
def hf_ref(target):
    out = []
    for p in PROMPTS:
        g = target.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def proposers(target, draft):
    ids = torch.arange(0, V, 2)  # a truncated draft vocabulary (every other id)
    return {
        "ngram": NgramProposer(),
        "draft_lm": DraftLMProposer(draft, V),
        "self": DraftLMProposer(target, V),  # target as its own draft: every draft accepted
        "eagle": EagleProposer(EagleHead.from_target(target), target),
        "eagle_trunc": EagleProposer(EagleHead.from_target(target, draft_ids=ids), target),
        # n-gram where it matches, the model elsewhere; the draft LM must catch up on lookup rounds.
        "hybrid_draft_lm": HybridProposer(DraftLMProposer(draft, V), min_match=1),
        "hybrid_eagle": HybridProposer(EagleProposer(EagleHead.from_target(target, draft_ids=ids), target),
                                       min_match=1, k_ngram=6),
    }


def test_plain_equals_hf_generate(target, hf_ref):
    dec = SpeculativeDecoder(target, None)
    for p, ref in zip(PROMPTS, hf_ref):
        res = dec.generate([p], max_new_tokens=N_NEW)
        assert isinstance(res, GenerationResult)
        assert res.sequences == [ref]
        assert res.stats["n_tokens"] == N_NEW and res.stats["proposed"] == 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_batch1_every_proposer_exact(target, draft, hf_ref, k):
    for name, prop in proposers(target, draft).items():
        dec = SpeculativeDecoder(target, prop, k=k)
        for p, ref in zip(PROMPTS[:3], hf_ref[:3]):
            res = dec.generate([p], max_new_tokens=N_NEW)
            assert res.sequences == [ref], (name, k, p)
            s = res.stats
            assert s["n_tokens"] == N_NEW
            assert 0 <= s["alpha"] <= 1 and len(s["accept_len_hist"]) == max(k, prop.max_k) + 1
            if name == "self":
                assert s["alpha_hat"] == 1.0


@pytest.mark.parametrize("k", [1, 3])
def test_ragged_batch_exact(target, draft, hf_ref, k):
    for name, prop in proposers(target, draft).items():
        res = SpeculativeDecoder(target, prop, k=k).generate(PROMPTS, max_new_tokens=N_NEW)
        assert res.sequences == hf_ref, (name, k)


def test_plain_batch_equals_plain_batch1(target, hf_ref):
    res = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW)
    assert res.sequences == hf_ref


def test_eos_and_max_new_tokens_per_sequence(target, draft, hf_ref):
    # EOS = a token each reference emits at some step > 0: every row must stop right after it.
    eos = hf_ref[0][5]
    want = []
    for ref in hf_ref:
        want.append(ref[: ref.index(eos) + 1] if eos in ref else ref)
    for name, prop in proposers(target, draft).items():
        for k in (2, 4):
            res = SpeculativeDecoder(target, prop, k=k).generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=[eos, V + 7])
            assert res.sequences == want, (name, k)
            res = SpeculativeDecoder(target, prop, k=k).generate(PROMPTS, max_new_tokens=5, eos_token_id=eos)
            assert res.sequences == [w[:5] for w in want], (name, k)
    assert SpeculativeDecoder(target, None).generate([PROMPTS[0]], max_new_tokens=1).sequences == [hf_ref[0][:1]]


def test_plain_decoding_keeps_the_teacher_forced_top_logprobs(target, hf_ref):
    """generate(logprobs=N): each new token's top N log-probs are those of a teacher-forced forward over the
    row alone, rows of a ragged batch stopping at EOS at different steps included; sampled rows too."""
    eos = hf_ref[0][5]
    for temperature in (0.0, 0.8):
        res = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=eos,
                                                        temperature=temperature, logprobs=5)
        assert len(res.logprobs) == len(PROMPTS)
        for p, seq, (ids, vals) in zip(PROMPTS, res.sequences, res.logprobs):
            assert ids.shape == vals.shape == (len(seq), 5) and vals.dtype == torch.float32
            with torch.no_grad():
                logits = target(torch.tensor([p + seq])).logits[0, len(p) - 1:len(p) - 1 + len(seq)]
            ref = torch.log_softmax(logits.float(), -1).topk(5, -1)
            assert torch.allclose(vals, ref.values, atol=1e-4) and (ids[:, 0] == ref.indices[:, 0]).all()
            if temperature == 0.0:
                assert ids[:, 0].tolist() == seq  # greedy: each token is the top-1
    assert SpeculativeDecoder(target, None).generate(PROMPTS[:1], max_new_tokens=3).logprobs is None
    with pytest.raises(ValueError, match="plain decoding only"):
        SpeculativeDecoder(target, NgramProposer(), k=2).generate(PROMPTS[:1], max_new_tokens=3, logprobs=5)


def test_plain_decoding_keeps_the_teacher_forced_features(target, hf_ref):
    """generate(features=True): each row's features at every position of prompt + new tokens, the last token
    included, are those of a teacher-forced forward over the row alone (the final norm's output, what the LM
    head reads), in a ragged batch whose rows stop at EOS or at max_new_tokens at different steps, finished
    rows dropped from the target's batch on the way (their last token fed as they leave)."""
    eos = hf_ref[0][5]
    for max_new in (1, N_NEW):
        dec = SpeculativeDecoder(target, None)
        res = dec.generate(PROMPTS, max_new_tokens=max_new, eos_token_id=eos, features=True, logprobs=2)
        if max_new == N_NEW:
            assert dec.runner.K.shape[1] < len(PROMPTS)  # rows were dropped
        assert len(res.features) == len(PROMPTS)
        for p, seq, f in zip(PROMPTS, res.sequences, res.features):
            with torch.no_grad():
                ref = target(torch.tensor([p + seq]), output_hidden_states=True).hidden_states[-1][0]
            assert f.shape == ref.shape == (len(p) + len(seq), target.config.hidden_size)
            torch.testing.assert_close(f.float(), ref.float(), atol=1e-4, rtol=1e-4)
    assert SpeculativeDecoder(target, None).generate(PROMPTS[:1], max_new_tokens=3).features is None
    with pytest.raises(ValueError, match="plain decoding only"):
        SpeculativeDecoder(target, NgramProposer(), k=2).generate(PROMPTS[:1], max_new_tokens=3, features=True)


def test_self_draft_accepts_everything(target):
    res = SpeculativeDecoder(target, DraftLMProposer(target, V), k=4).generate(PROMPTS, max_new_tokens=N_NEW)
    s = res.stats
    assert s["alpha_hat"] == 1.0 and s["accept_per_pos"] == [1.0] * 4
    assert s["accept_len_hist"][4] >= 1 and sum(s["accept_len_hist"][:4]) <= len(PROMPTS)  # only truncated rounds


def test_eagle_drafts_match_uncached_head(target):
    """The head's cached, position-indexed state after verification equals a from-scratch run of the
    head over the true target features: its first draft of every round is the uncached argmax."""
    head = EagleHead.from_target(target)
    seq, seen = first_drafts(target, EagleProposer(head, target), PROMPTS[2], 3, N_NEW)
    with torch.no_grad():
        ids = torch.tensor([seq])
        feats = target.model(ids).last_hidden_state  # [1, S, H]
        emb = target.get_input_embeddings()(ids)
        S = len(seq)
        h = head(feats[:, : S - 1], emb[:, 1:], torch.arange(S - 1)[None])  # slot s: token s+1
        ref = head.d2t[head.logits(h).argmax(-1)][0]  # ref[s] proposes token s + 2
    assert len(seen) >= 3
    for n, d1 in seen:  # n: the current token's position; its head slot is n - 1
        assert d1 == int(ref[n - 1])


def test_stream_equals_generate(target, draft):
    dec = SpeculativeDecoder(target, DraftLMProposer(draft, V), k=3)
    chunks = list(dec.stream(PROMPTS, max_new_tokens=N_NEW, eos_token_id=7))
    joined = [sum((c[b] for c in chunks), []) for b in range(len(PROMPTS))]
    assert joined == dec.generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=7).sequences
    assert all(len(c) == len(PROMPTS) for c in chunks)


class _SpyController(KController):
    """KController recording what the decoder told it before each choice."""

    def choose(self, alpha_hat, c, measured=True, rows=1, remaining=None):
        k = super().choose(alpha_hat, c, measured, rows, remaining)
        self.seen = getattr(self, "seen", []) + [(alpha_hat, c, measured, self.spec_rounds, k)]
        return k


def test_k_auto_exact_and_switches(target, draft, hf_ref, monkeypatch):
    """k="auto": exact output; one choice a round: WARMUP_PLAIN plain steps, K_WARMUP until two
    speculative rounds measured alpha, then a K in 0..K_MAX_AUTO (0: off)."""
    spies = []
    monkeypatch.setattr(D, "KController", lambda *a: spies.append(_SpyController(*a)) or spies[-1])
    for prop in (DraftLMProposer(target, V), DraftLMProposer(draft, V), NgramProposer(),
                 EagleProposer(EagleHead.from_target(target), target)):
        res = SpeculativeDecoder(target, prop, k="auto").generate(PROMPTS, max_new_tokens=N_NEW)
        assert res.sequences == hf_ref
        ks, seen = res.stats["k_choices"], spies[-1].seen
        self_draft = isinstance(prop, DraftLMProposer) and prop.model is target
        assert ks == [k for *_, k in seen] and len(ks) == res.stats["rounds"]
        assert ks[:D.WARMUP_PLAIN] == [0] * D.WARMUP_PLAIN
        warm = [i for i, (_, _, measured, spec, _) in enumerate(seen)
                if i >= D.WARMUP_PLAIN and (spec < 2 or not measured)]
        assert warm == list(range(D.WARMUP_PLAIN, D.WARMUP_PLAIN + len(warm))) and len(warm) >= 2
        assert all(ks[i] == D.K_WARMUP for i in warm)
        for alpha, c, _, _, k in seen[D.WARMUP_PLAIN + len(warm):]:
            assert 0 <= k <= K_MAX_AUTO, (alpha, c, k)
            assert c > 0 and (alpha == 1.0 or not self_draft)  # the target drafting itself: all accepted
        assert len(ks) > D.WARMUP_PLAIN + len(warm)  # the choice after warm-up was made


def test_k_auto_turns_off_and_probes(target, draft, monkeypatch):
    """A useless draft (alpha ~ 0) makes every K lose: rounds go plain, with periodic probes,
    and the output stays exact after each proposer resync."""
    monkeypatch.setattr(D, "PROBE_EVERY", 4)
    prop = EagleProposer(EagleHead.from_target(target, draft_ids=torch.tensor([V - 1, V - 2])), target)
    res = SpeculativeDecoder(target, prop, k="auto").generate([PROMPTS[0]], max_new_tokens=40)
    ref = SpeculativeDecoder(target, None).generate([PROMPTS[0]], max_new_tokens=40).sequences
    assert res.sequences == ref
    ks = res.stats["k_choices"][D.WARMUP_PLAIN + 2:]  # after the plain and K=4 warm-up rounds
    assert 0 in ks and any(k > 0 for k in ks[ks.index(0):])  # off, then probed back on
    # A draft that never matches makes a round's tokens 1 at any K, so its best K scores at most plain's rate:
    # exactly 1.0 where a verify timed no dearer than a step (the controller floors it there), below otherwise.
    assert res.stats["expected_speedup"] <= 1 and res.stats["spec_off_fraction"] > 0.5


def test_prefill_groups_pad_each_group_to_its_own_longest():
    lengths = [42, 170, 50, 160, 100, 101]
    groups = D.prefill_groups(lengths)
    assert sorted(b for g in groups for b in g) == list(range(6)) and len(groups) > 1
    for g in groups:  # each group's padding within PREFILL_WASTE of its tokens
        assert len(g) * max(lengths[b] for b in g) <= (1 + D.PREFILL_WASTE) * sum(lengths[b] for b in g)
    assert D.prefill_groups([5]) == [[0]] and D.prefill_groups([9, 9, 9]) == [[0, 1, 2]]


def test_grouped_prefill_equals_one_padded_forward(target, draft, monkeypatch):
    """Prompts of unlike length prefill in groups (each padded to its own longest): the same first tokens,
    the same K/V in every prompt slot, and the same continuations as one forward padded to the longest."""
    assert len(D.prefill_groups([len(p) for p in PROMPTS])) > 1
    grouped = SpeculativeDecoder(target, DraftLMProposer(draft, V), k=3)
    res = grouped.generate(PROMPTS, max_new_tokens=N_NEW)
    K_grouped = grouped.runner.K.clone()
    monkeypatch.setattr(D, "prefill_groups", lambda lengths: [list(range(len(lengths)))])
    padded = SpeculativeDecoder(target, DraftLMProposer(draft, V), k=3)
    assert padded.generate(PROMPTS, max_new_tokens=N_NEW).sequences == res.sequences
    for b, p in enumerate(PROMPTS):
        assert torch.allclose(K_grouped[:, b, :, :len(p)], padded.runner.K[:, b, :, :len(p)], atol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
def test_finished_rows_leave_the_targets_forward(target, draft, tree):
    """Rows of a speculating batch finish at different rounds (lookups accept more on the repetitive
    prompts); once at most DROP_SHARE of them run, the target computes only those, and every
    row's output still equals plain decoding's."""
    prompts = PROMPTS + [PROMPTS[0][:2], PROMPTS[2][3:]]
    prop = HybridProposer(DraftLMProposer(draft, V), min_match=1) if tree else NgramProposer()
    dec = SpeculativeDecoder(target, prop, k=3)
    ref = SpeculativeDecoder(target, None).generate(prompts, max_new_tokens=40).sequences
    res = dec.generate(prompts, max_new_tokens=40)
    assert res.sequences == ref
    assert dec.runner.K.shape[1] < len(prompts)  # the cache was cut down to the rows still running
    assert res.stats["tree_rounds"] > 0 if tree else res.stats["tree_rounds"] == 0


def test_a_row_left_alone_after_a_longer_one_finished_decodes_as_in_the_batch(target):
    """Plain decoding: once the longer row of two stops at EOS the target computes the shorter one alone, over
    an attended length that still counts the longer row; it must see only its own slots, so its tokens equal a
    chain verify's (k=3, masked) from the same prefill."""
    prompts = [PROMPTS[0] * 3, PROMPTS[1]]  # the shorter row's slots past its prompt hold its padded prefill's K/V
    free = SpeculativeDecoder(target, None).generate(prompts, max_new_tokens=40).sequences
    eos = next(t for t in free[0] if t not in free[1])  # ends row 0 early, never row 1
    plain = SpeculativeDecoder(target, None)
    got = plain.generate(prompts, max_new_tokens=40, eos_token_id=eos).sequences
    assert len(got[0]) < 40 and len(got[1]) == 40 and plain.runner.K.shape[1] == 1  # row 1 ran alone
    ref = SpeculativeDecoder(target, NgramProposer(), k=3).generate(prompts, max_new_tokens=40, eos_token_id=eos)
    assert got == ref.sequences


# ---------------------------------------------------------------- the k="auto" controller alone

def _run(ctl, rounds, plain_s, spec_s, tokens=1.0, alpha=0.8, c=0.1, accept_s=0.0):
    """Drive `ctl` for `rounds` rounds with synthetic timings: a plain round yields 1 token in
    plain_s, a speculative round of K yields 1 + alpha K tokens (rounded) in spec_s, the proposer's
    accept costs accept_s. -> the choices made."""
    for _ in range(rounds):
        k = ctl.choose(alpha, c, measured=ctl.spec_rounds > 0)
        n = 1 if k == 0 else round(tokens + alpha * k)
        ctl.observe(k, plain_s if k == 0 else spec_s, [n - 1])
        if k > 0:
            ctl.charge(accept_s)
    return ctl.choices


def _geo(a, k):
    return sum(a ** i for i in range(k + 1))


def _geo_rows(alpha, k, rows):
    """Each row's drafts accepted in a round of K, as the geometric model has them: about rows * alpha^j of
    the rows accept position j."""
    return [sum(i < round(rows * alpha ** j) for j in range(1, k + 1)) for i in range(rows)]


def _machine(ctl, rounds, plain_s, draft_s, alpha, rows=16):
    """A machine where a round of K costs plain_s + K draft_s (the verify grows with the drafts, as at
    larger batches) and yields each of `rows` rows the geometric model's tokens at alpha."""
    for _ in range(rounds):
        k = ctl.choose(alpha, 0.1, measured=ctl.spec_rounds > 0)
        acc = _geo_rows(alpha, k, rows)
        ctl.observe(k, plain_s + k * draft_s, acc)
    return ctl.choices


def _true_best(plain_s, draft_s, alpha, k_max=K_MAX_AUTO):
    return max(range(k_max + 1), key=lambda k: _geo(alpha, k) / (plain_s + k * draft_s))


def test_k_auto_warms_a_larger_batch_at_the_k_a_smaller_one_settled_on(target, monkeypatch):
    """A useless draft settles off at batch 1, so batch 2 warms up at K = 1, not K_WARMUP (a verify only gets
    dearer with the batch); a decoder with no smaller batch measured still warms up at K_WARMUP."""
    monkeypatch.setattr(D, "PROBE_EVERY", 4)
    useless = lambda: EagleProposer(EagleHead.from_target(target, draft_ids=torch.tensor([V - 1, V - 2])), target)
    dec = SpeculativeDecoder(target, useless(), k="auto")
    dec.generate([PROMPTS[0]], max_new_tokens=40)
    assert dec.controllers[1].settled() == 0
    warm = slice(D.WARMUP_PLAIN, D.WARMUP_PLAIN + 2)
    assert dec.generate(PROMPTS[:2], max_new_tokens=20).stats["k_choices"][warm] == [1, 1]
    fresh = SpeculativeDecoder(target, useless(), k="auto").generate(PROMPTS[:2], max_new_tokens=20)
    assert fresh.stats["k_choices"][warm] == [D.K_WARMUP] * 2


def test_a_draft_that_never_accepts_stays_off_when_its_rounds_time_faster_than_plain():
    """Under load a speculative round can be timed below a plain step; with nothing accepted it must still lose
    (its round does a plain step's work and more), or the controller speculates for nothing."""
    ctl = KController(k_max=4, warmup=3, k_warmup=1, probe_every=8)
    ks = _run(ctl, 40, plain_s=0.010, spec_s=0.009, tokens=1.0, alpha=0.0)
    assert ks[:5] == [0, 0, 0, 1, 1]  # the warm-up measured K = 1
    assert ctl.settled() == 0 and ks[-8:].count(0) >= 7, ks  # off, but for a probe


def test_controller_warms_up_plain_then_measures_at_k_warmup():
    ctl = KController(k_max=8, warmup=3, k_warmup=4, probe_every=16)
    ks = _run(ctl, 5, plain_s=0.010, spec_s=0.012)
    assert ks == [0, 0, 0, 4, 4] and ctl.expected_speedup is None
    two = 1 + KController.DECAY  # the weight of two rounds: the first round (after prefill) is left out
    assert ctl.arms[0] == pytest.approx([two, 0.010 * two, 0])
    assert ctl.arms[4] == pytest.approx([two, 0.012 * two, 0]) and set(ctl.arms) == {0, 4}
    assert ctl._tokens(4, 0.8) == pytest.approx(round(1 + 0.8 * 4)) and ctl._tokens(0, 0.8) == 1.0
    assert ctl.warm_choices == 5


@pytest.mark.parametrize("draft_s,alpha", [(0.0005, 0.8), (0.005, 0.6), (0.002, 0.7), (0.02, 0.5)])
def test_controller_settles_on_the_k_this_machine_serves_fastest(draft_s, alpha):
    """Cheap drafts (batch 1 on CPU) get a long K; drafts whose verify grows (a large batch) a short one,
    or none: the K most chosen after warm-up serves within 2% of the true best (K = 0 included), and the
    controller's throughput over its rounds is within 5% of the best K's."""
    def rate(k):
        return _geo(alpha, k) / (0.010 + k * draft_s)
    best = _true_best(0.010, draft_s, alpha)
    ks = _machine(KController(), 200, plain_s=0.010, draft_s=draft_s, alpha=alpha)[D.WARMUP_PLAIN + 2:]
    top = max(set(ks), key=ks.count)
    assert rate(top) >= 0.98 * rate(best) and (top == 0) == (best == 0), (best, ks[-20:])
    got = sum(_geo(alpha, k) for k in ks) / sum(0.010 + k * draft_s for k in ks)
    assert got >= 0.95 * rate(best)
    assert best == 0 or draft_s < 0.02  # the cases span both sides of the on/off line


def test_controller_pools_each_positions_acceptance_over_every_round():
    """One round at K=4 scores every shorter K by what it would have accepted there (min(a, K') for a
    chain); a position never proposed takes alpha_hat; a lookup's depth past K counts at that K."""
    ctl = KController(k_max=8)
    acc = [0, 1, 4, 3]
    ctl.observe(4, 0.010, acc)
    for k in range(1, 5):
        assert ctl._tokens(k, 0.5) == pytest.approx(sum(min(a, k) + 1 for a in acc) / len(acc))
    assert ctl._tokens(6, 0.5) == pytest.approx(ctl._tokens(4, 0.5) + 0.25 * 0.5 + 0.25 * 0.5 ** 2)
    ctl.observe(2, 0.010, [5, 0])  # timed (the call's second round): a lookup ran 3 past K=2 in one row
    d = KController.POOL_DECAY  # the older round's counts weigh d: position 1 reached 4d + 2, accepted 3d + 1
    s1 = (3 * d + 1) / (4 * d + 2)
    assert ctl.arms[2][2] == pytest.approx(1.5)
    assert ctl._tokens(2, 0.5) == pytest.approx(1 + s1 + s1 * (2 * d + 1) / (3 * d + 1) + 1.5)


def _regimes(ctl, rounds, plain_s, draft_s, alphas, block, rows):
    """_machine with text whose predictability changes every `block` rounds (alphas in turn) -> the
    controller's tokens a row per second."""
    tokens = seconds = 0.0
    for r in range(rounds):
        k = ctl.choose(0.6, 0.1, measured=ctl.spec_rounds > 0)
        acc = _geo_rows(alphas[(r // block) % len(alphas)], k, rows)
        ctl.observe(k, plain_s + k * draft_s, acc)
        tokens, seconds = tokens + sum(a + 1 for a in acc) / rows, seconds + plain_s + k * draft_s
    return tokens / seconds


@pytest.mark.parametrize("draft_s,alphas,block,rows", [(0.003, (0.9, 0.3), 7, 4), (0.002, (0.95, 0.2), 5, 4),
                                                        (0.004, (0.85, 0.4), 3, 16), (0.001, (0.9, 0.5, 0.2), 4, 1)])
def test_controller_keeps_up_with_the_best_fixed_k_when_the_text_changes(draft_s, alphas, block, rows):
    """Easy and hard stretches of text in turn: a K scored only on its own few rounds (its probes fall in
    one kind of stretch) settles on a K up to 13% slower than the best fixed one; pooled over every round,
    the controller serves within 4% of it."""
    def fixed(k):
        return sum(_geo(a, k) for a in alphas) / len(alphas) / (0.010 + k * draft_s)
    best = max(range(K_MAX_AUTO + 1), key=fixed)
    assert _regimes(KController(), 400, 0.010, draft_s, alphas, block, rows) >= 0.96 * fixed(best), best


def _stalled(ctl, rounds, draft_s, alpha, rows, stall_p, stall_x, seed):
    """_machine (plain step 10 ms) where a round stalls `stall_x`-fold with chance `stall_p` (a busy host) -> the
    controller's tokens a row per second, stalls included."""
    rng, tokens, seconds = random.Random(seed), 0.0, 0.0
    for _ in range(rounds):
        k = ctl.choose(alpha, 0.1, measured=ctl.spec_rounds > 0, rows=rows)
        acc = _geo_rows(alpha, k, rows)
        s = (0.010 + k * draft_s) * (stall_x if rng.random() < stall_p else 1.0)
        ctl.observe(k, s, acc)
        tokens, seconds = tokens + sum(a + 1 for a in acc) / rows, seconds + s
    return tokens / seconds


@pytest.mark.parametrize("draft_s,alpha,stall_p,stall_x", [(0.008, 0.5, 0.02, 5), (0.002, 0.6, 0.05, 3)])
def test_a_stalled_round_does_not_turn_the_controller(draft_s, alpha, stall_p, stall_x, monkeypatch):
    """32 rows, rounds that now and then take 3-5x their time. Where speculation loses, a stalled plain step
    priced unclipped made drafts look cheap (0.82x plain decoding over 8 seeds); where K = 2 pays 1.4x, a stalled
    round priced it out (0.89x the best K). Counted at STALL_CLIP times its K's price, the controller keeps within
    7% of the best fixed K (plain included); with the clip off, the same seeds must fall under that."""
    def fixed(k):
        return _geo(alpha, k) / (0.010 + k * draft_s) / (1 + (stall_x - 1) * stall_p)
    best = fixed(max(range(K_MAX_AUTO + 1), key=fixed))
    runs = lambda: sum(_stalled(KController(), 300, draft_s, alpha, 32, stall_p, stall_x, s) for s in range(8)) / 8
    assert runs() >= 0.93 * best
    monkeypatch.setattr(D, "STALL_CLIP", float("inf"))
    assert runs() < 0.93 * best


def _full_then_few(calls: int, rounds: int, full: int) -> list[tuple[list[int], list[int]]]:
    """A machine where speculation loses with 32 rows computed (a drafted token costs 60% of a step) and wins
    with 6 (5%): each of `calls` calls runs `full` rounds of 32 rows, then the rest of its `rounds` with 6 (its
    finished rows left). -> per call, the K chosen in its full-batch rounds and in its few-row tail."""
    def round_s(k, rows):
        return (0.004 + 0.0008 * rows) * (1 + k * (0.6 if rows > 8 else 0.05))

    ctl, phases = KController(), []
    for call in range(calls):
        if call:
            ctl.next_call()
        for r in range(rounds):
            rows = 32 if r < full else 6
            k = ctl.choose(0.5, 0.1, measured=ctl.spec_rounds > 0, rows=rows)
            ctl.observe(k, round_s(k, rows), _geo_rows(0.5, k, rows))
        phases.append((ctl.choices[:full], ctl.choices[full:]))
    assert ctl.settled() == 0  # the whole batch's band: what the report recommends for 32 rows
    return phases


def test_controller_scores_seconds_per_band_of_computed_rows():
    """Finished rows leave the target's forward, so a call's later rounds cost less at every K. Rounds priced at
    6 rows must not be read as the price at 32: each call's full-batch rounds settle off, its few-row rounds
    speculate."""
    for full, few in _full_then_few(4, 60, 30)[1:]:  # later calls: the full batch's rounds past their probes run plain
        assert sum(k > 0 for k in full[5:]) <= 3, full
        assert sum(k > 0 for k in few) >= 25, few


def test_a_few_row_tail_does_not_restart_the_full_batchs_probe_wait():
    """Each call ends with a few rows, where speculation pays, after many full-batch rounds, where it loses.
    One probe wait for all bands let each tail restart it, so every call probed the full batch at 16, 32 and 64
    rounds again (3 losing probes a call; 4-6 a batch-16 call on the AVX2 EPYC: docs/reference/k-auto.md);
    a band's own wait keeps doubling across calls, to one probe per PROBE_BACKOFF * PROBE_EVERY rounds."""
    phases = _full_then_few(8, 120, 110)
    assert all(sum(k > 0 for k in few) >= 8 for _, few in phases)  # the tails speculate
    assert all(sum(k > 0 for k in full) <= 1 for full, _ in phases[2:]), phases


def test_losing_probes_back_off_to_a_bounded_wait():
    """Speculation always loses (a drafted token costs 0.6 of a step for 0.3 accepted): each losing probe doubles
    the wait before the next, up to PROBE_BACKOFF * PROBE_EVERY rounds, so speculation is still tried that
    often however long the call runs (text may turn easy later); an unbounded doubling would probe ~never."""
    ks = _machine(KController(), 3000, plain_s=0.010, draft_s=0.006, alpha=0.3)
    starts = [r for r in range(1000, 3000) if ks[r] > 0 and ks[r - 1] == 0]  # probes begun, long after warm-up
    cap = D.PROBE_BACKOFF * D.PROBE_EVERY
    assert 2000 // cap - 2 <= len(starts) <= 2000 // cap + 2, (len(starts), cap)
    assert sum(k > 0 for k in ks[1000:]) <= 3 * len(starts)  # each probe is short: the rounds stay plain


def test_a_band_met_later_prices_a_k_not_run_there_as_its_timed_k_moved():
    """Speculation loses at 16 rows and at 12 alike (a drafted token costs 60% of a step). Off at 16 rows,
    the controller meets 12 rows (finished rows leave) and probes K = 1 there: priced against the plain step's
    16-row cost it carried in, the cheaper 12-row round looked like a win and speculation stayed on; priced
    against that cost scaled as K = 1's moved, it stays off but for its probes."""
    def round_s(k, rows):
        return (0.004 + 0.002 * rows) * (1 + 0.6 * k)

    ctl = KController(probe_every=8)
    for r in range(120):
        rows = 16 if r < 40 else 12
        k = ctl.choose(0.5, 0.1, measured=ctl.spec_rounds > 0, rows=rows)
        ctl.observe(k, round_s(k, rows), _geo_rows(0.5, k, rows))
    few = ctl.choices[40:]
    assert sum(k > 0 for k in few) <= 8, few
    assert ctl._price(0) == pytest.approx(round_s(0, 12), rel=1e-6)  # plain then ran at 12 rows and was timed


def test_controller_retimes_plain_when_the_machine_speeds_up_while_it_speculates():
    """A plain step's price goes stale while speculation runs. K = 1 pays at first (8 rows, 1.9 tokens a row in
    1.8 plain steps); then the machine runs 1.25x faster and the text gets harder (1.6 tokens a row): K = 1 now
    loses 10%, but against plain's old price it looked up to 1.18x and ran every remaining round (0.89x plain's rate).
    Re-timing plain near break-even turns it off; with AGE at 1, the re-timed price moved too slowly (11% of the
    rounds at K = 1, 0.98x)."""
    ctl, rows = KController(), 8
    made = spent = 0.0
    for r in range(400):
        speed, alpha = (1.0, 0.9) if r < 80 else (0.8, 0.6)
        k = ctl.choose(alpha, 0.1, measured=ctl.spec_rounds > 0, rows=rows)
        acc = _geo_rows(alpha, k, rows)
        ctl.observe(k, speed * (0.032 + 0.026 * k), acc)
        if r >= 120:
            made, spent = made + sum(a + 1 for a in acc) / rows, spent + speed * (0.032 + 0.026 * k)
    assert 1 in ctl.choices[40:80]  # on while it paid
    assert sum(k > 0 for k in ctl.choices[120:]) <= 0.05 * 280, ctl.choices[120:]
    assert made / spent >= 0.99 / (0.8 * 0.032)  # within 1% of plain decoding's rate


def _resyncing_run(resync_s: float, rounds: int = 600) -> tuple[KController, float]:
    """8 rows where speculation pays 1.17x plain all along (at K = 3), with each return to it after a plain step
    charged `resync_s`, as the decoder does (-> the controller, the rate from round 100 over plain's)."""
    ctl, rows, synced = KController(), 8, True
    made = spent = 0.0
    for r in range(rounds):
        k = ctl.choose(0.9, 0.1, measured=ctl.spec_rounds > 0, rows=rows)
        if k > 0 and not synced:
            ctl.charge(resync_s, resync=True)
            spent, synced = spent + resync_s * (r >= 100), True
        acc = _geo_rows(0.9, k, rows)
        ctl.observe(k, 0.032 + 0.020 * k, acc)
        synced = synced and k > 0
        if r >= 100:
            made, spent = made + sum(a + 1 for a in acc) / rows, spent + 0.032 + 0.020 * k
    return ctl, made / spent * 0.032


def _static_batch(ctl, accepts, new_tokens=128, calls=3) -> tuple[float, float, list[int]]:
    """Drive `ctl` through `calls` static batches, as the decoder does: each row runs until it made `new_tokens`,
    a round prices every row still running (a plain step 10 ms + 0.25 ms a row, a round of K 10 ms + (0.25 +
    0.6 K) ms a row), and row b accepts accepts(b, k, round) of its K drafts. -> (the last call's seconds, plain
    decoding's, its choices)."""
    def price(k, rows):
        return 0.010 + (0.00025 + 0.0006 * k) * rows
    rows = 16
    for call in range(calls):
        if call:
            ctl.next_call()
        left, spent, r = {b: new_tokens for b in range(rows)}, 0.0, 0
        while left:
            k = ctl.choose(0.9, 0.1, measured=ctl.spec_rounds > 0, rows=len(left), remaining=dict(left))
            run = sorted(left)
            acc = [min(accepts(b, k, r), k) for b in run]
            ctl.observe(k, price(k, len(run)), acc, rows=run)
            spent, r = spent + price(k, len(run)), r + 1
            for b, a in zip(run, acc):
                left[b] -= min(a + 1, left[b])
                if not left[b]:
                    del left[b]
    return spent, new_tokens * price(0, rows), ctl.choices


def test_controller_paces_a_static_batch_by_the_row_that_finishes_last():
    """A batch ends with its last row. Sixteen rows of which one never accepts a draft: speculation makes the
    other fifteen finish early and leaves that row to finish alone, so the batch takes longer than plain steps
    would, while the rows' mean acceptance says K = 2 pays 1.2x. Speculation goes off once the rows ran
    LAGGARD_ROUNDS speculative rounds, and later calls start from how far apart the rows were (the figures:
    docs/reference/k-auto.md). The same acceptance spread over the rows, a different row missing each round,
    keeps it on."""
    one_lags, plain, choices = _static_batch(KController(), lambda b, k, r: 0 if b == 0 else 2)
    assert one_lags <= 1.04 * plain and choices.count(0) >= 0.9 * len(choices)
    spread, plain, choices = _static_batch(KController(), lambda b, k, r: 0 if b == r % 16 else 2)
    assert spread <= plain / 1.15 and choices.count(0) <= 0.1 * len(choices)


def test_controller_retimes_plain_only_where_speculation_repays_the_resync():
    """A plain step in the middle of speculation costs the proposer's resync after it. Where K's gain until the
    next such step repays it, plain is re-timed and speculation goes straight back on; where it does not (a
    0.4 s resync), the lower probe stays K - 1: retimed-plain-1 turned K off there after a re-timing step (0.95x)."""
    cheap, rate = _resyncing_run(0.002)
    assert 0 in cheap.choices[100:] and rate >= 1.12  # re-timed, and back on each time
    dear, rate = _resyncing_run(0.4)
    assert 0 not in dear.choices[100:] and rate >= 1.15


def test_controller_turns_off_when_speculation_loses_and_probes_back():
    ctl = KController(k_max=8, warmup=3, k_warmup=4, probe_every=4)
    ks = _run(ctl, 5 + 40, plain_s=0.010, spec_s=0.100, alpha=0.8, c=0.1)  # 10x slower rounds: a loss
    assert ks[:5] == [0, 0, 0, 4, 4]
    off = ks[5:]
    probes = [i for i, k in enumerate(off) if k > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # each losing probe waits longer
    assert ctl.expected_speedup < 1 and ctl.off_rounds == len(off)


def test_controller_charges_speculation_for_the_proposers_accept():
    """Rounds that win alone lose once the proposer's accept() time counts against them."""
    win = _run(KController(probe_every=16), 10, plain_s=0.010, spec_s=0.012)
    lose = _run(KController(probe_every=16), 10, plain_s=0.010, spec_s=0.012, accept_s=0.1)
    assert 0 not in win[D.WARMUP_PLAIN:] and lose[D.WARMUP_PLAIN + 2:] == [0] * (10 - D.WARMUP_PLAIN - 2)


def test_the_untimed_first_round_of_a_call_is_not_charged_its_accept():
    """A call's first round is left out of the timings (it runs slow after the prefill): the proposer's accept()
    after it is left out too, else that K's price rises by time its rounds were never measured with."""
    ctl = KController()
    for _ in range(2):  # the first call: its second round is timed
        ctl.observe(2, 0.02, [1])
    before = list(ctl.arms[2])
    ctl.next_call()
    ctl.observe(2, 0.5, [1])  # the next call's first round: untimed
    ctl.charge(1.0)
    assert ctl.arms[2] == before
    ctl.observe(2, 0.02, [1])
    ctl.charge(1.0)  # a timed round's accept() is its cost
    assert ctl.arms[2][1] > before[1] + 1.0


def test_controller_turns_back_on_only_when_it_repays_the_resync():
    """Turning speculation back on re-prefills the proposer: K goes back on only when what it saves over the
    next probe_every rounds exceeds the resync's measured cost."""
    ctl = KController(k_max=8, warmup=3, k_warmup=4, probe_every=16)
    _run(ctl, 5, plain_s=0.010, spec_s=0.012)  # K=4: 4 tokens in 12 ms, 3.3x plain's rate
    ctl.choose(0.8, 0.1)
    ctl.observe(0, 0.010, [0])  # a plain round: the proposer is behind
    ctl.charge(10.0, resync=True)  # a resync dearer than 16 rounds save (~0.45 s)
    assert ctl.choose(0.8, 0.1) == 0
    ctl.resync_s = 0.001
    assert ctl.choose(0.8, 0.1) > 0


def test_k_auto_keeps_what_it_measured_across_calls(target, draft):
    """A second call at the same batch size starts from the first call's scores: no warm-up again, output exact."""
    dec = SpeculativeDecoder(target, DraftLMProposer(draft, V), k="auto")
    ref = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences
    assert dec.generate(PROMPTS, max_new_tokens=N_NEW).sequences == ref
    ctl = dec.controllers[len(PROMPTS)]
    assert ctl.ready and ctl.arms
    res = dec.generate(PROMPTS, max_new_tokens=N_NEW)
    assert res.sequences == ref and dec.controllers[len(PROMPTS)] is ctl and len(dec.controllers) == 1
    assert len(res.stats["k_choices"]) == res.stats["rounds"]
    assert res.stats["k_choices"][:D.WARMUP_PLAIN + 2] != [0] * D.WARMUP_PLAIN + [D.K_WARMUP] * 2


def test_k_auto_scores_the_k_it_chose_not_the_trees_depth(target, draft, monkeypatch):
    """A hybrid's lookups (k_ngram=6) run deeper than the K chosen: the round is scored under that K, so a K's
    score is what choosing it gave, not the rounds where the text happened to repeat."""
    class AlwaysOne(KController):
        def choose(self, alpha_hat, c, measured=True, rows=1, remaining=None):
            return self._pick(1)
    monkeypatch.setattr(D, "KController", AlwaysOne)
    dec = SpeculativeDecoder(target, HybridProposer(DraftLMProposer(draft, V), min_match=1, k_ngram=6), k="auto")
    depths, tree_round = [], dec._tree_round

    def recorded(s, k):
        r = tree_round(s, k)
        depths.append(r.k)
        return r
    monkeypatch.setattr(dec, "_tree_round", recorded)
    ref = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences
    assert dec.generate(PROMPTS, max_new_tokens=N_NEW).sequences == ref
    assert max(depths) > 1 and set(dec.controllers[len(PROMPTS)].arms) == {1}


def test_controller_without_plain_timings_trusts_the_model():
    """No plain round measured yet (warmup=1: only the untimed first one): best_k's own estimate decides."""
    ctl = KController(k_max=8, warmup=1, k_warmup=4, probe_every=16)
    _run(ctl, 4, plain_s=0.010, spec_s=1.0, alpha=0.8, c=0.1)
    assert 0 not in ctl.arms and ctl.choices[-1] == best_k(0.8, 0.1, 8)[0]
    assert ctl.expected_speedup == best_k(0.8, 0.1, 8)[1]


def test_best_k():
    assert best_k(0.9, 0.05)[0] >= 5
    k, v = best_k(0.05, 0.5)
    assert v < 1
    assert best_k(0.6, 0.0, 8)[0] == 8


def test_load_proposer(tmp_path, target, draft):
    assert isinstance(load_proposer("ngram", target), NgramProposer)
    EagleHead.from_target(target).save(tmp_path / "e")
    assert isinstance(load_proposer(str(tmp_path / "e"), target), EagleProposer)
    draft.save_pretrained(tmp_path / "d")
    (tmp_path / "d" / "draftsmith_draft.json").write_text('{"kind": "draft_lm"}')
    p = load_proposer(tmp_path / "d", target)
    assert isinstance(p, DraftLMProposer)
    res = SpeculativeDecoder(target, p, k=2).generate([PROMPTS[0]], max_new_tokens=6)
    assert len(res.sequences[0]) == 6


def test_hf_fallback_batch1_exact(target, hf_ref):
    dec = SpeculativeDecoder(target, DraftLMProposer(target, V), k=3, lean=False)
    assert dec.generate([PROMPTS[1]], max_new_tokens=N_NEW).sequences == [hf_ref[1]]


def test_compare_greedy(target, hf_ref):
    from eval.exactness import compare_greedy

    rep = compare_greedy(target, PROMPTS, hf_ref, [list(r) for r in hf_ref])
    assert rep["exact"] and rep["match_rate"] == 1.0 and rep["divergences"] == [] and rep["all_near_ties"]
    b = [list(r) for r in hf_ref]
    b[1][4] = (b[1][4] + 1) % V  # diverge at position 4 of prompt 1
    b[2] = b[2][:10]  # shorter, no differing token
    rep = compare_greedy(target, PROMPTS, hf_ref, b, tol=1e9)
    assert not rep["exact"] and rep["all_near_ties"]
    d = {x["prompt_index"]: x for x in rep["divergences"]}
    assert d[1]["position"] == 4 and d[1]["token_a"] == hf_ref[1][4] and d[1]["token_b"] == b[1][4]
    assert d[2]["position"] == 10 and d[2]["token_b"] is None
    with torch.no_grad():
        top = torch.topk(target(torch.tensor([PROMPTS[1] + hf_ref[1][:4]])).logits[0, -1], 2).values
    assert abs(d[1]["margin"] - float(top[0] - top[1])) < 1e-5 and d[1]["margin"] > 0
    assert rep["match_rate"] == (N_NEW * 2 + 4 + 10) / (N_NEW * 4)
    assert not compare_greedy(target, PROMPTS, hf_ref, b, tol=0.0)["all_near_ties"]


def test_stats_keys(target, draft):
    dec = SpeculativeDecoder(target, DraftLMProposer(draft, V), k=3)
    t0 = time.perf_counter()
    res = dec.generate(PROMPTS, max_new_tokens=8)
    outside = time.perf_counter() - t0
    s = res.stats
    for key in ("alpha", "tau", "accept_per_pos", "accept_len_hist", "proposed", "accepted", "target_forwards",
                "n_tokens", "wall_s", "tokens_per_s", "draft_time_s", "verify_time_s", "c", "predicted_speedup",
                "k", "peak_mem_bytes"):
        assert key in s, key
    assert s["n_tokens"] == sum(len(x) for x in res.sequences) == 8 * len(PROMPTS)
    assert sum(s["accept_len_hist"]) * 3 == s["proposed"] and s["c"] > 0 and s["peak_mem_bytes"] > 0
    assert s["tokens_per_s"] == pytest.approx(s["n_tokens"] / s["wall_s"]) and s["k"] == 3
    assert s["alpha"] == pytest.approx(s["accepted"] / s["proposed"])
    # the call's time, timed from outside, splits into the prefill, the proposer's, the target's forwards (inside
    # the verify's time) and the decoder's own work
    assert 0 < s["forward_time_s"] < s["verify_time_s"] and s["host_ms_per_round"] > 0
    parts = s["prefill_s"] + s["draft_time_s"] + s["forward_time_s"] + s["host_ms_per_round"] * s["rounds"] / 1e3
    assert s["wall_s"] <= outside and parts == pytest.approx(s["wall_s"], rel=1e-6)


def test_hybrid_uses_both_sources_and_keeps_the_model_in_sync(target, hf_ref):
    """With the target as the model draft, every model proposal must still be accepted after n-gram
    rounds: that only holds if the model's cache saw every verified token."""
    # chains (sampling's layout): the lookup where it matches, the model elsewhere
    hyb = HybridProposer(DraftLMProposer(target, V), min_match=1)
    res = SpeculativeDecoder(target, hyb, k=3, tree=False).generate([PROMPTS[0]], max_new_tokens=N_NEW)
    assert res.sequences == [hf_ref[0]]
    assert hyb.from_ngram > 0 and hyb.from_model > 0
    model_only = HybridProposer(DraftLMProposer(target, V), min_match=99)  # lookup never matches
    res = SpeculativeDecoder(target, model_only, k=3, tree=False).generate([PROMPTS[0]], max_new_tokens=N_NEW)
    assert res.stats["alpha_hat"] == 1.0 and model_only.from_ngram == 0
    # trees (greedy): the model's chain is in every tree, so every round accepts at least k = 3,
    # whichever branch the path took in the rounds before
    for prompts in ([PROMPTS[0]], PROMPTS):
        hyb = HybridProposer(DraftLMProposer(target, V), min_match=1, k_ngram=5, max_nodes=64)  # room for all
        res = SpeculativeDecoder(target, hyb, k=3).generate(prompts, max_new_tokens=N_NEW)
        assert res.sequences == hf_ref[: len(prompts)]
        assert sum(res.stats["accept_len_hist"][:3]) == 0, res.stats["accept_len_hist"]
