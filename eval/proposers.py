"""Draft proposers for the speculative decoder: n-gram prompt lookup, a small draft LM (also the
self-speculative and int8 drafts of eval/drafts.py), an EAGLE head (Medusa heads: eval/medusa.py).

One small interface (`Proposer`), driven by `eval.decoder.SpeculativeDecoder`:

    begin(prompts, first, max_len, sampling, features)
        prompts: list of B token lists; first [B]: the token the target's prefill produced (at
        position len(prompt)); features [B, Lmax, H] the target's prefill features (or None when
        `uses_features` is False).
    propose(k) -> (drafts [B, k] long, q [B, k, V] float or None)
        drafts continue the current token; q is the draft distribution each draft was sampled from
        (None under greedy decoding, or when the proposal is deterministic: q is then one-hot).
        May return fewer than k columns (0: "nothing to propose this round").
    accept(tokens [B, T], start [B], n_acc [B], bonus [B], features [B, T, H] | None)
        tokens: the verified input [current, drafts...] written at positions start..start+T-1;
        row b kept tokens[b, :n_acc[b]+1] and then the target produced `bonus[b]`, the new current
        token at position start + n_acc + 1. n_acc == -1 marks a finished row (nothing changed).

A proposer may also offer token trees for greedy rounds (eval/tree.py):
    propose_tree(k) -> per row (tokens, parents) from eval.tree.build_trie, at most `max_nodes` nodes
and then accept() receives the accepted path in the chain layout above.

Positions are absolute token positions in each row; caches are position-indexed, so a rejected
draft's slot is overwritten by a later write and never needs cropping.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import draft_dir
from .draft_dir import SERVE_KEYS, SERVED_AS
from .heads import EagleHead
from .target import make_runner
from .tree import build_trie


class Sampling:
    """Temperature / top-k / top-p warping shared by the target and the drafts; greedy at T == 0."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None):
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.generator = generator

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p."""
        x = logits.float() / self.temperature
        if self.top_k > 0 and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            s, idx = torch.sort(x, dim=-1, descending=True)
            ps = s.softmax(-1)
            drop = ps.cumsum(-1) - ps > self.top_p  # keep the smallest prefix with mass >= top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
        return x.softmax(-1)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., V] probabilities -> [...] token ids (exponential race: argmax p / Exp(1))."""
        e = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
        return (probs / e).argmax(-1)


