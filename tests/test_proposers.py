"""The proposer package's public interface (eval/proposers/): the documented names import from one place,
every proposer declares the optional abilities it has (the decoder reads them, never probes), and the
hybrid tells its model when a round's drafts were not the model's."""

import torch

import eval.proposers as P
from eval.decoder import SpeculativeDecoder
from helpers import N_NEW, PROMPTS, decoder_llama

PUBLIC = ["Proposer", "Sampling", "NoDraft", "NgramProposer", "DraftLMProposer", "EagleProposer", "MedusaProposer",
          "HybridProposer", "load_proposer", "serve_with", "to_target_vocab", "SERVED_AS", "SERVE_KEYS"]
PROPOSERS = [P.NgramProposer, P.NoDraft, P.DraftLMProposer, P.EagleProposer, P.MedusaProposer, P.HybridProposer]


def test_public_names_import_from_the_package():
    from eval import draft_dir

    assert all(hasattr(P, n) for n in PUBLIC), [n for n in PUBLIC if not hasattr(P, n)]
    assert P.SERVED_AS is draft_dir.SERVED_AS and P.SERVE_KEYS is draft_dir.SERVE_KEYS


def test_declared_abilities_match_what_each_proposer_implements():
    for cls in PROPOSERS:
        assert issubclass(cls, P.Proposer)
        assert cls.trees == (cls.propose_tree is not P.Proposer.propose_tree), cls
        assert cls.has_alternatives == (cls.alternatives is not P.Proposer.alternatives), cls
    assert [c.name for c in PROPOSERS] == ["ngram", "none", "draft_lm", "eagle", "medusa", "hybrid"]
    assert P.EagleProposer.uses_features and P.MedusaProposer.uses_features and not P.DraftLMProposer.uses_features


def test_hybrid_tells_a_draft_lm_its_drafts_were_replaced(one_thread):
    """A hybrid over a draft LM: every tree round holds lookups, so the draft must feed all verified
    tokens in accept() (drafted_elsewhere), and greedy output equals plain decoding."""
    target, draft = decoder_llama(0), decoder_llama(1, layers=1)
    calls = []
    model = P.DraftLMProposer(draft, target.config.vocab_size)
    model.drafted_elsewhere = lambda: (calls.append(1), P.DraftLMProposer.drafted_elsewhere(model))
    ref = SpeculativeDecoder(target, None).generate(PROMPTS, max_new_tokens=N_NEW).sequences
    res = SpeculativeDecoder(target, P.HybridProposer(model), k=3).generate(PROMPTS, max_new_tokens=N_NEW)
    assert res.sequences == ref
    assert len(calls) >= res.stats["tree_rounds"] > 0
    assert P.NgramProposer().drafted_elsewhere() is None  # the default: nothing to do


def test_draw_and_to_target_vocab():
    d2t = torch.tensor([4, 1, 7])
    logits = torch.tensor([[0.0, 2.0, 1.0]])  # [1, Vd]
    full = P.to_target_vocab(logits, d2t, 9)  # [1, V]
    assert full.shape == (1, 9) and full[0, [4, 1, 7]].tolist() == [0.0, 2.0, 1.0]
    assert torch.isinf(full[0, [0, 2, 3, 5, 6, 8]]).all()
    tok, q = P.draw(full, P.Sampling())
    assert tok.tolist() == [1] and q is None
    tok, q = P.draw(full, P.Sampling(1.0, generator=torch.Generator().manual_seed(0)))
    assert int(tok) in (4, 1, 7) and q[0, [0, 2, 3, 5, 6, 8]].eq(0).all() and torch.isclose(q.sum(), torch.tensor(1.0))
