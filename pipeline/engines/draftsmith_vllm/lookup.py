"""Suffix lookups over a datastore of the target's own outputs and over the request's own context.

Numpy and the standard library only: this module runs inside vLLM's venv (proposer.py) and in draftsmith's
(its decoder's twin of the proposer, pipeline/datastore_proposer.py, and the tests), and nothing else.
SuffixDecoding's own implementation (arctic-inference) ships only as a source build that needs vLLM's build
tooling, so draftsmith's venv cannot load it; this is the same rule over sorted hash arrays.

    lk = SuffixLookup(corpus, max_ngram=16, min_ngram=1, min_prob=0.1, window=1024, spec_factor=2.0)
    lk.propose(context, k) -> up to k token ids (a list; [] when neither source matches)

The corpus is eval/datastore.py's layout (draft directories' `datastore.npy`): one int array, sequences
joined with SEP (-1); a match or a continuation never crosses SEP. Per round, SuffixDecoding's rule
(Oliaro et al. 2024, arXiv 2411.04975; arctic-inference's SuffixTree.speculate) over two sources, the
request's own context (prompt and output so far) and the datastore:

1. for each suffix length n = min_ngram .. max_ngram of the context that occurred earlier in the source,
   its continuation is grown one token at a time by the most frequent next token among the occurrences
   (the last `window` of them in the datastore; ties: the smaller id), while the occurrences that still
   agree are >= min_prob of the matched ones, and for at most min(k, floor(spec_factor * n + spec_offset))
   tokens: a longer match earns a longer draft;
2. a continuation's score is the sum of its tokens' probabilities (the share of occurrences agreeing up to
   each token): the draft's expected accepted length if the source were the target. Per source the best
   score proposes (ties: the longer match); between sources the better score (ties: the context, the
   request repeating itself).

Deterministic: the same corpus, context and k give the same proposal. The index is one sorted array of
n-gram hashes per n (built with numpy at load: about a second per million corpus tokens); a lookup is a
binary search per n, and the matched positions are checked token by token, so a hash collision never
proposes. The measured choice of settings: docs/reference/engines.md ("The datastore proposer's rule").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

RULE = "suffix-score-1"  # this module's proposal rule: a change to what it proposes gets a new name
SEP = -1
DATASTORE = "datastore.npy"  # eval/datastore.py's file name and layout
CONFIG = "config.json"  # the export's config: {"draftsmith_proposer": {<the settings below>}}
CONFIG_KEY = "draftsmith_proposer"
DEFAULTS = {"max_ngram": 16, "min_ngram": 1, "min_prob": 0.1, "window": 1024, "spec_factor": 2.0,
            "spec_offset": 0.0}
_P = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the polynomial hash
_M = (1 << 64) - 1


class Draft(NamedTuple):
    tokens: list[int]
    score: float = 0.0  # the sum of the tokens' probabilities (SuffixDecoding's score)
    n: int = 0  # the matched suffix's length


NONE = Draft([])


def _hash(tokens) -> int:
    """The polynomial hash of a token sequence, mod 2^64 (what _tables computes with numpy's uint64 wrap)."""
    h = 0
    for t in tokens:
        h = (h * _P + int(t) + 1) & _M
    return h


def grow(flat: np.ndarray, live: np.ndarray, cap: int, min_prob: float) -> Draft:
    """The continuation of the occurrences `live` (positions in `flat` of the token after each match), one
    token at a time: the most frequent next token (ties: the smaller id) while the occurrences agreeing so
    far are >= min_prob of all, at most `cap` tokens. `flat` ends in SEP, so live + j stays inside it."""
    total, out, score = len(live), [], 0.0
    for j in range(cap):
        nxt = flat[live + j]
        keep = nxt != SEP
        live, nxt = live[keep], nxt[keep]
        if not len(nxt):
            break
        vals, counts = np.unique(nxt, return_counts=True)
        b = int(np.argmax(counts))  # the first maximum: the smallest id among equal counts
        p = counts[b] / total
        if p < min_prob:
            break
        out.append(int(vals[b]))
        score += float(p)
        live = live[nxt == vals[b]]
    return Draft(out, score)


def _better(new: Draft, best: Draft) -> bool:
    """Called with n rising: the higher score, ties to the longer match."""
    return bool(new.tokens) and new.score >= best.score


class SuffixLookup:
    def __init__(self, corpus=None, max_ngram: int = DEFAULTS["max_ngram"], min_ngram: int = DEFAULTS["min_ngram"],
                 min_prob: float = DEFAULTS["min_prob"], window: int = DEFAULTS["window"],
                 spec_factor: float = DEFAULTS["spec_factor"], spec_offset: float = DEFAULTS["spec_offset"]):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"SuffixLookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 0.0 <= min_prob <= 1.0 or window < 1:
            raise ValueError(f"SuffixLookup needs 0 <= min_prob <= 1 and window >= 1, got {min_prob}, {window}")
        if spec_factor < 0 or spec_factor * max_ngram + spec_offset < 1:
            raise ValueError(f"SuffixLookup needs spec_factor >= 0 and spec_factor * max_ngram + spec_offset >= 1 "
                             f"(else no match may draft), got {spec_factor}, {spec_offset}")
        self.max_ngram, self.min_ngram, self.min_prob, self.window = max_ngram, min_ngram, float(min_prob), window
        self.spec_factor, self.spec_offset = float(spec_factor), float(spec_offset)
        flat = np.asarray([] if corpus is None else corpus, dtype=np.int64).reshape(-1)
        self.flat = np.concatenate([flat, [SEP]])  # a trailing SEP: every continuation stops inside the array
        self.tables = self._tables()
        self._memo: dict = {}

    @property
    def n_tokens(self) -> int:
        return int((self.flat != SEP).sum())

    def cap(self, n: int, k: int) -> int:
        """The most tokens a match of n tokens may draft: min(k, floor(spec_factor * n + spec_offset))."""
        return max(0, min(k, int(self.spec_factor * n + self.spec_offset + 1e-6)))

    def _tables(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{n: (hashes of every n-gram followed by a token, sorted; the position of that token)}."""
        f, L = self.flat, len(self.flat)
        out = {}
        if L < 2:
            return out
        tok = (f + 1).astype(np.uint64)  # SEP -> 0; never read inside a kept n-gram
        seps = np.concatenate([[0], np.cumsum(f == SEP)])  # seps[i] = SEPs in f[:i]
        idx = np.arange(L)
        h = np.zeros(L, dtype=np.uint64)  # h[i]: hash of the n tokens before position i
        with np.errstate(over="ignore"):
            for n in range(1, min(self.max_ngram, L - 1) + 1):  # an n-gram and a token after it fit in L
                # h_n[i] = tok[i-n] * P^(n-1) + h_{n-1}[i]: Horner from the left, the older token on top
                pw = np.uint64(pow(_P, n - 1, 1 << 64))
                h[n:] = tok[:L - n] * pw + h[n:]
                if n < self.min_ngram:
                    continue
                ok = (idx >= n) & (f != SEP)
                ok[n:] &= (seps[n:L] - seps[:L - n]) == 0  # no SEP in f[i-n:i]
                pos = np.flatnonzero(ok)
                order = np.argsort(h[pos], kind="stable")  # equal hashes keep corpus order
                out[n] = (h[pos][order], pos[order])
        return out

    # ---------------------------------------------------------------------------------- the two sources

    def context_match(self, context, k: int) -> Draft:
        """The best-scoring continuation of the context's own earlier occurrences of its suffixes."""
        ctx = np.asarray(context, dtype=np.int64)
        end = len(ctx) - 1
        best = NONE
        if end < 1 or k < 1:
            return best
        flat = np.concatenate([ctx, [SEP]])  # a continuation stops at the context's end
        live = np.flatnonzero(ctx[:end] == ctx[end]) + 1  # after each earlier occurrence of the last token
        n = 1
        while len(live) and n <= self.max_ngram:
            if n >= self.min_ngram:
                d = grow(flat, live, self.cap(n, k), self.min_prob)
                if _better(d, best):
                    best = d._replace(n=n)
            back = live - n - 1  # extend the match by one older token
            ok = back >= 0
            live = live[ok][ctx[back[ok]] == ctx[end - n]]
            n += 1
        return best

    def _occurrences(self, key: tuple) -> np.ndarray:
        """Positions after the last `window` occurrences of the n-gram `key` in the corpus (checked: never a
        hash collision)."""
        n = len(key)
        hashes, pos = self.tables[n]
        h = np.uint64(_hash(key))
        live = pos[np.searchsorted(hashes, h, "left"):np.searchsorted(hashes, h, "right")][-self.window:]
        if len(live):
            live = live[(self.flat[live[:, None] - np.arange(n, 0, -1)] == np.asarray(key)).all(axis=1)]
        return live

    def continuation(self, key, k: int) -> Draft:
        """The datastore's continuation of the n-gram `key` (n = len(key)), at most cap(n, k) tokens."""
        key = tuple(int(t) for t in key)
        cap = self.cap(len(key), k)
        found = self._memo.get((key, cap))
        if found is None:
            live = self._occurrences(key) if len(key) in self.tables else ()
            found = grow(self.flat, live, cap, self.min_prob)._replace(n=len(key)) if len(live) else NONE
            if len(self._memo) > 200_000:
                self._memo.clear()
            self._memo[(key, cap)] = found
        return found

    def store_match(self, context, k: int) -> Draft:
        """The best-scoring continuation in the datastore of the context's suffixes."""
        ctx = [int(t) for t in context[-self.max_ngram:]]
        best = NONE
        if k < 1:
            return best
        for n in range(self.min_ngram, min(self.max_ngram, len(ctx)) + 1):
            d = self.continuation(ctx[-n:], k)
            if d.n == 0:  # no occurrence: no longer suffix occurs either
                break
            if _better(d, best):
                best = d
        return best

    def propose(self, context, k: int) -> list[int]:
        """Up to k draft tokens continuing `context` (the request's prompt and output so far)."""
        mine = self.context_match(context, k)
        stored = self.store_match(context, k) if self.tables else NONE
        return (mine if mine.tokens and mine.score >= stored.score else stored).tokens


def read_config(directory) -> dict:
    """The lookup settings from the export's config.json (DEFAULTS for any it lacks)."""
    p = Path(directory) / CONFIG
    conf = json.loads(p.read_text()).get(CONFIG_KEY, {}) if p.is_file() else {}
    return {key: conf.get(key, v) for key, v in DEFAULTS.items()}


def load_export(directory) -> SuffixLookup:
    """The lookup an export directory describes: its datastore.npy and its config.json's settings."""
    d = Path(directory)
    path = d / DATASTORE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no datastore; write the export with `draftsmith export --format "
                                f"vllm-proposer` (or point DRAFTSMITH_VLLM_EXPORT at such a directory)")
    arr = np.load(path, allow_pickle=False)
    if arr.ndim != 1 or arr.dtype.kind != "i":
        raise ValueError(f"{path} holds a {arr.dtype} array of shape {arr.shape}, not a 1-D token-id array")
    return SuffixLookup(arr, **read_config(d))