class Proposer:
    """What the decoder asks of a draft: begin a batch, propose K tokens a round, learn what was accepted.

    Optional abilities are declared here with their defaults, never probed with hasattr:
      uses_features  the decoder passes the target's final features to begin/accept
      max_k          > 0: may propose up to this many tokens even when asked for fewer
      trees          propose_tree() gives a token tree per row (greedy rounds verify it at once)
      max_nodes      with trees: the tree's node budget over the batch (a serving setting)
      alternatives   alternatives(m) gives m runner-up paths after the last chain (Medusa's sparse tree)
      lookup_rounds  tree rounds filled by lookups alone, without calling a model (a counter)
    """

    uses_features = False
    max_k = 0
    trees = False
    max_nodes = 0
    has_alternatives = False
    lookup_rounds = 0
    name = "proposer"

    def propose_tree(self, k: int):
        raise NotImplementedError(f"{type(self).__name__} proposes chains only (trees=False)")

    def alternatives(self, m: int):
        raise NotImplementedError(f"{type(self).__name__} has no runner-up paths (has_alternatives=False)")

    def begin(self, prompts, first, max_len, sampling, features=None) -> None:
        raise NotImplementedError

    def propose(self, k: int):
        raise NotImplementedError

    def accept(self, tokens, start, n_acc, bonus, features=None) -> None:
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_ngram..1) in
    prompt + generated text and propose the tokens that followed it. No model, no training."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.hist = [list(p) + [int(t)] for p, t in zip(prompts, first.tolist())]
        self.device = first.device

    def _lookup(self, h: list[int], k: int) -> list[int]:
        found = self.candidates(h, k, 1)
        return found[0][0] if found else []

    def candidates(self, h: list[int], k: int, m: int, min_n: int | None = None,
                   max_n: int | None = None) -> list[tuple[list[int], int]]:
        """Up to m distinct continuations (at most k tokens) of the last n tokens of h, for n from
        max_n (default: max_ngram) down to min_n (default: min_ngram), longest n first and the latest
        occurrence first within one n -> [(continuation, n), ...].

        One pass over the earlier occurrences of h's last token, each scored by how far its match
        extends backwards (capped at max_n), instead of one scan of h per n: the same answer, and a
        long max_n (HybridProposer's strong matches) costs no more scans."""
        max_n, min_n = max_n or self.max_ngram, min_n or self.min_ngram
        end = len(h) - 1
        last = h[end]
        scored = []  # (n, position of the occurrence's last token)
        for i in [i for i in range(end - 1, -1, -1) if h[i] == last]:  # latest first
            n = 1
            while n < max_n and i - n >= 0 and h[i - n] == h[end - n]:
                n += 1
            if n >= min_n:
                scored.append((n, i))
        scored.sort(key=lambda t: -t[0])  # stable: latest first within one n
        out: list[tuple[list[int], int]] = []
        for n, i in scored:
            cont = h[i + 1:i + 1 + k]
            if all(cont != c for c, _ in out):
                out.append((cont, n))
                if len(out) >= m:
                    break
        return out

    def propose(self, k):
        found = [self._lookup(h, k) for h in self.hist]
        self.found = [bool(f) for f in found]  # per row: did the lookup match (read by HybridProposer)
        width = max((len(f) for f in found), default=0)
        if width == 0:
            return torch.empty(len(self.hist), 0, dtype=torch.long, device=self.device), None
        # Rows with shorter (or no) matches are padded with their last token; they are verified and
        # most likely rejected, which costs nothing extra in a batched verify.
        rows = [f + [(f or h)[-1]] * (width - len(f)) for f, h in zip(found, self.hist)]
        return torch.tensor(rows, dtype=torch.long, device=self.device), None  # q one-hot

    def accept(self, tokens, start, n_acc, bonus, features=None):
        for b, (a, t) in enumerate(zip(n_acc.tolist(), bonus.tolist())):
            if a >= 0:
                self.hist[b] += tokens[b, 1:a + 1].tolist() + [t]


class NoDraft(Proposer):
    """Proposes nothing. A hybrid over it serves lookups alone (the prompt's and a datastore's): the
    no-training baseline that tells what a trained draft adds."""

    name = "none"

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.B, self.device = len(prompts), first.device

    def propose(self, k):
        return torch.empty(self.B, 0, dtype=torch.long, device=self.device), None

    def accept(self, tokens, start, n_acc, bonus, features=None):
        pass


def _verified(tokens, start, n_acc, bonus):
    """The verified tokens of a round as one input: tokens [B, T] ([current, drafts...]) written at
    positions start [B].., with each row's bonus token placed after its accepted drafts.
    -> toks [B, T + 1], pos [B, T + 1], idx [B] (the bonus column; 0 for finished rows, n_acc == -1,
    whose bonus is their unchanged current token). Columns past idx are junk, in slots that later
    writes overwrite before they are read."""
    B, T = tokens.shape
    idx = n_acc + 1
    toks = torch.cat([tokens, tokens[:, -1:]], 1)
    toks[torch.arange(B, device=tokens.device), idx] = bonus
    pos = start[:, None] + torch.arange(T + 1, device=tokens.device)
    return toks, pos, idx


