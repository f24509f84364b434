"""The proposer interface and what every proposer shares: `Proposer` (with its optional abilities
declared), `Sampling`, `NoDraft`, and the helpers `verified_input`, `to_target_vocab` and `draw`.

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

A proposer may also offer token trees (eval/tree.py), declared by `trees`:
    propose_tree(k) -> per row (tokens, parents) from eval.tree.build_trie, at most `max_nodes` nodes,
                       or (tokens, parents, {node: q [V]}) with one sampled chain's nodes
and then accept() receives the accepted path in the chain layout above. Trees are verified greedy or
sampled; under sampling a branch is deterministic (a function of the verified tokens, not of a draw:
eval.decoder.verify_tree_sample treats it as a one-hot draft) or one chain drawn from the q each of its
nodes names. A model proposer keeps begin()'s `sampling` as `self.sampling` and drafts by its `greedy`:
the hybrid swaps in a greedy one for its tree's deterministic model branches.

Positions are absolute token positions in each row; caches are position-indexed, so a rejected
draft's slot is overwritten by a later write and never needs cropping.
"""

from __future__ import annotations

import math

import torch

from ..cpu import cdf_draw


def check_sampling(temperature: float, top_k: int = 0, top_p: float = 1.0,
                   names: tuple[str, str, str] = ("temperature", "top_k", "top_p")) -> None:
    """ValueError naming (by `names`) the first setting out of range: temperature finite and >= 0 (0 = greedy),
    top_k >= 0 (0 = off), top_p in (0, 1] (1 = off). NaN compares false with everything, so each check is
    written as what a valid value satisfies."""
    t, k, p = names
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{t}={temperature!r} must be >= 0 and finite (0 = greedy)")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"{k}={top_k!r} must be >= 0 (0 = off)")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"{p}={top_p!r} must be in (0, 1]; 1 turns nucleus sampling off")


class Sampling:
    """Temperature / top-k / top-p warping shared by the target and the drafts; greedy at T == 0."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None):
        check_sampling(float(temperature), int(top_k), float(top_p))
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
        """[..., V] probabilities (maybe unnormalised) -> [...] token ids, one draw each."""
        return inverse_cdf_sample(probs, self.generator)


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] non-negative weights -> [...] ids, id i drawn with probability w_i / sum(w), by inverse
    transform (eval.cpu.cdf_draw) with one float64 uniform per row. Written out because the exponential race
    (argmax w / Exp(1)) and torch.multinomial cost ~1 ms a row on these CPUs, about a tenth of a step
    (docs/reference/trees.md, "Sampling cost")."""
    shape, V = probs.shape[:-1], probs.shape[-1]
    w = probs.reshape(-1, V).float()
    R = w.shape[0]
    u = torch.rand(R, dtype=torch.float64, device=w.device, generator=generator)  # [R]
    return cdf_draw(w, u).view(shape)


class Proposer:
    """What the decoder asks of a draft: begin a batch, propose K tokens a round, learn what was accepted.

    Optional abilities are declared here with their defaults, never probed with hasattr:
      uses_features  the decoder passes the target's final features to begin/accept
      feature_layers with uses_features: the target layer ids whose entering residual streams, concatenated
                     [.., n*H], are passed instead of the final features (EAGLE-3); None: the final ones
      max_k          > 0: may propose up to this many tokens even when asked for fewer
      trees          propose_tree() gives a token tree per row (verified at once, greedy or sampled)
      max_nodes      with trees: the tree's node budget over the batch (a serving setting)
      has_alternatives  alternatives(m) gives m runner-up paths after the last chain (Medusa's sparse tree)
      with_alternatives  set by a caller that will ask for alternatives() every greedy round (a hint)
      lookup_rounds  tree rounds filled by lookups alone, without calling a model (a counter)
    """

    uses_features = False
    feature_layers: tuple[int, ...] | None = None
    max_k = 0
    trees = False
    max_nodes = 0
    has_alternatives = False
    with_alternatives = False
    lookup_rounds = 0
    name = "proposer"

    def propose_tree(self, k: int):
        raise NotImplementedError(f"{type(self).__name__} proposes chains only (trees=False)")

    def alternatives(self, m: int):
        raise NotImplementedError(f"{type(self).__name__} has no runner-up paths (has_alternatives=False)")

    def drafted_elsewhere(self) -> None:
        """This round's drafts are not (only) this proposer's (a hybrid's lookups proposed or joined
        them): the next accept() may hold tokens it never drafted. Default: nothing to do."""

    def begin(self, prompts, first, max_len, sampling, features=None) -> None:
        raise NotImplementedError

    def propose(self, k: int):
        raise NotImplementedError

    def accept(self, tokens, start, n_acc, bonus, features=None) -> None:
        raise NotImplementedError


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


def target_device(target) -> torch.device:
    """Where a draft loaded for `target` goes: beside its LM head."""
    return target.get_output_embeddings().weight.device


def prefill_input(prompts: list[list[int]], first: torch.Tensor):
    """A feature-reading head's prefill input: each prompt shifted by one with the first generated token
    after it, so column t holds the token at position t + 1 (it reads the target feature at t).
    -> toks [B, T], pos [B, T] (1..T), idx [B] (the first token's column; T = the longest prompt)."""
    B, dev = len(prompts), first.device
    L = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
    T = int(L.max())
    toks = torch.zeros(B, T, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        toks[b, : len(p) - 1] = torch.tensor(p[1:], device=dev)
    toks[torch.arange(B, device=dev), L - 1] = first
    return toks, torch.arange(1, T + 1, device=dev).expand(B, T), L - 1


def verified_input(tokens, start, n_acc, bonus):
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


def draw(logits: torch.Tensor, sampling: Sampling, ids: torch.Tensor | None = None, vocab_size: int = 0):
    """[..., V] draft logits -> (tokens [...], q [..., V] or None). With `ids` [Vd] (draft row -> target id),
    the logits are [..., Vd] over a truncated draft vocabulary: the draw is made there and mapped, and q
    spread over the target's vocab_size ids (0 outside ids), the distribution to_target_vocab's -inf
    logits give at a sixth of the work for a 8k draft vocabulary (warping, like the draw, ignores ids
    with no mass)."""
    if sampling.greedy:
        tok = logits.argmax(-1)
        return (tok if ids is None else ids[tok]), None
    q = sampling.probs(logits)
    if ids is None:
        return sampling.sample(q), q
    full = q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(-1, ids, q)  # [..., V]
    return ids[sampling.sample(q)], full
