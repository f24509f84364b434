"""The offline replay (eval/replay.py) against the decoder itself (fp32, tiny models): for chains and
token trees, with EOS and max_new_tokens stopping, the replayed rounds are the decoder's, round for
round, so τ figures and tree-policy rankings made with it are the decoder's too."""

import statistics

import pytest
import torch

from eval.decoder import SpeculativeDecoder
from eval.heads import MedusaHeads
from eval.proposers import MedusaProposer
from eval.proposers import DraftLMProposer, HybridProposer, NgramProposer
from eval.replay import Reference, fit_budget, reference, replay, settings, verify_ms
from helpers import PROMPTS, DECODER_V as V, decoder_llama as tiny

pytestmark = pytest.mark.usefixtures("one_thread")
N_NEW = 20


@pytest.fixture(scope="module")
def target():
    return tiny(0)


def _heads(target):
    torch.manual_seed(3)
    heads = MedusaHeads.from_target(target, num_heads=3, draft_ids=torch.arange(V), recurrent=True)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # not the identity: the heads propose something of their own
    return heads.eval()


def _near_copy():
    """The target with its weights perturbed: a draft LM that agrees with it often, not always."""
    torch.manual_seed(4)
    d = tiny(0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return d


PROPOSERS = {
    "ngram chain": (lambda t: NgramProposer(), 3),
    "draft LM chain": (lambda t: DraftLMProposer(_near_copy(), V), 3),
    "medusa + ngram tree": (lambda t: HybridProposer(MedusaProposer(_heads(t), t)), 2),
    "medusa + ngram tree, 6 nodes, K=3": (lambda t: HybridProposer(MedusaProposer(_heads(t), t), max_nodes=6), 3),
}


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_replay_gives_the_decoders_rounds(target, name):
    make, k = PROPOSERS[name]
    ref = reference(target, PROMPTS, N_NEW)
    plain = SpeculativeDecoder(target, None, k=1)
    eos = ref.seqs[0][7]  # a token the first output reaches: EOS stops it early
    accepted_any = False
    for i, p in enumerate(PROMPTS):
        assert plain.generate([p], N_NEW + 17).sequences[0] == ref.seqs[i]  # the reference is plain greedy
        res = SpeculativeDecoder(target, make(target), k=k).generate([p], N_NEW, eos_token_id=eos)
        one = Reference([p], [ref.seqs[i]], [ref.feats[i]])
        rep = replay(make(target), one, k, N_NEW, eos={eos})
        assert rep["rounds"] == res.stats["rounds"], (name, i)
        assert rep["tau"] == pytest.approx(res.stats["tau"]), (name, i)
        hist = res.stats["accept_len_hist"]  # [rounds accepting a drafts for a = 0..k_cap]
        assert {a: c for a, c in enumerate(hist) if c} == rep["hist"], (name, i)
        assert rep["first"] == pytest.approx(res.stats["accept_per_pos"][0]), (name, i)
        accepted_any |= any(a > 0 for a in rep["hist"])
    assert accepted_any, f"{name}: no draft accepted anywhere, so the test would not tell"


def test_replay_on_sampled_text_gives_the_decoders_sampled_tau(target):
    """Verifying one-hot children in turn accepts child c with probability p(c), as following the target's
    next sampled token does: a tree of fixed drafts (lookups, the heads' argmax and runner-ups) replayed
    along the target's sampled text accepts as the sampled decoder does, within sampling error; the greedy
    reference does not (it overstates sampled τ). The reference is plain sampled decoding, seed + i."""
    T, n = 0.1, 15
    make = lambda: HybridProposer(MedusaProposer(_heads(target), target), max_nodes=6)
    plain = SpeculativeDecoder(target, None)
    replayed, decoded = [], []
    for seed in range(0, len(PROMPTS) * n, len(PROMPTS)):
        ref = reference(target, PROMPTS, N_NEW, sampling={"temperature": T, "seed": seed})
        if seed == 0:
            assert ref.seqs[1] == plain.generate([PROMPTS[1]], N_NEW + 17, temperature=T, seed=1).sequences[0]
        for i in range(len(PROMPTS)):
            one = Reference([ref.prompts[i]], [ref.seqs[i]], [ref.feats[i]])
            replayed.append(replay(make(), one, 2, N_NEW)["tau"])
        dec = SpeculativeDecoder(target, make(), k=2)
        decoded += [dec.generate([p], N_NEW, temperature=T, seed=10 ** 5 + seed + i).stats["tau"]
                    for i, p in enumerate(PROMPTS)]
    se = (statistics.variance(replayed) / len(replayed) + statistics.variance(decoded) / len(decoded)) ** 0.5
    assert abs(statistics.mean(replayed) - statistics.mean(decoded)) < 4 * se, (replayed, decoded)
    greedy = replay(make(), reference(target, PROMPTS, N_NEW), 2, N_NEW)["tau"]
    assert greedy - statistics.mean(decoded) > 8 * se


def test_replay_estimates_speed_from_verify_costs(target):
    ref = reference(target, PROMPTS[:2], N_NEW)
    costs = verify_ms(target, rows=range(1, 5), context=16, reps=2)
    assert sorted(costs) == [1, 2, 3, 4] and all(v > 0 for v in costs.values())
    flat = {T: 10.0 for T in range(1, 17)}  # verifies as cheap as a plain step: speedup = τ
    rep = replay(NgramProposer(), ref, 3, N_NEW, verify_ms=flat)
    assert rep["est_speedup"] == pytest.approx(rep["tau"]) and rep["est_ms_per_round"] == pytest.approx(10.0)
    rep2 = replay(NgramProposer(), ref, 3, N_NEW, verify_ms=flat, draft_ms=5.0, host_ms=5.0)
    assert rep2["est_speedup"] == pytest.approx(rep["tau"] / 2)  # every round costs twice a plain step


def test_replay_needs_a_long_enough_reference(target):
    ref = Reference([[1, 2, 1, 2]], [[1]], [torch.zeros(4, 48)])  # one greedy token: no bonus after it
    with pytest.raises(ValueError, match="larger `extra`"):
        replay(NgramProposer(), ref, 3, N_NEW)


def test_replay_command_line(tmp_path, capsys):
    """`python -m eval.replay`: one row per configuration on one reference; a bad key is a one-line
    error (exit 2) before anything is decoded."""
    from helpers import save_word_llama, word_tokenizer
    from eval import replay as rp

    tok = word_tokenizer()
    target = save_word_llama(tmp_path / "target", tok)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w1 w2 w3 w1"}\n{"prompt": "w4 w5 w4 w5"}\n')
    base = ["--target", str(target), "--prompts", str(prompts), "--dtype", "float32", "--max-new-tokens", "8",
            "--draft", "ngram", "--k", "3"]
    assert rp.main(base + ["--try", "max_ngram=1", "--try", "k=1,max_ngram=2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "tau" in line]
    assert [r.split(":")[0] for r in rows] == ["K=3 as loaded", "K=3 max_ngram=1", "K=1 max_ngram=2"]
    assert rp.main(base + ["--try", "nodes=4"]) == 2
    assert "has no integer setting 'nodes' (it has: max_ngram, min_ngram)" in capsys.readouterr().err
    assert rp.main(base + ["--set", "name=4"]) == 2  # an attribute, but no setting
    assert "has no integer setting 'name'" in capsys.readouterr().err
    assert rp.main(base + ["--set", "max_ngram"]) == 2
    assert "KEY=INT" in capsys.readouterr().err


def test_settings_are_the_constructor_arguments_kept_as_ints(target):
    hyb = HybridProposer(MedusaProposer(_heads(target), target), max_nodes=6)
    got = settings(hyb)
    assert got["max_nodes"] == 6 and got["alt_branches"] == 3 and got["strong_match"] == 3
    assert not {"lookup_rounds", "from_ngram", "from_model", "datastore", "model"} & set(got)  # counters, objects
    assert settings(NgramProposer(max_ngram=4)) == {"max_ngram": 4, "min_ngram": 1}


def test_replay_can_time_the_proposer_itself(target):
    ref = reference(target, PROMPTS[:2], N_NEW)
    flat = {T: 10.0 for T in range(1, 17)}
    rep = replay(HybridProposer(MedusaProposer(_heads(target), target)), ref, 2, N_NEW, verify_ms=flat, draft_ms=None)
    assert rep["proposer_ms"] > 0  # the heads ran: a real cost, measured
    assert rep["est_ms_per_round"] == pytest.approx(10.0 + rep["proposer_ms"])
    assert rep["est_speedup"] < rep["tau"]


def test_fit_budget_trades_tree_size_against_what_a_node_costs(target):
    """With verifies as cheap as a plain step, the biggest tree (highest τ) wins; when every row costs a
    plain step, the smallest does. The fitted τ per budget is the replay's, i.e. the decoder's."""
    def make():
        return HybridProposer(MedusaProposer(_heads(target), target))

    budgets = [2, 4, 8]
    prompts = PROMPTS[:3]
    flat = fit_budget(target, {"h": make}, prompts, 2, N_NEW, budgets=budgets, costs={T: 1.0 for T in range(1, 10)})
    by = flat["fits"]["h"]["budgets"]
    assert sorted(by) == budgets and by[8]["tau"] > by[2]["tau"]  # more nodes, more accepted
    assert flat["fits"]["h"]["max_nodes"] == max(budgets, key=lambda n: by[n]["est_speedup"])
    for n in budgets:  # each round costs its verify, the proposer's time and the decoder's own work, measured here
        assert by[n]["est_speedup"] == pytest.approx(by[n]["tau"] / (1.0 + flat["host_ms"] + by[n]["proposer_ms"]),
                                                     rel=1e-6)
    assert flat["host_ms"] > 0
    assert flat["context"] == round(sum(map(len, prompts)) / len(prompts) + N_NEW / 2)  # a mid-decode round's cache
    steep = fit_budget(target, {"h": make}, prompts, 2, N_NEW, budgets=budgets,
                       costs={T: 100.0 * T for T in range(1, 10)})
    assert steep["fits"]["h"]["max_nodes"] == 2
    for n in budgets:  # each budget's τ is what the decoder measures with that budget
        res = [SpeculativeDecoder(target, _budget(make(), n), k=2).generate([p], N_NEW) for p in prompts]
        tau = sum(r.stats["tau"] * r.stats["rounds"] for r in res) / sum(r.stats["rounds"] for r in res)
        assert by[n]["tau"] == pytest.approx(tau), n
    with pytest.raises(ValueError, match="positive node counts"):
        fit_budget(target, {"h": make}, prompts, 2, N_NEW, budgets=[0, 4], costs={1: 1.0})


def _budget(proposer, n):
    proposer.max_nodes = n
    return proposer


def test_replay_command_line_feeds_an_aux_layer_draft_its_layers(tmp_path, capsys):
    """A DFlash draft reads the residual streams entering its aux layers, not the final feature: the command's
    reference keeps those (it crashed on a shape mismatch before), and its tau and first-position acceptance
    are the decoder's own on the same prompts. The draft's vocabulary is the two tokens the target writes most,
    so its first drafts are accepted now and then, and which of the two it drafts depends on the features."""
    from collections import Counter

    from transformers import AutoModelForCausalLM

    from eval import replay as rp
    from eval.bench import encode_prompts, load_prompts
    from eval.heads import DFlashHead
    from eval.proposers import load_proposer
    from helpers import save_word_llama, word_tokenizer

    tok = word_tokenizer()
    path = save_word_llama(tmp_path / "target", tok, layers=4)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w1 w2 w3 w1"}\n{"prompt": "w4 w5 w4 w5"}\n')
    ids = encode_prompts(load_prompts(str(prompts), None), tok)
    text = SpeculativeDecoder(target, None).generate(ids, 12).sequences
    vocab = sorted(t for t, _ in Counter(t for seq in text for t in seq).most_common(2))
    torch.manual_seed(0)
    head = DFlashHead.from_target(target, 1, 4, 1, draft_ids=torch.tensor(vocab))  # aux layers (0, 2, 3) of 4
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc", "layers")):
                p.add_(torch.randn_like(p) * 0.1)
    head.save(tmp_path / "draft", extra={"target_config": target.config.to_dict()})
    assert rp.main(["--target", str(path), "--prompts", str(prompts), "--dtype", "float32", "--max-new-tokens", "12",
                    "--draft", str(tmp_path / "draft"), "--k", "3"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "tau" in line)
    dec = SpeculativeDecoder(target, load_proposer(str(tmp_path / "draft"), target), k=3)
    rounds = tokens = 0
    hist = [0] * 4
    for p in ids:
        st = dec.generate([p], 12).stats
        rounds, tokens = rounds + st["rounds"], tokens + st["tau"] * st["rounds"]
        hist = [a + b for a, b in zip(hist, st["accept_len_hist"])]
    first = 1 - hist[0] / sum(hist)
    assert 0 < first < 1, hist  # some first drafts accepted and some not: the figure tells something
    assert f"tau {tokens / rounds:.3f}, first position accepted {first:.3f}" in row, row