def to_target_vocab(logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., Vd] logits over a truncated draft vocabulary -> [..., V] float logits over the target's
    ids, -inf outside d2t (so a distribution drawn from them is zero there)."""
    out = torch.full((*logits.shape[:-1], vocab_size), float("-inf"), device=logits.device)
    return out.index_copy_(-1, d2t, logits.float())


def _draw(logits: torch.Tensor, sampling: Sampling):
    """[B, V] draft logits -> (tokens [B], q [B, V] or None)."""
    if sampling.greedy:
        return logits.argmax(-1), None
    q = sampling.probs(logits)
    return sampling.sample(q), q


class DraftLMProposer(Proposer):
    """A small causal LM with the target's tokenizer, with its own position-indexed KV cache: an HF
    model, or a draft in LeanLlama's layout (eval.drafts: SelfSpecDraft, Int8Draft).

    d2t [Vd] (a truncated draft vocabulary, draft row -> target id): the model's logits are over
    those Vd rows. Greedy drafting maps the argmax row through d2t (no [B, V] tensor); sampling
    spreads the rows over the target vocabulary (`vocab_size` then required) with -inf elsewhere,
    so q is a distribution over the target's ids, zero outside d2t."""

    name = "draft_lm"

    def __init__(self, model, vocab_size: int | None = None, lean: bool = True, d2t: torch.Tensor | None = None):
        self.model = model.eval()
        self.runner = make_runner(model, lean)
        self.vocab_size = vocab_size  # the target's; draft logits beyond it (padding rows) are dropped
        if d2t is not None and vocab_size is None:
            raise ValueError("DraftLMProposer with a truncated vocabulary (d2t) needs the target's vocab_size")
        self.d2t = None if d2t is None else d2t.long().to(self.runner.device)  # [Vd]

    def _logits(self, tokens, pos, s_len, idx):
        logits, _ = self.runner(tokens, pos, s_len, idx)  # [B, 1, Vd]
        if self.d2t is not None:
            return logits[:, 0]  # [B, Vd]: draft rows, mapped in _draw_draft
        return logits[:, 0, : self.vocab_size]  # [B, V]

    def _draw_draft(self, logits):
        """[B, Vd or V] draft logits -> (tokens [B] target ids, q [B, V] or None)."""
        if self.d2t is None:
            return _draw(logits, self.sampling)
        if self.sampling.greedy:
            return self.d2t[logits.argmax(-1)], None
        return _draw(to_target_vocab(logits, self.d2t, self.vocab_size), self.sampling)

    def begin(self, prompts, first, max_len, sampling, features=None):
        B, dev = len(prompts), first.device
        self.sampling = sampling
        self.runner.reset(B, max_len)
        L = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        T = int(L.max()) + 1
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            toks[b, : len(p)] = torch.tensor(p, device=dev)
        toks[torch.arange(B, device=dev), L] = first  # [B, T]: prompt + first token, right-padded
        pos = torch.arange(T, device=dev).expand(B, T)
        self.next_logits = self._logits(toks, pos, T, L)  # [B, V] predicts the token after `first`
        self.pos = L  # [B] position of the current token
        self.max_pos = T - 1  # host int: the largest current-token position over rows

    def propose(self, k):
        drafts, qs = [], []
        logits = self.next_logits
        self.fed_drafts = True  # accept() may rely on drafts 1..k-1 being in the cache
        for i in range(k):
            tok, q = self._draw_draft(logits)  # [B], [B, V]
            drafts.append(tok)
            qs.append(q)
            if i + 1 < k:  # feed draft i at position pos + 1 + i to get the next one
                p = (self.pos + 1 + i)[:, None]  # [B, 1]
                logits = self._logits(tok[:, None], p, self.max_pos + 2 + i, None)
        q = None if self.sampling.greedy else torch.stack(qs, 1)
        return torch.stack(drafts, 1) if drafts else torch.empty(self.pos.shape[0], 0, dtype=torch.long), q

    def accept(self, tokens, start, n_acc, bonus, features=None):
        if not getattr(self, "fed_drafts", True):  # the drafts came from elsewhere (hybrid): feed them all
            return self._feed_all(tokens, start, n_acc, bonus)
        # Feed [token before the new current one, new current one] at [n'-1, n']: the first slot is
        # the last accepted draft, which is missing from the draft's cache only when all k were
        # accepted (the last draft is never fed while drafting); rewriting it otherwise is harmless.
        B = tokens.shape[0]
        rows = torch.arange(B, device=tokens.device)
        a = n_acc.clamp(min=0)
        prev = tokens[rows, a]  # [B]
        new_pos = start + n_acc + 1  # [B]
        pos = torch.stack([new_pos - 1, new_pos], 1)  # [B, 2]
        self.max_pos = int(new_pos.max())  # host sync: attended cache length
        toks = torch.stack([prev, bonus], 1)  # [B, 2]
        last = torch.ones(B, dtype=torch.long, device=tokens.device)
        self.next_logits = self._logits(toks, pos, self.max_pos + 1, last)  # [B, V]
        self.pos = new_pos


    def _feed_all(self, tokens, start, n_acc, bonus):
        """Feed the verified tokens [current, accepted drafts..., bonus] at positions start.. (columns
        past each row's bonus are junk in slots that later writes overwrite before they are read)."""
        toks, pos, idx = _verified(tokens, start, n_acc, bonus)  # [B, T + 1], [B, T + 1], [B]
        self.max_pos = int((start + idx).max())  # host sync: attended cache length
        self.next_logits = self._logits(toks, pos, int(pos.max()) + 1, idx)  # [B, V]
        self.pos = start + n_acc + 1
        self.fed_drafts = True


