"""Longest-suffix lookups over a datastore of the target's own outputs and over the request's own context.

Numpy and the standard library only: this module runs inside vLLM's venv (proposer.py) and in draftsmith's
(its decoder's twin of the proposer, pipeline/datastore_proposer.py, and the tests), and nothing else.

    lk = SuffixLookup(corpus, max_ngram=8, min_ngram=2, min_prob=0.1, window=1024)
    lk.propose(context, k) -> up to k token ids (a list; [] when neither source matches)

The corpus is eval/datastore.py's layout (draft directories' `datastore.npy`): one int array, sequences
joined with SEP (-1); a match or a continuation never crosses SEP. Per round:

1. context: the longest suffix of `context` (n = max_ngram .. min_ngram tokens) that occurred earlier in
   it; the latest such occurrence's next k tokens (prompt lookup);
2. datastore: the longest suffix (same n range) found in the corpus; among its occurrences (the last
   `window` in corpus order) the continuation grown one token at a time by the most frequent next token
   (ties: the smaller id), kept while the occurrences that still agree are >= min_prob of the matched
   ones (SuffixDecoding's path probability, Oliaro et al. 2024, with a fixed corpus);
3. the source with the longer match proposes; at equal length the context (the request repeating
   itself beats the corpus's average continuation).

Deterministic: the same corpus, context and k give the same proposal. The index is one sorted array of
n-gram hashes per n (built with numpy at load: about a second per million corpus tokens); a lookup is a
binary search per n, and the matched positions are checked token by token, so a hash collision never
proposes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SEP = -1
DATASTORE = "datastore.npy"  # eval/datastore.py's file name and layout
CONFIG = "config.json"  # the export's config: {"draftsmith_proposer": {max_ngram, min_ngram, min_prob, window}}
CONFIG_KEY = "draftsmith_proposer"
DEFAULTS = {"max_ngram": 8, "min_ngram": 2, "min_prob": 0.1, "window": 1024}
_P = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the polynomial hash
_M = (1 << 64) - 1


def _hash(tokens) -> int:
    """The polynomial hash of a token sequence, mod 2^64 (what _tables computes with numpy's uint64 wrap)."""
    h = 0
    for t in tokens:
        h = (h * _P + int(t) + 1) & _M
    return h


class SuffixLookup:
    def __init__(self, corpus=None, max_ngram: int = DEFAULTS["max_ngram"], min_ngram: int = DEFAULTS["min_ngram"],
                 min_prob: float = DEFAULTS["min_prob"], window: int = DEFAULTS["window"]):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"SuffixLookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 0.0 <= min_prob <= 1.0 or window < 1:
            raise ValueError(f"SuffixLookup needs 0 <= min_prob <= 1 and window >= 1, got {min_prob}, {window}")
        self.max_ngram, self.min_ngram, self.min_prob, self.window = max_ngram, min_ngram, float(min_prob), window
        flat = np.asarray([] if corpus is None else corpus, dtype=np.int64).reshape(-1)
        self.flat = np.concatenate([flat, [SEP]])  # a trailing SEP: every continuation stops inside the array
        self.tables = self._tables()
        self._memo: dict = {}

    @property
    def n_tokens(self) -> int:
        return int((self.flat != SEP).sum())

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
                # h_n[i] = h_{n-1}[i] + tok[i-n] * P^(n-1), written as Horner from the left: shift the older
                # tokens up by one power: h_n[i] = tok[i-n] * P^(n-1) + h_{n-1}[i]
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

    def context_match(self, context, k: int) -> tuple[list[int], int]:
        """(the next k tokens after the latest earlier occurrence of the longest suffix, its length n),
        or ([], 0) when no suffix of min_ngram tokens or more occurred earlier."""
        ctx = np.asarray(context, dtype=np.int64)
        end = len(ctx) - 1
        if end < self.min_ngram or k < 1:
            return [], 0
        cand = np.flatnonzero(ctx[:end] == ctx[end])
        if not len(cand):
            return [], 0
        length = np.ones(len(cand), dtype=np.int64)
        alive = np.ones(len(cand), dtype=bool)
        for j in range(1, self.max_ngram):
            back = cand - j
            ok = alive & (back >= 0)
            ok[ok] = ctx[back[ok]] == ctx[end - j]
            if not ok.any():
                break
            length += ok
            alive = ok
        n = int(length.max())
        if n < self.min_ngram:
            return [], 0
        i = int(cand[length == n][-1])  # the latest occurrence among the longest
        return ctx[i + 1:i + 1 + k].tolist(), n

    def store_match(self, context, k: int) -> tuple[list[int], int]:
        """(the datastore's continuation of the longest suffix found in it, that suffix's length n), or ([], 0)."""
        ctx = [int(t) for t in context[-self.max_ngram:]]
        if k < 1:
            return [], 0
        for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
            table = self.tables.get(n)
            if table is None:
                continue
            key = tuple(ctx[-n:])
            memo = self._memo.get((key, k))
            if memo is not None:
                if memo:
                    return memo, n
                continue
            hashes, pos = table
            h = np.uint64(_hash(key))
            lo, hi = np.searchsorted(hashes, h, "left"), np.searchsorted(hashes, h, "right")
            live = pos[lo:hi][-self.window:]
            if len(live):  # a hash collision never proposes: check the matched tokens themselves
                live = live[(self.flat[live[:, None] - np.arange(n, 0, -1)] == np.asarray(key)).all(axis=1)]
            prop = self._grow(live, k) if len(live) else []
            if len(self._memo) > 200_000:
                self._memo.clear()
            self._memo[(key, k)] = prop
            if prop:
                return prop, n
        return [], 0

    def _grow(self, live: np.ndarray, k: int) -> list[int]:
        """The continuation of the occurrences `live` (positions of the token after the match), one token at a
        time: the most frequent next token (ties: the smaller id) while its occurrences are >= min_prob of all."""
        total, out = len(live), []
        for j in range(k):
            nxt = self.flat[live + j]  # the trailing SEP keeps live + j inside the array
            keep = nxt != SEP
            live, nxt = live[keep], nxt[keep]
            if not len(nxt):
                break
            vals, counts = np.unique(nxt, return_counts=True)
            b = int(np.argmax(counts))  # the first maximum: the smallest id among equal counts
            if counts[b] < self.min_prob * total:
                break
            out.append(int(vals[b]))
            live = live[nxt == vals[b]]
        return out

    def propose(self, context, k: int) -> list[int]:
        """Up to k draft tokens continuing `context` (the request's prompt and output so far)."""
        mine, n_c = self.context_match(context, k)
        stored, n_s = self.store_match(context, k) if self.tables else ([], 0)
        if mine and n_c >= n_s:
            return mine
        return stored or mine


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
