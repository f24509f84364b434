"""The datastore of the target's own outputs (eval/datastore.py): lookups against a brute force,
save/load and bad files, hybrid trees that use it (greedy output still equal to plain decoding), and
the train stage writing it next to every checkpoint."""

import json
import random

import numpy as np
import pytest
import torch

from eval.datastore import FILE, SEP, Datastore, DatastoreError
from eval.decoder import SpeculativeDecoder
from eval.proposers import HybridProposer, NoDraft, Sampling, load_proposer
from helpers import NoChain, N_NEW, PROMPTS, decoder_llama as tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _brute(seqs, h, k, m, max_n, min_n=1):
    """Every occurrence of the longest matching suffix, continuations counted, most frequent first
    (ties: first seen in corpus order)."""
    for n in range(min(max_n, len(h)), min_n - 1, -1):
        counts = {}
        for s in seqs:
            for i in range(n, len(s)):
                if s[i - n:i] == h[-n:]:
                    c = tuple(s[i:i + k])
                    counts[c] = counts.get(c, 0) + 1
        if counts:
            order = sorted(counts, key=lambda c: -counts[c])  # stable: first seen wins ties
            return [(list(c), n) for c in order[:m]]
    return []


def test_candidates_match_brute_force():
    rnd = random.Random(0)
    for _ in range(30):
        seqs = [[rnd.randrange(5) for _ in range(rnd.randrange(1, 30))] for _ in range(rnd.randrange(1, 6))]
        st = Datastore(seqs, max_ngram=3)
        for _ in range(10):
            h = [rnd.randrange(5) for _ in range(rnd.randrange(1, 8))]
            k, m = rnd.randrange(1, 6), rnd.randrange(1, 4)
            assert st.candidates(h, k, m) == _brute(seqs, h, k, m, 3), (seqs, h, k, m)
            assert st.candidates(h, k, m) == _brute(seqs, h, k, m, 3)  # memoised answer is the same


def test_longest_match_first_and_no_crossing_between_sequences():
    st = Datastore([[1, 2, 3, 4, 5], [9, 3, 7], [2, 3, 4, 6]], max_ngram=3)
    assert st.candidates([0, 2, 3], 3, 2) == [([4, 5], 2), ([4, 6], 2)]  # "2 3" beats the 1-token "3"
    assert st.candidates([8, 8, 9, 3], 4, 3) == [([7], 2)]  # the continuation stops at the sequence's end
    assert st.candidates([5], 3, 2) == []  # 5 ends its sequence: nothing follows it
    assert st.candidates([42], 3, 2) == [] and Datastore([]).candidates([1], 3, 2) == []
    assert st.n_tokens == 12
    with pytest.raises(ValueError, match="min_ngram"):
        Datastore([[1]], max_ngram=1, min_ngram=2)