class HybridProposer(Proposer):
    """n-gram prompt lookup and the trained draft together. Code output repeats the prompt and itself
    (names, signatures, boilerplate), where a lookup proposes long runs for free; the model covers
    what has not been seen yet.

    Greedy decoding (the decoder's tree rounds, eval/tree.py): each round verifies one tree holding
    up to `branches` lookup continuations (of `k_ngram` tokens) and the model's chain of k, in at
    most `max_nodes` nodes over the batch (max_nodes / B per row, at least k): lookups matching
    >= `min_match` tokens first, then the model, then shorter matches (the order decides which
    nodes a full budget drops). Sampling (chains only): the
    lookup where it matches >= `min_match` tokens, the model elsewhere.

    The model proposer sees every verified token whoever proposed it (`accept` always runs), so its
    cache and features stay in sync. `k_ngram` lets lookups propose longer runs than the model
    (verifying a few more tokens costs little; drafting them with the model does not).

    `alt_branches`: a model with `alternatives()` (Medusa heads) also adds that many runner-up paths
    right after its chain (Medusa's sparse tree). On 24 HumanEval prompts at K=2 with 8 nodes, 2 of
    them raised tau from 2.81 to 2.98 and speed by ~2% (1.88x vs 1.84x); bigger trees (12 or 16
    nodes, 3 runner-ups) reached tau 3.2-3.5 but cost more than they gained (1.59-1.70x). Since the
    cheaper verifies of serving revision kernels-2, 3 runner-ups in 10 nodes beat 2 in 8 in each of
    three paired runs (recurrent heads, 24 prompts: 2.09x vs 2.06x, 1.99x vs 1.94x, 1.85x vs 1.82x;
    tau +0.16), and 12 nodes still lose (1.94x vs 2.06x), so that is the default. What a node costs is
    the machine's, though (on another VM 4-6 nodes measured 8% faster than 10): evaluate fits
    `max_nodes` on the machine it runs on (eval.replay.fit_budget) and best/ keeps the fitted one.

    `strong_match` (tree rounds): when every row's last `strong_match` tokens recur earlier (matches
    ranked by length up to `long_ngram` tokens), the round is lookups alone: up to `strong_branches`
    continuations of the longest matches, each as long as the node budget, and no model call. This is
    suffix decoding's rule (Oliaro et al., 2024, "SuffixDecoding"): a long suffix match means the
    output repeats itself, and then a lookup beats the draft. Simulated on the recorded heads' proposals
    and the target's greedy outputs (HumanEval, 24 and 60 prompts): 2.14x -> 2.31x and 1.94x -> 1.98x
    under the measured verify costs; 0 turns it off.

    `datastore` (eval.datastore, the target's own outputs on the training prompts): in tree rounds its
    `store_branches` most frequent continuations of the current suffix join the tree after the
    model's chain, ahead of the weak (1-token) prompt matches. Chains (sampling) do not use it."""

    name = "hybrid"
    trees = True

    def __init__(self, model: Proposer, min_match: int = 2, k_ngram: int | None = 8, max_ngram: int = 3,
                 branches: int = 2, max_nodes: int = 10, datastore=None, store_branches: int = 2,
                 alt_branches: int = 3, strong_match: int = 3, long_ngram: int = 8, strong_branches: int = 3):
        self.model = model
        self.alt_branches = alt_branches if model.has_alternatives else 0
        if self.alt_branches:
            model.with_alternatives = True  # it will be asked for them every tree round
        self.datastore, self.store_branches = datastore, store_branches
        self.ngram = NgramProposer(max_ngram=max_ngram, min_ngram=min_match)
        self.min_match, self.branches, self.max_nodes = min_match, branches, max_nodes
        self.strong_match, self.long_ngram, self.strong_branches = strong_match, long_ngram, strong_branches
        self.uses_features = model.uses_features
        self.k_ngram = k_ngram
        self.from_ngram = 0  # chain rounds proposed by the lookup (for stats)
        self.from_model = 0
        self.lookup_rounds = 0  # tree rounds the strong lookups filled alone (for stats)

    @property
    def max_k(self) -> int:
        """The longest run a round may propose: a lookup's k_ngram, or a strong match's whole budget."""
        return max(self.k_ngram or 0, self.max_nodes if self.strong_match else 0)

    def propose_tree(self, k):
        """-> per row (tokens, parents) of a trie over the lookups' continuations and the model's chain."""
        # The node budget is for the whole batch's verify forward. At batch 1 with the lean CPU
        # forward and its kernels (eval/target.py), a verify of 9 tokens costs ~1.4x a one-token step
        # and 17 ~2.1x: 10 nodes measured best there (docstring; evaluate fits it per machine); at
        # batch 8 the forward is compute-bound and every node costs. So each row gets max_nodes / B
        # nodes (at least k), spent in priority order.
        B = len(self.ngram.hist)
        budget = max(self.max_nodes // B, min(k, self.max_nodes))
        kn = self.k_ngram or k
        m = max(self.branches, self.strong_branches if self.strong_match else 0)
        # down to 1-token matches: in a tree a weak lookup only costs nodes the budget allows
        max_n = max(self.long_ngram, self.ngram.max_ngram) if self.strong_match else self.ngram.max_ngram
        found = [self.ngram.candidates(h, max(kn, budget), m, min_n=1, max_n=max_n)
                 for h in self.ngram.hist] if self.branches else [[]] * B
        stored = [self.datastore.candidates(h, kn, self.store_branches) if self.datastore else []
                  for h in self.ngram.hist]
        if self.strong_match and all(f and f[0][1] >= self.strong_match for f in found):
            # Every row's suffix recurs (>= strong_match tokens): the output is repeating itself, where
            # a lookup is right far more often than the draft. The round is lookups alone, the budget
            # spent on the strong matches' continuations (up to `budget` tokens, longest match first),
            # and the model is not run (it still sees the verified tokens in accept()).
            self.lookup_rounds += 1
            if isinstance(self.model, DraftLMProposer):
                self.model.fed_drafts = False
            return [build_trie([c for c, n in f if n >= self.strong_match][:self.strong_branches]
                               + [c for c, _ in st] + [c[:kn] for c, n in f if n < self.strong_match], budget)
                    for f, st in zip(found, stored)]
        drafts, _ = self.model.propose(k)  # [B, k]
        if isinstance(self.model, DraftLMProposer):
            self.model.fed_drafts = False  # the accepted path may be a lookup's: accept() feeds it all
        alts = self.model.alternatives(self.alt_branches) if self.alt_branches else [[]] * B
        rows = []
        # host sync: the model's chain joins the host-built tree
        for f, st, chain, alt in zip(found, stored, drafts.tolist(), alts):
            f = [(c[:kn], n) for c, n in f[:self.branches]]
            cands = [c for c, n in f if n >= self.min_match] + [chain] + alt + [c for c, _ in st] \
                + [c for c, n in f if n < self.min_match]
            rows.append(build_trie(cands, budget))
        return rows

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.ngram.begin(prompts, first, max_len, sampling)
        self.model.begin(prompts, first, max_len, sampling, features)

    def propose(self, k):
        drafts, q = self.ngram.propose(self.k_ngram or k)
        # Batch rows share one verify forward: use the lookup only when it found a run for every row.
        if drafts.shape[1] > 0 and all(self.ngram.found):
            if isinstance(self.model, DraftLMProposer):
                self.model.fed_drafts = False
            self.from_ngram += 1
            return drafts, q
        self.from_model += 1
        return self.model.propose(k)

    def accept(self, tokens, start, n_acc, bonus, features=None):
        self.ngram.accept(tokens, start, n_acc, bonus)
        self.model.accept(tokens, start, n_acc, bonus, features)


class EagleProposer(Proposer):
    """EAGLE head over the target's features and token embeddings.

    Head slot s holds the head's step for token position s + 1: input [feature_s ⊕ embed(token_{s+1})],
    output ≈ feature_{s+1}, whose logits propose token s + 2. (Slots start at 0 so a head trained
    on plain sequences with positions 0.. sees exactly the same RoPE offsets.)
    """

    name = "eagle"
    uses_features = True

    def __init__(self, head: EagleHead, target):
        p = target.get_output_embeddings().weight
        self.head = head.to(device=p.device, dtype=p.dtype).eval()
        self.embed = target.get_input_embeddings()
        self.d2t = self.head.d2t.to(p.device)  # [Vd] draft row -> target id
        self.vocab_size = target.config.vocab_size

    def _run(self, toks, feats, pos, idx):
        """toks [B, T] token ids at positions pos [B, T]; feats [B, T, H] target features at pos - 1.
        Writes head slots pos - 1; keeps the predicted feature at column idx [B] as the current one."""
        h = self.head(feats.to(self.dtype), self.embed(toks).to(self.dtype), pos - 1, self.caches)  # [B, T, H]
        rows = torch.arange(toks.shape[0], device=toks.device)
        self.cur_h = h[rows, idx]  # [B, H] predicted feature at the current token's position
        self.pos = pos[rows, idx]  # [B] position of the current token
        self.prev_feat = feats[rows, idx][:, None]  # [B, 1, H] true feature at (current position) - 1

    @property
    def dtype(self):
        return self.head.fc.weight.dtype

    def _logits(self, h):
        """[B, H] -> [B, V] target-vocab logits (rows outside the draft vocab at -inf)."""
        return to_target_vocab(self.head.logits(h), self.d2t, self.vocab_size)

    def begin(self, prompts, first, max_len, sampling, features=None):
        B, dev = len(prompts), first.device
        self.sampling = sampling
        self.caches = self.head.new_caches(B, max_len)
        L = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        T = int(L.max())
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)  # tokens at positions 1..T
        for b, p in enumerate(prompts):
            toks[b, : len(p) - 1] = torch.tensor(p[1:], device=dev)
        toks[torch.arange(B, device=dev), L - 1] = first
        pos = torch.arange(1, T + 1, device=dev).expand(B, T)
        self._run(toks, features[:, :T], pos, L - 1)

    def propose(self, k):
        drafts, qs = [], []
        h = self.cur_h
        for i in range(k):
            if self.sampling.greedy:  # argmax over the draft vocabulary, mapped: no [B, V] tensor
                tok, q = self.d2t[self.head.logits(h).argmax(-1)], None  # [B]
            else:
                tok, q = _draw(self._logits(h), self.sampling)  # [B], [B, V]
            drafts.append(tok)
            qs.append(q)
            if i + 1 < k:  # predicted feature ⊕ embed(draft) at the next position
                p = (self.pos + 1 + i)[:, None]  # [B, 1]
                e = self.embed(tok[:, None]).to(self.dtype)
                h = self.head(h[:, None], e, p - 1, self.caches)[:, 0]  # [B, H]
        q = None if self.sampling.greedy else torch.stack(qs, 1)
        return torch.stack(drafts, 1), q

    def accept(self, tokens, start, n_acc, bonus, features=None):
        # Re-run the head over the accepted tokens with the TRUE target features, plus the new current
        # token: inputs at positions start..start+T (T = k + 1 verified tokens, one more for `bonus`):
        #   column j < n_acc + 1: feature_{start+j-1} ⊕ embed(tokens[j])
        #   column n_acc + 1:     feature_{start+n_acc} ⊕ embed(bonus)
        # Columns past that are junk written into slots that later rounds overwrite before reading.
        toks, pos, idx = _verified(tokens, start, n_acc, bonus)  # [B, T + 1], [B, T + 1], [B]
        prev = self.prev_feat  # [B, 1, H] feature at start - 1
        feats = torch.cat([prev, features.to(prev.dtype)], 1)  # [B, T + 1, H]: feature at pos - 1
        self._run(toks, feats, pos, idx)


