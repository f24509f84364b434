"""eval.draft_dir (the one reader/writer of a draft directory's marker file) and eval.speedup."""


import pytest

from eval import draft_dir, speedup


def test_write_then_read_round_trips(tmp_path):
    draft_dir.write_meta(tmp_path / "d", {"kind": "medusa", "step": 3})
    assert draft_dir.is_draft_dir(tmp_path / "d")
    assert draft_dir.read_meta(tmp_path / "d") == {"kind": "medusa", "step": 3}


@pytest.mark.parametrize("content, says", [(None, "no draftsmith_draft.json"), ("{", "bad JSON"),
                                           ('{"kind": "gpt"}', "unknown draft kind 'gpt'"),
                                           ("[1]", "unknown draft kind None")])
def test_bad_directories_are_named(tmp_path, content, says):
    d = tmp_path / "d"
    d.mkdir()
    if content is not None:
        (d / draft_dir.FILE).write_text(content)
    with pytest.raises(draft_dir.DraftDirError, match=says):
        draft_dir.read_meta(d)
    with pytest.raises(draft_dir.DraftDirError, match="does not exist"):
        draft_dir.read_meta(tmp_path / "missing")


def test_write_refuses_an_unknown_kind(tmp_path):
    with pytest.raises(draft_dir.DraftDirError, match="'nope' is not one of"):
        draft_dir.write_meta(tmp_path, {"kind": "nope"})
    assert not (tmp_path / draft_dir.FILE).exists()


def test_expected_speedup_is_leviathans_formula():
    # a = 0.8, K = 4, c = 0.1: (1 - 0.8^5) / (0.2 * 1.4)
    assert speedup.expected_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.4))
    assert speedup.expected_speedup(0.0, 3, 0.0) == pytest.approx(1.0)  # nothing accepted, free drafts
    assert speedup.expected_speedup(1.0, 2, 0.0) == pytest.approx(speedup.expected_speedup(speedup.A_MAX, 2, 0.0))


def test_best_k_trades_acceptance_against_draft_cost():
    assert speedup.best_k(0.9, 0.0, 8)[0] == 8  # free drafts: as many as allowed
    assert speedup.best_k(0.9, 0.5, 8)[0] < speedup.best_k(0.9, 0.05, 8)[0]  # dearer drafts: fewer
    k, v = speedup.best_k(0.6, 0.1, 6)
    assert v == max(speedup.expected_speedup(0.6, kk, 0.1) for kk in range(1, 7))
    assert v == speedup.expected_speedup(0.6, k, 0.1)


def test_served_form_splits_only_the_known_ways_of_serving():
    assert draft_dir.served_form("hybrid:runs/x/best") == ("hybrid", "runs/x/best")
    assert draft_dir.served_form("hybrid-nostore:d") == ("hybrid-nostore", "d")
    assert draft_dir.served_form("datastore:d") == ("datastore", "d")
    assert draft_dir.served_form("ngram") == (None, "ngram")
    assert draft_dir.served_form("runs/a:b/best") == (None, "runs/a:b/best")  # a path holding a colon
