"""A datastore of the target's own outputs, looked up like prompt lookup but across the whole corpus.

REST (He et al., 2024, "REST: Retrieval-Based Speculative Decoding") drafts by matching the last
few tokens against a datastore of domain text and verifying the retrieved continuations as a token
tree; SuffixDecoding (Oliaro et al., 2024) does the same over a model's previous outputs. draftsmith
already has the best such corpus: stage 1's generated completions, the target's own greedy outputs on
the domain. The train stage stores them next to each checkpoint (`datastore.npy`), and a hybrid
proposer (eval.proposers.HybridProposer) adds the datastore's most frequent continuations to its tree
after the trained draft's chain. It needs no training and costs a dict lookup per round. The target's completions make a better
corpus than raw domain text: the lookup wants what the target says (docs/reference/trees.md).

Held-out prompts never enter it: it holds the completions of the training prompts only.

Layout: one int32 array, the sequences joined with SEP (-1) between them; a match or a continuation
never crosses SEP. The index (n-gram context -> positions after it) is built in memory when loaded:
a Python dict, O(1) per lookup (build time and memory per corpus size: docs/reference/trees.md).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

FILE = "datastore.npy"
SEP = -1


class DatastoreError(ValueError):
    """The datastore file cannot be used; the message names it and the fix."""


class Datastore:
    """Continuations of the last n tokens (n = max_ngram .. min_ngram, longest first) in a corpus of
    token sequences, most frequent first among the latest `window` occurrences."""

    def __init__(self, seqs, max_ngram: int = 4, min_ngram: int = 1, window: int = 256):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"Datastore needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if isinstance(seqs, np.ndarray):
            flat = seqs.astype(np.int64).tolist()
        else:
            flat = []
            for s in seqs:
                flat += [int(t) for t in s] + [SEP]
        self.flat: list[int] = flat  # host list: slicing it is what a lookup does
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window
        self.index: dict[tuple[int, ...], list[int]] = {}  # context -> positions of the token after it
        for i in range(1, len(flat)):
            if flat[i] == SEP:
                continue
            for n in range(1, max_ngram + 1):
                if i - n < 0 or flat[i - n] == SEP:
                    break
                self.index.setdefault(tuple(flat[i - n:i]), []).append(i)
        self._memo: dict[tuple, list[tuple[list[int], int]]] = {}

    @property
    def n_tokens(self) -> int:
        return len(self.flat) - self.flat.count(SEP)

    def candidates(self, h: list[int], k: int, m: int) -> list[tuple[list[int], int]]:
        """Up to m distinct continuations (at most k tokens) of the longest suffix of h (at most
        max_ngram tokens) found in the corpus, most frequent first -> [(continuation, n), ...]."""
        for n in range(min(self.max_ngram, len(h)), self.min_ngram - 1, -1):
            key = tuple(h[-n:])
            pos = self.index.get(key)
            if not pos:
                continue
            memo = self._memo.get((key, k, m))
            if memo is None:
                counts: Counter = Counter()
                for p in pos[-self.window:]:
                    cont = self.flat[p:p + k]
                    if SEP in cont:
                        cont = cont[:cont.index(SEP)]
                    counts[tuple(cont)] += 1  # cont is never empty: p is not a separator
                memo = [(list(c), n) for c, _ in counts.most_common(m)]  # ties: first seen first
                self._memo[(key, k, m)] = memo
            return memo
        return []

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / FILE
        np.save(path, np.asarray(self.flat, dtype=np.int32), allow_pickle=False)
        return path

    @classmethod
    def load(cls, directory: str | Path, **kw) -> "Datastore":
        path = Path(directory) / FILE
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DatastoreError(f"{path} is unreadable ({e}); delete it (the draft then serves without "
                                 f"a datastore) or rerun the train stage to write it again") from None
        if arr.ndim != 1 or arr.dtype.kind != "i":
            raise DatastoreError(f"{path} holds a {arr.dtype} array of shape {arr.shape}, not a 1-D token-id "
                                 f"array; delete it or rerun the train stage")
        return cls(arr, **kw)

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Datastore | None":
        """The datastore saved in a draft directory, or None when it has none."""
        return cls.load(directory) if (Path(directory) / FILE).exists() else None