def load_proposer(path_or_kind, target, dtype=None) -> Proposer:
    """"ngram" -> NgramProposer(); "int8" -> DraftLMProposer over an int8 copy of the target (built
    now); "hybrid:<draft dir>" -> HybridProposer over that draft (and its datastore.npy, if any);
    "hybrid-nostore:<draft dir>" -> the same without the datastore; "datastore:<draft dir>" -> n-gram
    and datastore lookups alone, no draft (NoDraft); an EagleHead -> EagleProposer; a module (an HF
    model, or an eval.drafts draft, whose `d2t` is used) -> DraftLMProposer; a draft directory
    (draftsmith_draft.json says {"kind": "eagle" | "medusa" | "draft_lm" | "self_spec" | "int8"}, and "proposer": "hybrid" when it was promoted as a hybrid, "serve" its fitted tree budget) -> its proposer. A self_spec
    directory holds only the adapter: it is rebuilt around `target`, which must be its own target."""
    if isinstance(path_or_kind, Proposer):
        return path_or_kind
    if isinstance(path_or_kind, EagleHead):
        return EagleProposer(path_or_kind, target)
    if isinstance(path_or_kind, torch.nn.Module):
        return DraftLMProposer(path_or_kind, target.config.vocab_size, d2t=getattr(path_or_kind, "d2t", None))
    if path_or_kind == "ngram":
        return NgramProposer()
    if path_or_kind == "int8":
        return _int8_proposer(target)
    if isinstance(path_or_kind, str) and path_or_kind.split(":", 1)[0] in SERVED_AS:
        how, src = path_or_kind.split(":", 1)
        return _served(how, src, target, dtype)
    d = Path(path_or_kind)
    meta = draft_dir.read_meta(d)
    dtype = dtype or target.get_output_embeddings().weight.dtype
    if meta.get("proposer") == "hybrid":  # a promoted draft that is served with n-gram lookups
        return _served("hybrid", d, target, dtype)
    return _model_proposer(d, meta, target, dtype)