def test_save_load_and_bad_files(tmp_path):
    st = Datastore([[1, 2, 3], [4, 5]])
    st.save(tmp_path)
    back = Datastore.load(tmp_path)
    assert back.flat == [1, 2, 3, SEP, 4, 5, SEP] and back.candidates([1, 2], 2, 1) == [([3], 2)]
    assert Datastore.from_dir(tmp_path / "nowhere") is None
    (tmp_path / FILE).write_bytes(b"not numpy")
    with pytest.raises(DatastoreError, match=f"{FILE} is unreadable.*delete it"):
        Datastore.load(tmp_path)
    np.save(tmp_path / FILE, np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(DatastoreError, match="not a 1-D token-id array"):
        Datastore.load(tmp_path)


def test_hybrid_tree_puts_the_datastore_after_the_model_chain():
    st = Datastore([[7, 8, 20, 21, 22]])
    hyb = HybridProposer(NoChain(), max_nodes=16, datastore=st, k_ngram=3)
    hyb.begin([[1, 2, 3, 7]], torch.tensor([8]), 64, Sampling())  # history ends "7 8": stored 20 21 22 follows
    (toks, parents), = hyb.propose_tree(2)
    assert toks == [0, 0, 20, 21, 22] and parents == [0, 1, 0, 3, 4]
    hyb = HybridProposer(NoChain(), max_nodes=2, datastore=st, k_ngram=3)  # no room left after the chain
    hyb.begin([[1, 2, 3, 7]], torch.tensor([8]), 64, Sampling())
    assert hyb.propose_tree(2) == [([0, 0], [0, 1])]


@pytest.fixture(scope="module")
def target():
    return tiny(0).float()


def test_hybrid_with_datastore_is_exact_and_accepts_more(target):
    """Greedy speculative output equals plain decoding in fp32 with the datastore in the tree; a
    datastore holding the target's own outputs lifts tau over the same hybrid without it."""
    plain = SpeculativeDecoder(target, None, k=1).generate(PROMPTS, max_new_tokens=N_NEW).sequences
    st = Datastore(plain)  # (a test: built from the very outputs it will be asked to predict)
    taus = {}
    for name, store, model in (("without", None, NoChain()), ("with", st, NoChain()), ("no draft", st, NoDraft())):
        hyb = HybridProposer(model, min_match=2, max_nodes=24, datastore=store)
        for prompts in (PROMPTS, [PROMPTS[0]]):  # ragged, then batch 1
            res = SpeculativeDecoder(target, hyb, k=2).generate(prompts, max_new_tokens=N_NEW)
            assert res.sequences == plain[: len(prompts)]
        taus[name] = res.stats["tau"]  # batch 1's
    assert taus["with"] > taus["without"] + 1.0 and taus["no draft"] > taus["without"] + 1.0, taus


def test_train_stage_writes_the_datastore_and_the_hybrid_loads_it(tmp_path):
    from helpers import copy_generate as _copy_gen, make_generate as _make_generate, tiny_llama
    from helpers import train_recipe as _recipe
    from pipeline.train import run_train

    tgt = tiny_llama()
    rows = _make_generate(tmp_path / "gen", tgt, n_rows=4)
    d = _copy_gen(tmp_path / "gen", tmp_path / "r")
    train_dir = run_train(_recipe(method="medusa", steps=2, save_every=2, medusa={"heads": 2}), d, target=tgt)
    ck = train_dir / "checkpoint-000002"
    st = Datastore.load(ck)
    want = [t for r in rows for t in r["completion_ids"] + [SEP]]  # completions only, prompts left out
    assert st.flat == want
    hyb = load_proposer(f"hybrid:{ck}", tgt)
    assert isinstance(hyb, HybridProposer) and hyb.datastore.flat == want
    meta = json.loads((ck / "draftsmith_draft.json").read_text())
    (ck / "draftsmith_draft.json").write_text(json.dumps(meta | {"proposer": "hybrid"}))
    assert load_proposer(str(ck), tgt).datastore.flat == want  # a promoted best/ dir serves it too
    nostore = load_proposer(f"hybrid-nostore:{ck}", tgt)  # of a promoted dir: its draft, not its hybrid
    assert nostore.datastore is None and not isinstance(nostore.model, HybridProposer)
    alone = load_proposer(f"datastore:{ck}", tgt)
    assert isinstance(alone.model, NoDraft) and alone.datastore.flat == want
    d2 = _copy_gen(tmp_path / "gen", tmp_path / "r2")
    train_dir = run_train(_recipe(method="medusa", steps=2, save_every=2, medusa={"heads": 2}, datastore=False), d2,
                          target=tgt)
    assert not (train_dir / "checkpoint-000002" / FILE).exists()
    assert load_proposer(f"hybrid:{train_dir / 'checkpoint-000002'}", tgt).datastore is None
    with pytest.raises(DatastoreError, match="holds no datastore.npy"):
        load_proposer(f"datastore:{train_dir / 'checkpoint-000002'}", tgt)
    # switched on later: the resumed (already finished) run adds it to the existing checkpoints
    train_dir = run_train(_recipe(method="medusa", steps=2, save_every=2, medusa={"heads": 2}), d2, target=tgt)
    assert Datastore.load(train_dir / "checkpoint-000002").flat == want
    # a finished run whose datastore went missing writes it again; cached measurements see the change
    from pipeline.measure import source_fingerprint

    ck = train_dir / "checkpoint-000002"
    before = source_fingerprint(f"hybrid:{ck}")
    (ck / FILE).unlink()
    assert source_fingerprint(f"hybrid:{ck}") != before and source_fingerprint("ngram") == []
    run_train(_recipe(method="medusa", steps=2, save_every=2, medusa={"heads": 2}), d2, target=tgt)
    assert Datastore.load(ck).flat == want and source_fingerprint(f"hybrid:{ck}") == before