def _served(how: str, src, target, dtype) -> HybridProposer:
    """A draft directory served with n-gram lookups: "hybrid" with its datastore when it holds one,
    "hybrid-nostore" without it, "datastore" with the datastore and no draft. The draft is the
    directory's own model, whatever its "proposer" says (so a promoted best/ is not wrapped twice)."""
    from .datastore import Datastore, DatastoreError

    d = Path(src)
    is_draft = draft_dir.is_draft_dir(d)
    store = Datastore.from_dir(d) if is_draft and how != "hybrid-nostore" else None
    if how == "datastore":
        if store is None:
            raise DatastoreError(f"{d} holds no datastore.npy; train with train.datastore=true or give a draft "
                                 f"directory that has one")
        return HybridProposer(NoDraft(), datastore=store)
    if not is_draft:  # "ngram", "int8", or load_proposer's error for a directory that is no draft
        return HybridProposer(load_proposer(str(src), target, dtype))
    meta = draft_dir.read_meta(d)
    dtype = dtype or target.get_output_embeddings().weight.dtype
    # "serve": what evaluate fitted for serving this draft on its machine (the tree's node budget)
    return serve_with(HybridProposer(_model_proposer(d, meta, target, dtype), datastore=store),
                      meta.get("serve"), d / draft_dir.FILE)




def serve_with(proposer: Proposer, settings: dict | None, where) -> Proposer:
    """`proposer` with its serving settings ({"max_nodes": N}) set: the one place they are applied,
    for a promoted draft's "serve", evaluate's fitted budget and the fit's own replays. `where` names
    their source in the error for one this decoder does not know."""
    for key, val in (settings or {}).items():
        if key not in SERVE_KEYS or not isinstance(val, int) or val < 1:
            raise ValueError(f"{where}: serve.{key}={val!r} is not a hybrid setting this decoder knows "
                             f"({', '.join(SERVE_KEYS)}, a positive int); remove it or re-run evaluate")
        setattr(proposer, key, val)
    return proposer


def _int8_proposer(target) -> "DraftLMProposer":
    from .drafts import int8_draft

    return DraftLMProposer(int8_draft(target), target.config.vocab_size)


def _model_proposer(d: Path, meta: dict, target, dtype) -> Proposer:
    p = target.get_output_embeddings().weight
    kind = meta.get("kind")
    if kind == "eagle":
        return EagleProposer(EagleHead.load(d, dtype=dtype, device=p.device), target)
    if kind == "draft_lm":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).to(p.device)
        return DraftLMProposer(model, target.config.vocab_size)
    if kind == "self_spec":
        from .drafts import SelfSpecDraft

        draft = SelfSpecDraft.load(d, target, dtype=dtype, device=p.device)
        return DraftLMProposer(draft, target.config.vocab_size, d2t=draft.d2t)
    if kind == "int8":  # nothing stored: the int8 copy is built from the target now
        return _int8_proposer(target)
    if kind == "medusa":
        from .medusa import MedusaHeads, MedusaProposer

        return MedusaProposer(MedusaHeads.load(d, dtype=dtype, device=p.device), target)
    raise ValueError(f"{d}: unknown draft kind {kind!r} (expected 'eagle', 'medusa', 'draft_lm', "
                     f"'self_spec' or 'int8')")
