"""draftsmith's speculative decoder: prefill, then rounds of [propose K] -> [verify K+1 in one target
forward] -> [accept] -> [update caches], greedy or lossless speculative sampling, ragged batches.

The hot loop is ours by design, not HF `generate(assistant_model=...)`: we need per-position
acceptance statistics, each row of a batch accepting its own number of drafts per round, a
position-indexed KV cache (rejected drafts are overwritten, never cropped), EAGLE heads that read
the target's features, and timings split into draft and verify. It is written to be read top to
bottom: `stream` is the loop (prefill, then a chain or tree round and its update, per round),
`verify_greedy` / `verify_sample` the chain's accept rules, `Tree.accept_greedy` / `verify_tree_sample`
the tree's, `KController` the k="auto" choice, `_Stats` the
counters.

Host syncs: one per round (`.tolist()` of the accept decision, the drafts and the bonus token; a
sampled tree round: three per level of the walk (p at the children, the uniforms, the mass), one more
per sampled child tried, and the bonus token),
plus whatever a proposer needs (the n-gram proposer lives on the host; the draft LM reads one int).

Statistics (GenerationResult.stats), counted over active rows only:
  alpha            accepted / proposed drafts
  alpha_hat        accepted / drafts *reached* (position i is reached when drafts 0..i-1 were
                   accepted): the per-token acceptance of the geometric model; predicted_speedup
                   and k="auto" use this one
  tau              tokens per verify round per row (accepted + the bonus token)
  accept_per_pos   acceptance rate at draft position i given it was reached
  accept_len_hist  counts of rounds that accepted 0..K drafts
  c                mean draft step time / mean target (verify) step time
  predicted_speedup (1 - a^(K+1)) / ((1 - a)(K c + 1)) with a = alpha_hat, K = mean K; with token
                   trees (tree_rounds > 0: K is the tree's depth, a the acceptance per depth) an
                   upper bound, since a verify of many nodes costs more than one plain step
  tree_rounds      rounds verified as token trees, greedy or sampled (verify_tree_sample); sampled,
                   the code heads' hybrid tree against its chain: 1.31x vs 0.93x plain at T=0.7,
                   0.92x vs 1.04x at T=1.0 (docs/reference/trees.md#sampling-t--0)
  k_choices        k="auto": the K chosen for each round (0: a plain step); spec_off_fraction the
                   share of zeros, expected_speedup the last estimate behind the on/off decision
  row_invariant    every verify forward rounded each row like a one-token step (eval/kernels.py)
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist

import torch

from .proposers import Proposer, Sampling, load_proposer
from .kernels import MAX_ROWS
from .speedup import best_k, clamped, expected_speedup
from .cpu import cpu_gemv, greedy_argmax, inductor_refusal
from .target import make_runner
from .tree import Tree

# Keys cached measurements (evaluate, compare): bump it when speed or acceptance would change (CHANGELOG.md).
SERVING_REV = "host-measured-1"
# Keys cached k="auto" measurements (the report's batch curve): bump it when KController decides otherwise.
CONTROLLER_REV = "untimed-charge-1"
K_MAX_AUTO = 8  # k="auto" chooses K in 1..K_MAX_AUTO
# A batch's prefill in groups that pad at most this share of their tokens: 32 HumanEval prompts padded to
# the longest were 1.70x their tokens, half of a 64-token call (docs/reference/k-auto.md)
PREFILL_WASTE = 0.2
# The target stops computing finished rows once at most this share of the rows it computes still run: a
# speculating batch's rows finish at different rounds (32 rows: 37 rounds where a row needed 29 on average)
DROP_SHARE = 0.75
WARMUP_PLAIN = 3  # k="auto": plain steps first (the first one untimed), to measure what speculation must beat
K_WARMUP = 4  # k="auto": the K of the rounds that first measure alpha and c
PROBE_EVERY = 16  # k="auto": a probe of another K every this many rounds (with speculation off, at first)
PROBE_BACKOFF = 8  # k="auto" off: probes that keep losing stretch the wait up to this many PROBE_EVERY
# k="auto" on, the best K expected under this many times plain's rate: its lower probe re-times a plain step, whose
# price goes stale while speculation runs (these VMs' speed drifts by tens of percent within a minute: k-auto.md)
RETIME_BELOW = 1.25
# ... where the resync that plain step causes costs at most this share of what the best K saves until the next one
RETIME_SHARE = 0.1
# k="auto" in a batch: the rows' own acceptance decides the batch's pace once they ran this many speculative rounds
# of a call on average (fewer left the slowest-looking row to chance: docs/reference/k-auto.md); before, the
# slowest of as many rows as far apart as last measured
LAGGARD_ROUNDS = 8
# k="auto": a round timed over this many times its K's price counts at this many times it. A stalled round (a busy
# host) then cannot switch speculation off where it pays, or a stalled plain step on where it loses; a lasting
# slowdown still moves the price within a few rounds (docs/reference/k-auto.md)
STALL_CLIP = 1.5
STATIC_MIN_LEN = 256  # compile=True: the KV cache length (the step's attended length), a power of two >= this


@dataclass
class GenerationResult:
    sequences: list[list[int]]  # new tokens per prompt (EOS included when emitted)
    stats: dict = field(default_factory=dict)
    # generate(logprobs=N): per prompt (ids [n, N], log-probs [n, N] float32, descending), the target's top N
    # at each new token's step (log-softmax of the raw logits over the full vocabulary), as vLLM's `logprobs`
    logprobs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # generate(features=True): per prompt [len(prompt) + n, H], the target's features (what its LM head reads)
    # at every position of prompt + new tokens, as a teacher-forced forward over them would give
    features: list[torch.Tensor] | None = None


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last dim; falls back to p where p <= q everywhere."""
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(1e-30), p)


def residual_one_hot(p: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """residual(p, one-hot(tok)) for each (row, tok) in `at` (two [n] index tensors), unnormalised: p [R, V]
    with those tokens taken out (max(0, p - 1) is 0 there and p elsewhere). O(1) work a token where
    residual() is O(V); inverse_cdf_sample takes weights."""
    return p.index_put(at, p.new_zeros(()))


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor):
    """logits [B, k+1, V] of the target at [cur, d1..dk]; drafts [B, k].
    -> n_acc [B] (leading drafts equal to the target's argmax), next [B] (argmax after them)."""
    g = greedy_argmax(logits)  # [B, k+1]
    ok = (drafts == g[:, :-1]).long()  # [B, k]
    n_acc = ok.cumprod(1).sum(1)  # [B]
    return n_acc, g.gather(1, n_acc[:, None])[:, 0]


def verify_sample(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, sampling: Sampling):
    """Lossless speculative sampling. p [B, k+1, V] target probabilities, q [B, k, V] the draft's
    (None: deterministic drafts, q one-hot), drafts [B, k] sampled from q.
    Draft i is accepted with probability min(1, p_i(x)/q_i(x)); at the first rejection the next
    token comes from residual(p_i, q_i); when all k are accepted, from p_k (the bonus token)."""
    B, k = drafts.shape
    V = p.shape[-1]
    rows = torch.arange(B, device=p.device)
    if q is None:
        q = torch.zeros(B, k, V, device=p.device, dtype=p.dtype).scatter_(2, drafts[..., None], 1.0)
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]  # [B, k]
    q_d = q.gather(2, drafts[..., None])[..., 0]  # [B, k]
    u = torch.rand(B, k, device=p.device, generator=sampling.generator)
    ok = (u * q_d < p_d).long()  # accept with probability min(1, p/q)
    n_acc = ok.cumprod(1).sum(1)  # [B]
    q_at = torch.cat([q, q.new_zeros(B, 1, V)], 1)[rows, n_acc]  # [B, V]; zeros when all accepted
    nxt = sampling.sample(residual(p[rows, n_acc], q_at))  # [B]
    return n_acc, nxt


def verify_tree_sample(p_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tree: Tree,
                       sampling: Sampling) -> list[tuple[int, int, int]]:
    """Lossless speculative sampling over a token tree: SpecInfer's multi-round rejection sampling (Miao et
    al., 2024). Each child is a draft distribution q_c: one-hot on its token for a deterministic branch
    (a lookup, an argmax chain), or the q its token was sampled from (tree.q_host: a sampled chain).
    p_at(rows [R], nodes [R]) -> [R, V] the target's (warped) probabilities at those nodes: asked only for the
    nodes the walk reaches (the root and each accepted child), not for all N+1.
    Per row, down from the root with p_res = p at the node: its children are tried in Tree.children's
    order (a sampled child first, while p_res is still the node's p), child c accepted with probability
    min(1, p_res(c) / q_c(c)), else p_res <- residual(p_res, q_c) (one-hot: p_res(c) is 0 after, so a
    sibling with the same token is never accepted; sampled: p_res(c) is 0 too, as a rejection means
    p(c) < q_c(c)); an accepted child becomes the node (p_res = p there); when every child was rejected,
    or there is none, the token after the node is sampled from p_res. p_res is kept unnormalised (its mass
    read when a child is tried). -> per row (deepest accepted node, its depth, the token after it), as
    Tree.accept_greedy.
    A one-hot rejection only takes its token's mass out, so a node's tries are host arithmetic on p at its
    children's tokens, read in one gather: a few tensor ops a level for all rows, where a tensor op per
    child tried cost ~1.5 ms a round at batch 1 (docs/reference/trees.md, "Sampling cost")."""
    B = len(tree.tokens)
    dev = tree.tokens.device
    kids = tree.children()  # per row: node -> its children, in order
    node, depth = [0] * B, [0] * B
    stop_p: list[torch.Tensor] = [None] * B  # per row: p (or a sampled child's residual) where its walk stopped
    out_rows, out_toks = [], []  # and the one-hot children rejected there, taken out of it at the end
    rows = list(range(B))
    while rows:
        p = p_at(torch.tensor(rows, device=dev), torch.tensor([node[b] for b in rows], device=dev)).float()  # [R, V]
        ch = [kids[b].get(node[b], []) for b in rows]
        C = max(map(len, ch))
        toks = [[tree.tokens_host[b][c - 1] for c in cs] + [0] * (C - len(cs)) for b, cs in zip(rows, ch)]  # [R, C]
        pc = p.gather(1, torch.tensor(toks, device=dev)).tolist() if C else [[]] * len(rows)  # [R, C] p at the children
        u = torch.rand(len(rows), C, device=dev, generator=sampling.generator).tolist()  # [R, C]
        mass = p.sum(-1).tolist()  # [R] host sync: with pc and u, every try of this level
        nxt = []
        for i, b in enumerate(rows):
            res, m, took, out = p[i], mass[i], None, []  # p_res: res less the tokens in `out`, of mass m
            val = dict(zip(toks[i], pc[i]))  # p_res at the children's tokens
            for j, c in enumerate(ch[i]):
                t = toks[i][j]
                q = tree.q_host[b].get(c) if tree.q_host else None
                qt = 1.0 if q is None else float(q[t])
                # accept with min(1, p_res(t) / q(t)), p_res normalised by m; a one-hot child holding all the
                # mass left (to fp32 rounding of m's subtractions) is accepted: p_res would be all zeros after it
                if u[i][j] * qt * m < val[t] or (q is None and val[t] >= m * (1 - 1e-6)):
                    took = c
                    break
                if q is None:  # one-hot: t's mass out of p_res
                    m -= val[t]
                    val[t] = 0.0
                    out.append(t)
                else:  # sampled, tried first (p_res is still p): p_res <- residual(p, q), t's share 0 now
                    res = residual(res / m, q)
                    m = float(res.sum())
                    val = dict(zip(toks[i], res[torch.tensor(toks[i], device=dev)].tolist()))
            if took is not None:
                node[b], depth[b] = took, depth[b] + 1
                nxt.append(b)
            else:
                stop_p[b] = res
                out_rows += [b] * len(out)
                out_toks += out
        rows = nxt
    p_res = torch.stack(stop_p)  # [B, V]
    if out_rows:
        p_res = residual_one_hot(p_res, (torch.tensor(out_rows, device=dev), torch.tensor(out_toks, device=dev)))
    last = sampling.sample(p_res).tolist()  # [B] host sync: the token after each row's node
    return list(zip(node, depth, last))


class SpeculativeDecoder:
    def __init__(self, target, proposer: Proposer | str | None = None, k: int | str = 4,
                 lean: bool = True, compile: bool = False, tree: bool = True):
        self.target = target.eval()
        self.proposer = None if proposer is None else load_proposer(proposer, target)
        if not (k == "auto" or (isinstance(k, int) and k >= 1)):
            raise ValueError(f"k must be a positive int or 'auto', got {k!r}")
        self.k = k
        self.runner = make_runner(target, lean)
        p = target.get_output_embeddings().weight
        self.device = p.device
        self._fwd = self.runner
        # compile=True: torch.compile the chain round's step (not the loop), inductor on CUDA or CPU.
        # Shapes: T in {1, k+1} (more where a proposer's runs vary in length: each compiles once), and
        # s_len is the whole cache (a power of two, never shrinking), so the shapes stay static across
        # rounds and calls.
        self.controllers: dict[int, KController] = {}  # k="auto": per batch size, kept across calls
        self.last_stats: dict = {}
        self.last_logprobs: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # stream(logprobs=N)
        self.last_features: list[torch.Tensor] | None = None  # stream(features=True)
        self.static = bool(compile)
        self.static_len = 0  # compile=True: the cache length of every call so far
        if self.static:
            if self.runner.path != "lean":  # compiled: the lean forward only
                raise ValueError(f"compile=True needs the lean forward (eval/family.py LEAN_FAMILIES); "
                                 f"{type(target).__name__} runs on the HF path: leave compile off")
            refusal = inductor_refusal(target.device)
            if refusal:
                raise ValueError(refusal)
            self._fwd = torch.compile(self._static_step, dynamic=False)
        # Token trees (eval/tree.py) for proposers that offer them, greedy or sampled: they need the
        # runner's slots/mask/move, and their shapes vary, so not with the compiled step.
        self.tree = tree and self.runner.trees and not self.static

    def _static_step(self, tokens, pos, s_len):
        """The compiled step: tokens, pos [B, T] over all s_len cache slots (the whole cache) under an
        explicit causal mask, since slots past each row's position hold stale K/V (the runner skips the
        mask at B = T = 1, which assumes s_len = pos + 1) -> (logits [B, T, V], feats [B, T, H])."""
        cols = torch.arange(s_len, device=tokens.device)
        mask = (cols[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
        return self.runner(tokens, pos, s_len, mask=mask)

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, eos_token_id=None, seed: int = 0,
                 logprobs: int = 0, features: bool = False) -> GenerationResult:
        out = [[] for _ in prompts]
        gen = self.stream(prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, logprobs, features)
        for batch in gen:
            for o, new in zip(out, batch):
                o.extend(new)
        return GenerationResult(out, self.last_stats, self.last_logprobs, self.last_features)

    @torch.inference_mode()
    def stream(self, prompts: list[list[int]], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, eos_token_id=None, seed: int = 0, logprobs: int = 0,
               features: bool = False):
        """Yields, once per round, a list (per prompt) of the newly verified tokens. logprobs=N keeps the
        target's top N log-probs of every step in `last_logprobs`, and features=True its features at every
        position in `last_features` (plain decoding: its steps run the row-invariant kernels a verify runs,
        so the generate stage needs no teacher-forced forward for either)."""
        if (logprobs or features) and self.proposer is not None:
            raise ValueError("logprobs and features are kept by plain decoding only: "
                             "use SpeculativeDecoder(target, None)")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        s = self._setup(prompts, max_new_tokens, Sampling(temperature, top_k, top_p, gen), eos_token_id)
        s.logprobs, s.keep_features = logprobs, features
        self.last_logprobs = self.last_features = None
        prop = self.proposer
        ctl = self._controller(len(prompts)) if self.k == "auto" and prop is not None else None

        first, feats = self._prefill(s)  # [B] host ints, [B, T, H]
        yield s.emit([[t] for t in first])
        self._begin(s, feats)

        while not all(s.done):
            self._drop_finished(s)
            k = self._choose_k(s, ctl)  # 0: a plain step
            if k > 0 and not s.synced:  # back on after plain rounds
                self._resync(s, ctl)
            active = [not d for d in s.done]
            t_round = time.perf_counter()  # this round's wall time (resyncs excluded) for k="auto"
            if k > 0 and self.tree and prop.trees:
                r = self._tree_round(s, k)
            else:
                r = self._chain_round(s, k)
            new = self._record(s, r, active)
            if ctl is not None:  # scored under the K it chose: a hybrid's tree depth (r.k) follows the text
                ctl.observe(k, time.perf_counter() - t_round, [h[0] for h, a in zip(r.host, active) if a],
                            rows=[b for b, a in enumerate(active) if a])
            yield s.emit(new)
            self._update(s, r, ctl, plain=k == 0)

        self.last_stats = self._finish(s, ctl)
        if logprobs:
            self.last_logprobs = self._logprobs(s)
        if features:
            self.last_features = self._features(s)

    # ------------------------------------------------------------------ the steps of stream()
    def _controller(self, batch: int) -> "KController":
        """k="auto"'s controller for this batch size: what earlier calls at it measured carries over (a round's
        cost is the machine's and the batch's, not the prompt's), so only the first call pays the warm-up.
        A new batch size warms up at the K the largest smaller one settled on (at least 1, at most K_WARMUP):
        a verify's cost grows with the batch, so the best K does not (docs/reference/k-auto.md), and a
        K_WARMUP round where no K pays costs several plain steps."""
        ctl = self.controllers.get(batch)
        if ctl is not None:
            ctl.next_call()
            return ctl
        below = [(b, c.settled()) for b, c in self.controllers.items() if b < batch]
        below = [k for _, k in sorted(below) if k is not None]
        k_warm = max(1, min(K_WARMUP, below[-1])) if below else K_WARMUP
        ctl = self.controllers[batch] = KController(K_MAX_AUTO, WARMUP_PLAIN, k_warm, PROBE_EVERY)
        return ctl

    def _setup(self, prompts, max_new_tokens, sampling, eos_token_id) -> "_Batch":
        """Size the position-indexed KV cache for the longest row and reset it; start the stats."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) \
            else set(eos_token_id)
        k_cap = K_MAX_AUTO if self.k == "auto" else self.k
        # A proposer may propose longer runs than k (a hybrid's free n-gram lookups): size for them.
        k_cap = max(k_cap, self.proposer.max_k if self.proposer else 0)
        # a tree round writes one cache slot per node past the current token
        ahead = max(k_cap, self.proposer.max_nodes if self.tree and self.proposer else 0)
        max_len = max(len(p) for p in prompts) + max_new_tokens + ahead + 2
        if self.static:  # the longest so far, as a power of two: later calls reuse its compiled shapes
            self.static_len = max(self.static_len, STATIC_MIN_LEN, 1 << (max_len - 1).bit_length())
            max_len = self.static_len
        st = _Stats(k_cap)
        st.t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.reset(len(prompts), max_len)
        # A proposer over intermediate layers (EAGLE-3) gets their residual streams as its features.
        self.runner.aux_layers = self.proposer.feature_layers if self.proposer is not None else None
        return _Batch(prompts, sampling, eos, max_new_tokens, max_len, max_len if self.static else None, st)

    def _prefill(self, s: "_Batch"):
        """The prompts in one target forward, right-padded (row b at positions 0..L_b-1), and the first
        token of each row -> (first tokens as host ints, the prompts' features [B, T, H])."""
        dev, B, L = self.device, len(s.prompts), [len(p) for p in s.prompts]
        T = max(L)
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(s.prompts):
            toks[b, : len(p)] = torch.tensor(p, device=dev)
        pos = torch.arange(T, device=dev).expand(B, T)  # [B, T]
        L_t = torch.tensor(L, device=dev)  # [B]
        t = time.perf_counter()
        groups = prefill_groups(L) if self.runner.row_groups else [list(range(B))]
        if len(groups) == 1:
            logits, feats = self.runner(toks, pos, T, logit_idx=L_t - 1)  # [B, 1, V], [B, T, H]
        else:  # each group padded to its own longest prompt (feats past a row's prompt stay zero)
            logits = feats = None
            for g in groups:
                idx, Tg = torch.tensor(g, device=dev), max(L[b] for b in g)
                with self.runner.rows(idx, Tg):
                    lg, fg = self.runner(toks[idx, :Tg], pos[idx, :Tg], Tg, logit_idx=L_t[idx] - 1)  # [g, 1, V], [g, Tg, H]
                if logits is None:
                    logits = lg.new_empty(B, *lg.shape[1:])
                    feats = fg.new_zeros(B, T, fg.shape[-1])
                logits[idx], feats[idx, :Tg] = lg, fg
        self._keep_logprobs(s, logits[:, 0])
        sampling = s.sampling
        cur = greedy_argmax(logits[:, 0]) if sampling.greedy else sampling.sample(sampling.probs(logits[:, 0]))
        first = cur.tolist()  # host sync: the first token
        s.stats.prefill_s = time.perf_counter() - t
        s.stats.target_forwards += 1
        s.cur, s.n, s.n_host = cur, L_t.clone(), list(L)  # the first token is the current one, at L_b
        return first, feats

    def _begin(self, s: "_Batch", feats: torch.Tensor):
        """Prefill the proposer. With k="auto" a feature-reading proposer keeps the target's features by
        position, to resync after plain rounds; stream(features=True) keeps them to return."""
        prop = self.proposer
        if s.keep_features or (prop is not None and prop.uses_features and self.k == "auto"):
            s.featbuf = torch.zeros(len(s.prompts), s.max_len, feats.shape[-1], dtype=feats.dtype,
                                    device=self.device)  # [B, max_len, F]: F = H, or n*H with feature_layers
            s.featbuf[:, : feats.shape[1]] = feats
        if prop is not None:
            t = time.perf_counter()
            prop.begin(s.prompts, s.cur, s.max_len, s.sampling, feats if prop.uses_features else None)
            s.stats.draft_prefill_s += time.perf_counter() - t
            s.synced = True

    def _drop_finished(self, s: "_Batch"):
        """Once at most DROP_SHARE of the rows the target computes are still running, its K/V cache keeps
        only theirs and later rounds compute them alone (the proposer still drafts for every row; a
        finished row's round is filled in by _spread and frozen by _update)."""
        if not self.runner.row_groups or self.static:
            return
        live = s.computed()
        keep = [i for i, b in enumerate(live) if not s.done[b]]
        if not keep or len(keep) > DROP_SHARE * len(live):
            return
        if s.keep_features:  # the rows dropped now never feed their last token later
            self._feed_last(s)
        self.runner.keep(keep, max(s.n_host))
        s.live_host = [live[i] for i in keep]
        s.live = torch.tensor(s.live_host, device=self.device)

    def _choose_k(self, s: "_Batch", ctl: "KController | None") -> int:
        """This round's K: 0 (a plain step) without a proposer, k="auto"'s choice, or the fixed k."""
        if self.proposer is None:
            return 0
        if ctl is None:
            return self.k
        rows = len(s.live_host) if s.live_host is not None else len(s.prompts)  # the rows the target computes
        remaining = {b: s.max_new - len(o) for b, (o, d) in enumerate(zip(s.out, s.done)) if not d}
        return ctl.choose(s.stats.alpha_hat, s.stats.c, measured=s.stats.reached > 0, rows=rows, remaining=remaining)

    def _resync(self, s: "_Batch", ctl: "KController | None"):
        """Re-prefill the proposer on every row's tokens before its current one (it missed the plain rounds)."""
        t = time.perf_counter()
        hist = [(p + o)[:m] for p, o, m in zip(s.prompts, s.out, s.n_host)]
        feats = s.featbuf[:, : max(s.n_host)] if s.featbuf is not None else None
        self.proposer.begin(hist, s.cur, s.max_len, s.sampling, feats)
        dt = time.perf_counter() - t
        s.stats.draft_prefill_s += dt
        if ctl is not None:
            ctl.charge(dt, resync=True)  # turning speculation back on costs this much
        s.synced = True

    def _chain_round(self, s: "_Batch", k: int) -> "_Round":
        """Propose k drafts (none: a plain step) and verify [cur, d1..dk] at positions n..n+k in one
        target forward."""
        B, dev, st = len(s.prompts), self.device, s.stats
        if k > 0:
            t = time.perf_counter()
            with cpu_gemv(B, dev):  # the heads' matmuls have B rows: the native GEMV at batch 1-2 on CPU
                drafts, q = self.proposer.propose(k)  # [B, k'], [B, k', V] | None  (k' <= k)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            st.draft_s += time.perf_counter() - t
            st.draft_steps += max(drafts.shape[1] - 1, 0)
        else:
            drafts, q = torch.empty(B, 0, dtype=torch.long, device=dev), None
        k = drafts.shape[1]

        t = time.perf_counter()
        inp = torch.cat([s.cur[:, None], drafts], 1)  # [B, k+1]
        pos = s.n[:, None] + torch.arange(k + 1, device=dev)  # [B, k+1]
        L = s.live  # the rows the target computes: [g] or None (all)
        x, xd, xq = (inp, drafts, q) if L is None else (inp[L], drafts[L], q[L] if q is not None else None)
        t_fwd = time.perf_counter()
        logits, feats = self._fwd(x, pos if L is None else pos[L], s.s_full or max(s.n_host) + k + 1)  # [g, k+1, V], [g, k+1, H]
        st.forward_s += self._elapsed(t_fwd)
        st.max_verify = max(st.max_verify, k + 1)
        st.max_rows = max(st.max_rows, x.shape[0] * (k + 1))
        if k == 0:
            self._keep_logprobs(s, logits[:, 0])
        if s.sampling.greedy:
            n_acc, bonus = verify_greedy(logits, xd)
        elif k == 0:  # a plain sampled step: nothing to accept, the next token from p
            n_acc, bonus = torch.zeros(x.shape[0], dtype=torch.long, device=dev), s.sampling.sample(s.sampling.probs(logits[:, 0]))
        else:
            n_acc, bonus = verify_sample(s.sampling.probs(logits), xq, xd, s.sampling)
        if L is not None:
            n_acc, bonus, feats = _spread(L, s.cur, n_acc, bonus, feats)
        host = torch.cat([n_acc[:, None], bonus[:, None], drafts], 1).tolist()  # host sync: the accept decision
        st.verify_s += time.perf_counter() - t
        return _Round(k, inp, pos, feats, n_acc, bonus, host)

    def _tree_round(self, s: "_Batch", k: int) -> "_Round":
        """Propose a token tree, verify all its nodes in one forward, move the accepted path's K/V to
        consecutive slots, and return the round in the chain layout: the current token + the accepted
        path, padded by repeating its last node; K is the tree's depth (its longest candidate)."""
        dev, st, n = self.device, s.stats, s.n
        t = time.perf_counter()
        L, B = s.live_host, len(s.prompts)
        with cpu_gemv(B, dev):
            lists = self.proposer.propose_tree(k)
            tree = Tree.from_lists(lists if L is None else [lists[b] for b in L], dev)  # the target's rows
        if L is not None:
            n = n[s.live]
        st.tree_rounds += 1
        st.draft_s += time.perf_counter() - t
        st.draft_steps += max(tree.max_depth - 1, 0)

        t = time.perf_counter()
        N1 = tree.depth.shape[1]
        cur = s.cur if L is None else s.cur[s.live]
        inp = torch.cat([cur[:, None], tree.tokens], 1)  # [g, N+1]: g = B, or the rows still computed
        s_len = max(s.n_host) + N1
        slots = n[:, None] + torch.arange(N1, device=dev)  # [g, N+1]: one cache slot per node
        mask = tree.mask(n, s_len)  # [g, 1, N+1, s_len]
        t_fwd = time.perf_counter()
        logits, feats = self.runner(inp, n[:, None] + tree.depth, s_len, slots=slots, mask=mask)  # [g, N+1, V], [g, N+1, H]
        st.forward_s += self._elapsed(t_fwd)
        st.max_verify = max(st.max_verify, N1)
        st.max_rows = max(st.max_rows, inp.shape[0] * N1)
        if s.sampling.greedy:
            dec = tree.accept_greedy(greedy_argmax(logits).tolist())  # host sync: the argmax at every node
        else:
            dec = verify_tree_sample(lambda r, j: s.sampling.probs(logits[r, j]), tree, s.sampling)  # -> host
        D = max(a for _, a, _ in dec)
        paths = [tree.path(b, bst) for b, (bst, _, _) in enumerate(dec)]
        paths = [p + [p[-1]] * (D + 1 - len(p)) for p in paths]  # pad: junk beyond each row's path
        path_idx = torch.tensor(paths, device=dev)  # [B, D+1]
        if any(p != list(range(D + 1)) for p in paths):  # host-side check: a chain needs no move
            self.runner.move(n[:, None] + path_idx[:, 1:], n[:, None] + torch.arange(1, D + 1, device=dev))
        inp = inp.gather(1, path_idx)  # [B, D+1]
        feats = feats.gather(1, path_idx[..., None].expand(-1, -1, feats.shape[-1]))  # [B, D+1, H]
        st.verify_s += time.perf_counter() - t
        n_acc, bonus = torch.tensor([[a, bn] for _, a, bn in dec], device=dev).unbind(1)  # [g] each
        if L is not None:  # a finished row's round: its current token, nothing accepted (frozen by _update)
            n_acc, bonus, feats = _spread(s.live, s.cur, n_acc, bonus, feats)
            full = s.cur[:, None].repeat(1, D + 1)
            full[s.live] = inp
            inp, n = full, s.n
        host = torch.cat([n_acc[:, None], bonus[:, None], inp[:, 1:]], 1).tolist()  # [a, bonus, path...] per row
        pos = n[:, None] + torch.arange(D + 1, device=dev)  # [B, D+1]
        return _Round(tree.max_depth, inp, pos, feats, n_acc, bonus, host)

    def _elapsed(self, t: float) -> float:
        """Seconds since t of the work queued on the device (a CUDA forward returns before it runs)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t

    @staticmethod
    def _keep_logprobs(s: "_Batch", logits: torch.Tensor):
        """logprobs=N: this step's top N log-probs per row, from its logits [g, V] of the rows the target
        computes (kept on the device; a dropped row's are zeros, past its last token)."""
        if s.logprobs:
            x = logits.float()
            top = x.topk(s.logprobs, dim=-1)  # [g, N] each
            ids, lp = top.indices, top.values - x.logsumexp(-1, keepdim=True)
            if s.live is not None:  # [g, N] -> [B, N]
                ids = ids.new_zeros(len(s.prompts), s.logprobs).index_copy_(0, s.live, ids)
                lp = lp.new_zeros(len(s.prompts), s.logprobs).index_copy_(0, s.live, lp)
            s.steps_lp.append((ids, lp))

    @staticmethod
    def _logprobs(s: "_Batch") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per row (ids [n, N], log-probs [n, N]) of its n new tokens: in plain decoding row b's j-th token
        came from step j (the prefill is step 0), whatever the other rows did."""
        ids = torch.stack([i for i, _ in s.steps_lp], 1).cpu()  # [B, steps, N]
        vals = torch.stack([v for _, v in s.steps_lp], 1).cpu()  # [B, steps, N]
        return [(ids[b, : len(o)], vals[b, : len(o)]) for b, o in enumerate(s.out)]

    def _feed_last(self, s: "_Batch"):
        """One plain step over the rows the target computes, each fed its last emitted token at its position,
        and their features there kept. A row's last token is emitted but never fed (a finished row freezes
        before it); for a running row it is the current token, whose K/V and features the next round writes
        again at the same position."""
        dev = self.device
        rows = s.computed()
        last = torch.tensor([s.out[b][-1] for b in rows], device=dev)[:, None]  # [g, 1]
        pos = torch.tensor([len(s.prompts[b]) + len(s.out[b]) - 1 for b in rows], device=dev)[:, None]  # [g, 1]
        _, feats = self._fwd(last, pos, s.s_full or int(pos.max()) + 1)  # [g, 1, H]
        s.featbuf[torch.tensor(rows, device=dev)[:, None], pos] = feats

    def _features(self, s: "_Batch") -> list[torch.Tensor]:
        """Per row its features [len(prompt) + n, H] at every position of prompt + its n new tokens."""
        self._feed_last(s)
        return [s.featbuf[b, : len(p) + len(o)].cpu() for b, (p, o) in enumerate(zip(s.prompts, s.out))]

    def _record(self, s: "_Batch", r: "_Round", active: list[bool]) -> list[list[int]]:
        """Count the round -> each active row's new tokens (its accepted drafts and the bonus token)."""
        s.stats.target_forwards += 1
        if s.featbuf is not None:  # the rows the target computed (a dropped row's round holds zeros)
            if s.live is None:
                rows, pos, feats = torch.arange(r.pos.shape[0], device=r.pos.device), r.pos, r.feats  # [B], ...
            else:
                rows, pos, feats = s.live, r.pos[s.live], r.feats[s.live]  # [g], [g, T], [g, T, H]
            s.featbuf[rows[:, None], pos] = feats  # index_put_: a bf16 scatter_ here cost 3.5 ms a round at batch 32
        s.stats.round(r.k, [h[0] for h in r.host], active)
        return [h[2:2 + h[0]] + [h[1]] if a else [] for h, a in zip(r.host, active)]

    def _update(self, s: "_Batch", r: "_Round", ctl: "KController | None", plain: bool):
        """Move every row past its accepted drafts: the bonus token becomes the current one, and the
        proposer learns what was verified. Finished rows (including those that just finished) freeze
        with n_acc = -1. After a plain round the proposer is left behind, to resync before it drafts."""
        a_eff = [h[0] if not d else -1 for h, d in zip(r.host, s.done)]
        a_t = torch.tensor(a_eff, device=self.device)  # [B]
        bonus = torch.where(a_t >= 0, r.bonus, s.cur)  # [B]
        prop = self.proposer
        if prop is not None and plain:
            s.synced = False
        elif prop is not None:
            t = time.perf_counter()
            prop.accept(r.inp, s.n, a_t, bonus, r.feats if prop.uses_features else None)
            dt = time.perf_counter() - t
            s.stats.draft_s += dt
            s.stats.draft_steps += 1
            if ctl is not None:
                ctl.charge(dt)
        s.n = s.n + a_t + 1
        s.n_host = [x + a + 1 for x, a in zip(s.n_host, a_eff)]
        s.cur = bonus

    def _finish(self, s: "_Batch", ctl: "KController | None") -> dict:
        # Every verify forward of this call rounded each row like a one-token step (eval/kernels.py):
        # greedy output must then equal plain decoding's bit for bit, in bf16 too.
        rows = self.runner.invariant_rows
        row_invariant = self.runner.row_invariant and s.stats.max_verify <= MAX_ROWS \
            and (rows is None or s.stats.max_rows <= rows)
        choices, expected = (ctl.choices, ctl.expected_speedup) if ctl is not None else ([], None)
        warm = ctl.warm_choices if ctl is not None else 0  # the first `warm` of k_choices were the warm-up's
        stats = s.stats.finish(s.out, self.k, self.device, choices, expected)
        return stats | {"row_invariant": row_invariant, "k_warmup_choices": warm}


@dataclass
class _Batch:
    """One stream() call's state: the rows' current tokens and outputs, and the proposer's sync."""
    prompts: list[list[int]]
    sampling: Sampling
    eos: set
    max_new: int
    max_len: int  # KV cache slots per row: the longest prompt + max_new + the most a round writes ahead
    s_full: int | None  # the compiled step's attended length (the whole cache), None: each round's own
    stats: "_Stats"
    cur: torch.Tensor | None = None  # [B] the current token (emitted, not yet verified)
    n: torch.Tensor | None = None  # [B] its position
    n_host: list[int] = field(default_factory=list)  # the same positions, on the host
    out: list[list[int]] = field(default_factory=list)  # new tokens per row
    done: list[bool] = field(default_factory=list)
    featbuf: torch.Tensor | None = None  # [B, max_len, H] target features by position (k="auto" resyncs, features=True)
    live: torch.Tensor | None = None  # [g] the rows the target still computes, in its cache's order (None: all B)
    live_host: list[int] | None = None  # the same rows, on the host
    synced: bool = False  # the proposer has seen every verified token
    logprobs: int = 0  # top log-probs kept per step (generate(logprobs=N))
    keep_features: bool = False  # generate(features=True): every position's features, returned
    steps_lp: list = field(default_factory=list)  # per step (ids [B, N], log-probs [B, N])

    def __post_init__(self):
        self.out = [[] for _ in self.prompts]
        self.done = [False] * len(self.prompts)

    def computed(self) -> list[int]:
        """The rows the target computes, in its cache's order."""
        return self.live_host if self.live_host is not None else list(range(len(self.prompts)))

    def emit(self, new: list[list[int]]) -> list[list[int]]:
        """Append each row's new tokens, cut at EOS (kept) and at max_new; returns what was kept."""
        kept = []
        for b, toks in enumerate(new):
            if self.done[b]:
                kept.append([])
                continue
            toks = toks[: self.max_new - len(self.out[b])]
            for i, t in enumerate(toks):
                if t in self.eos:
                    toks = toks[: i + 1]
                    break
            self.out[b].extend(toks)
            self.done[b] = len(self.out[b]) >= self.max_new or (bool(toks) and toks[-1] in self.eos)
            kept.append(toks)
        return kept


@dataclass
class _Round:
    """A verified round in the chain layout, what _update and the proposer's accept() read."""
    k: int  # drafts proposed (a tree round: the tree's depth; 0: a plain step)
    inp: torch.Tensor  # [B, T] the current token and the drafts (a tree round: the accepted path, padded)
    pos: torch.Tensor  # [B, T] their positions
    feats: torch.Tensor  # [B, T, H] the target's features there
    n_acc: torch.Tensor  # [B] drafts accepted
    bonus: torch.Tensor  # [B] the target's token after them
    host: list[list[int]]  # per row [n_acc, bonus, drafts...]: the round's one host sync


def _spread(live: torch.Tensor, cur: torch.Tensor, n_acc, bonus, feats):
    """A round computed for the rows `live` [g] -> the same for all B rows: a finished row accepts nothing,
    keeps its current token as the bonus, and has zero features -> (n_acc [B], bonus [B], feats [B, T, H])."""
    full_n = torch.zeros_like(cur)
    full_n[live] = n_acc
    full_b = cur.clone()
    full_b[live] = bonus
    full_f = feats.new_zeros(cur.shape[0], *feats.shape[1:])
    full_f[live] = feats
    return full_n, full_b, full_f


def prefill_groups(lengths: list[int], waste: float = PREFILL_WASTE) -> list[list[int]]:
    """The prefill's rows in groups of like length (shortest first): a group grows while padding its rows
    to its longest adds at most `waste` of their own tokens."""
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    groups, cur, tokens = [], [], 0
    for b in order:  # ascending: b is the longest of cur + [b]
        if cur and (len(cur) + 1) * lengths[b] > (1 + waste) * (tokens + lengths[b]):
            groups.append(cur)
            cur, tokens = [], 0
        cur.append(b)
        tokens += lengths[b]
    return groups + [cur]


def row_band(rows: int) -> int:
    """The band of a round's computed rows whose seconds k="auto" scores together: half an octave wide
    (1, 2, 3, 4, 5-6, 7-9, 10-13, 14-19, 20-26, 27-38, ...)."""
    return round(2 * math.log2(max(rows, 1)))


class KController:
    """k="auto": the K of each round (0: a plain step) that maximises measured throughput
    (docs/reference/k-auto.md).

    First `warmup` plain steps (the first one untimed), then rounds at `k_warmup` until two
    speculative rounds ran and some draft position was reached (once per decoder and batch size: a
    later call at the same batch size starts from what the earlier ones measured, `next_call`). From then
    on each K is scored by tokens per row-round over seconds per round (recent rounds weigh most).
    Tokens come from every speculative round, not only those run at K: a row that accepted a drafts in
    a round at K would have accepted min(a, K') at any K' <= K (the same drafts, exact for chains; for a
    hybrid's trees, whose node budget grows with K, a bound that favours the shorter K), so each draft
    position's acceptance, given the one before it was accepted, is pooled over all rounds that proposed
    it (a Kaplan-Meier estimate). A short per-K sample, taken where the text happened to be easy or hard,
    no longer decides (docs/reference/k-auto.md). Positions never proposed take alpha_hat (eval.speedup's
    geometric model); a hybrid's lookups past K add what they added at that K. Seconds are measured at
    each K (a stalled round counts at most STALL_CLIP times its K's price), and a K not run yet lies on
    the line through the measured rounds' times against K, so a verify that grows with the batch (the
    forward stops being bandwidth-bound) prices long drafts out, and K = 0 wins where no K pays. Seconds
    are kept per band of the rows the target computes (finished rows leave the forward, so a call's later
    rounds cost less at every K): a band first met starts from the last band's scores at the weight of one
    round, and a K not run there yet is priced as the band's timed K moved
    (_price). A batch ends with its slowest row, so a round's tokens count as far as they move that end
    (_batch_tokens). Every `probe_every` rounds the best K's neighbour runs once, to keep the scores fresh (below
    RETIME_BELOW, the lower neighbour is a plain step where the resync it causes costs at most RETIME_SHARE of
    what the best K saves until the next one: a price timed many rounds ago may be another machine speed's, so
    a K's older rounds also weigh less with every round since it was last timed, AGE); while off, the best K
    runs once as a probe, after a wait that doubles with each losing probe in that band of rows, across calls
    (up to PROBE_BACKOFF times). Turning
    speculation back on re-prefills the proposer (a resync): it is switched on only when the time the
    best K saves until the next probe exceeds the resyncs' measured cost. One K for the whole batch: a
    round's verify pads every row to the longest draft, so a shorter K for some rows saves no work."""

    DECAY = 0.8  # weight of a K's older rounds in its scores, per newer round at that K
    AGE = 0.9  # and per round since that K was last timed (a re-timed price soon outweighs the stale one)
    POOL_DECAY = 0.95  # weight of older rounds in the pooled per-position acceptance, per newer speculative round

    def __init__(self, k_max: int = K_MAX_AUTO, warmup: int = WARMUP_PLAIN, k_warmup: int = K_WARMUP,
                 probe_every: int = PROBE_EVERY):
        self.k_max, self.warmup, self.k_warmup, self.probe_every = k_max, warmup, k_warmup, probe_every
        self.choices: list[int] = []  # the K chosen for each round
        self.rounds = self.spec_rounds = 0  # rounds observed, and those that proposed drafts
        self.off_rounds = 0  # choices of K = 0 after the warm-up with speculation off (plain re-timing probes not counted)
        self.expected_speedup: float | None = None  # the best K's score over the plain step's, last choice
        # per K: decayed sums of [weight, seconds, a lookup's depth past K per row] of the rounds run at that K
        # (its tokens come from the pooled acceptance below), one table per band of computed rows (row_band)
        self.tables: dict[int, dict[int, list[float]]] = {}
        self.band: int | None = None
        self.arms: dict[int, list[float]] = {}  # the current band's table
        self.carried: dict[int, dict[int, float]] = {}  # per band met later: each K's seconds when carried into it
        self.timed: dict[int, set[int]] = {}  # per band: the K whose rounds were timed there
        self.stamp: dict[tuple[int, int], int] = {}  # per (band, K): `rounds` when that K was last timed there
        # per draft position j (index j - 1): decayed counts of rows that reached j in a round proposing it,
        # and of those that accepted it
        self.reached = [0.0] * k_max
        self.accepted = [0.0] * k_max
        # per band: rounds from one probe to the next while off (doubles while probes lose), and `rounds` at
        # its next probe; a band's own, so that a call's few-row tail, where speculation pays, does not restart
        # the full batch's wait in the next call (docs/reference/k-auto.md)
        self.gaps: dict[int, int] = {}
        self.due: dict[int, int] = {}
        self.resync_s = 0.0  # the measured cost of turning speculation back on (decayed mean of resyncs)
        self.retimed = False  # the last choice was a plain step re-timing plain's price while speculation paid
        self.last_k = 0
        self.ready = False  # warmed up: every later choice is scored
        self.call_rounds = 0  # rounds of the current call (its first, after the prefill, is not timed)
        self.alpha = 0.0  # the last measured per-token acceptance (a new call's own starts unmeasured)
        self.warm_choices = 0  # choices of the current call made during the warm-up
        # this call's rows (batch index): their speculative rounds, and the sum and the sum of squares of their
        # accepted drafts less each round's mean over its rows
        self.row_accepted: dict[int, tuple[int, float, float]] = {}
        self.round_means = [0.0, 0.0]  # the speculative rounds' mean accepted drafts and their count, decayed sums
        self.remaining: dict[int, int] | None = None  # the running rows' tokens left, at the last choice
        self.shares: dict[int, float] = {}  # _row_shares at the last choice of a batch of running rows
        self.spread = 0.0  # the rows' shares' spread between rows (a standard deviation), as last measured

    def choose(self, alpha_hat: float, c: float, measured: bool = True, rows: int = 1,
               remaining: dict[int, int] | None = None) -> int:
        """The next round's K, from what the rounds so far measured; alpha_hat (the per-token
        acceptance) models the K not measured yet (measured: some draft position was reached); rows: how many
        rows the target computes this round; remaining: each running row's tokens left (batch index -> count),
        to score a K by when the batch ends (_batch_tokens)."""
        self._at(row_band(rows))
        self.remaining = remaining
        self.shares = self._row_shares() if remaining and len(remaining) >= 2 else {}  # once, for every K's score
        if not self.ready:
            if self.rounds < self.warmup or self.spec_rounds < 2 or not measured:
                self.warm_choices += 1
                return self._pick(0 if self.rounds < self.warmup else self.k_warmup)
            self.ready = True
        if measured:
            self.alpha = alpha_hat
        alpha_hat = self.alpha
        if 0 not in self.arms:  # no plain step timed (warmup <= 1): the model's own estimate decides
            K, v = best_k(alpha_hat, c, self.k_max)
            self.expected_speedup = v
            return self._pick(K if v >= 1.0 else 0)
        K, spec, rate = self._best(alpha_hat)
        self.expected_speedup = rate[spec] / rate[0] if rate[0] > 0 else None
        if K and self.last_k == 0 and self.resync_s > 0:  # back on costs a resync: worth it until the next probe?
            # after a plain re-timing probe, until the next one (2 * probe_every rounds), as when it was taken
            K = K if self._saved(K, alpha_hat, rate, self.probe_every * (2 if self.retimed else 1)) > self.resync_s else 0
        self.retimed = False
        n, b = len(self.choices), self.band
        if K == 0:  # off: a probe of the best K when due, each losing probe doubling the band's wait for the next
            self.off_rounds += 1
            if self.rounds >= self.due[b]:
                self.due[b] = self.rounds + self.gaps[b]
                self.gaps[b] = min(2 * self.gaps[b], PROBE_BACKOFF * self.probe_every)
                K = spec
        else:  # on: the probe wait starts over once speculation stayed on past one winning probe
            if self.last_k > 0:
                self.gaps[b] = self.probe_every
            self.due[b] = self.rounds + self.gaps[b]
            if (n - self.warmup) % self.probe_every == self.probe_every - 1:  # the best K's neighbour, once
                if ((n - self.warmup) // self.probe_every) % 2:
                    K = min(K + 1, self.k_max)
                else:
                    # near break-even a plain step, where its resync costs a small share of what K saves meanwhile
                    self.retimed = (self.expected_speedup is not None and self.expected_speedup < RETIME_BELOW and
                                    self.resync_s <= RETIME_SHARE * self._saved(K, alpha_hat, rate, 2 * self.probe_every))
                    K = 0 if self.retimed else max(K - 1, 1)
        return self._pick(K)

    def _saved(self, K: int, alpha_hat: float, rate: dict[int, float], rounds: int) -> float:
        """Seconds that `rounds` rounds at K save over plain steps making the same progress."""
        return rounds * self._batch_tokens(self._tokens(K, alpha_hat)) * (1 / rate[0] - 1 / rate[K])

    def _best(self, alpha_hat: float) -> tuple[int, int, dict[int, float]]:
        """-> (the K to run by the scores, 0 when no K beats a plain step; the best K >= 1; rate per K)."""
        line = self._cost_line()
        rate = {k: self.rate(k, alpha_hat, line) for k in range(self.k_max + 1)}
        spec = max(range(1, self.k_max + 1), key=lambda k: (rate[k], -k))  # ties go to the shorter draft
        return (spec if rate[spec] > rate[0] else 0), spec, rate

    def settled(self) -> int | None:
        """The K this controller's scores pick for its widest band of rows, the whole batch (0: off), None
        before its warm-up ended."""
        band = max(self.tables, default=None)
        if not self.ready or band is None or 0 not in self.tables[band]:
            return None
        current = self.arms, self.band, self.remaining
        self.arms, self.band, self.remaining = self.tables[band], band, None  # the rows' mean: no call's laggard
        try:
            return self._best(self.alpha)[0]
        finally:
            self.arms, self.band, self.remaining = current

    def _at(self, band: int):
        """Score this round's seconds in `band`; a band first met starts from the current one's scores, each at
        the weight of one round, so that its own rounds soon outweigh them, and (while off) probes at once."""
        if band == self.band:
            return
        if band not in self.tables:
            self.tables[band] = {k: [1.0, w[1] / w[0], w[2] / w[0]] for k, w in self.arms.items()}
            self.carried[band] = {k: w[1] for k, w in self.tables[band].items()}
            # the first band probes after the warm-up and a wait; one met later at once, since the scores
            # carried over are another band's prices: measure this one's
            self.gaps[band] = self.probe_every
            self.due[band] = self.warmup + self.probe_every if self.band is None else self.rounds
        self.band, self.arms = band, self.tables[band]

    def rate(self, k: int, alpha_hat: float, line: tuple[float, float, float]) -> float:
        """Tokens per row per second at K = k: measured there, or modelled from the nearest measured K and
        the cost line (_cost_line)."""
        tok, sec = self._batch_tokens(self._tokens(k, alpha_hat)), self._seconds(k, line)
        return tok / sec if sec > 0 else 0.0

    def _batch_tokens(self, tokens: float) -> float:
        """A round's tokens per row at some K (`tokens`: the rows' mean) as the batch's progress: the plain steps
        it is worth. A batch ends with its last row, and a plain step moves every row one token, so a round moves
        the batch's end as far as it moves the row that finishes last: row b, with r_b tokens left, makes
        t_b = 1 + (tokens - 1) * s_b a round (s_b: its acceptance over the rows' mean, _row_shares), and the
        batch ends after max_b r_b / t_b rounds where plain steps need max_b r_b. Before the call's rows are
        known, s_b is the expected slowest of as many rows spread as the last measured (a normal order
        statistic, Blom's). One row, or rows that accept alike: `tokens` itself."""
        rem = self.remaining
        if not rem or len(rem) < 2 or tokens <= 1.0:
            return tokens
        share = self.shares
        if not share:  # rows not known yet: the expected slowest of n rows at the kept spread (k-auto.md)
            n = len(rem)
            return 1.0 + (tokens - 1.0) * max(1.0 - NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) * self.spread, 0.0)
        return max(rem.values()) / max(r / (1.0 + (tokens - 1.0) * share.get(b, 1.0)) for b, r in rem.items())

    def _row_shares(self) -> dict[int, float]:
        """Each row's accepted drafts a round over the rows' mean, shrunk to 1 as far as its rounds leave it to
        chance (empirical Bayes: the rows' spread beyond chance against the spread within one row, kept as
        `spread`). {} until the rows ran LAGGARD_ROUNDS speculative rounds of this call on average, or where
        they accept alike."""
        rows = self.row_accepted
        mean = self.round_means[0] / self.round_means[1] if self.round_means[1] else 0.0
        dof = sum(n - 1 for n, _, _ in rows.values())
        if mean <= 0 or dof <= 0:
            return {}
        within = sum(q - d * d / n for n, d, q in rows.values()) / dof  # a round's spread in one row
        between = max(sum((d / n) ** 2 - within / n for n, d, _ in rows.values()) / len(rows), 0.0)
        self.spread = math.sqrt(between) / mean  # the prior until a call's rows are known (_batch_tokens)
        if between <= 0 or dof < (LAGGARD_ROUNDS - 1) * len(rows):
            return {}
        return {b: max(1.0 + d / n * between / (between + within / n) / mean, 0.0) for b, (n, d, _) in rows.items()}

    def _mean(self, k: int, i: int) -> float:
        w = self.arms[k]
        return w[i] / w[0]

    def _price(self, k: int) -> float:
        """A round's seconds at K = k in this band: as timed here, or, for a K carried in from another band and
        not run here yet, its carried price scaled as this band's most-run timed K moved from its own carried
        price. Fewer rows make every round cheaper: a plain step priced at a fuller band's cost, while speculation
        alone was re-timed, made drafts look cheaper than they were."""
        carried, timed = self.carried.get(self.band, {}), self.timed.get(self.band, set())
        if k in timed or k not in carried:
            return self._mean(k, 1)
        ref = [j for j in timed if carried.get(j, 0.0) > 0]
        if not ref:
            return self._mean(k, 1)
        j = max(ref, key=lambda j: self.arms[j][0])
        return carried[k] * self._mean(j, 1) / carried[j]

    def _tokens(self, k: int, alpha_hat: float) -> float:
        """A round's tokens per row at K = k: 1 + the pooled chance of accepting each position up to k, + the
        lookups' depth past k (as measured at k, else at the nearest K run)."""
        if k == 0:
            return 1.0
        tokens, alive = 1.0, 1.0
        for j in range(k):
            alive *= self.accepted[j] / self.reached[j] if self.reached[j] > 0 else clamped(alpha_hat)
            tokens += alive
        near = min((j for j in self.arms if j > 0), key=lambda j: (abs(j - k), j), default=None)
        return tokens + (self._mean(near, 2) if near is not None else 0.0)

    def _cost_line(self) -> tuple[float, float, float]:
        """The least-squares line of a round's seconds against K over plain and the measured K ->
        (mean K, mean seconds, slope >= 0)."""
        pts = [(j, self._price(j)) for j in self.arms]
        kbar = sum(j for j, _ in pts) / len(pts)
        tbar = sum(t for _, t in pts) / len(pts)
        var = sum((j - kbar) ** 2 for j, _ in pts)
        slope = max(sum((j - kbar) * (t - tbar) for j, t in pts) / var, 0.0) if var else 0.0
        return kbar, tbar, slope

    def _seconds(self, k: int, line: tuple[float, float, float]) -> float:
        floor = self._price(0) if k and 0 in self.arms else 0.0  # a round with drafts does a plain step's work too
        if k in self.arms:
            return max(self._price(k), floor)  # measured cheaper than plain is noise: a useless draft never wins
        kbar, tbar, slope = line
        return max(tbar + slope * (k - kbar), floor)

    def _pick(self, k: int) -> int:
        self.choices.append(k)
        return k

    def observe(self, k: int, seconds: float, accepted: list[int], rows: list[int] | None = None):
        """A round ran at the K this controller chose (0: a plain step) in `seconds`; `accepted`: each active
        row's drafts accepted (`rows`: their batch indices, default 0..). Keyed by the choice, not by what the
        proposer made of it: a hybrid's lookups run deeper than K where the text repeats, so arms keyed by depth
        would credit predictable stretches to long K."""
        self.rounds += 1
        self.call_rounds += 1
        self.spec_rounds += k > 0
        self.last_k = k
        if k > 0 and accepted:
            self._pool(k, accepted)
            mean = sum(accepted) / len(accepted)
            self.round_means = [self.POOL_DECAY * self.round_means[0] + mean, self.POOL_DECAY * self.round_means[1] + 1]
            for b, a in zip(range(len(accepted)) if rows is None else rows, accepted):
                n, d, q = self.row_accepted.get(b, (0, 0.0, 0.0))
                self.row_accepted[b] = (n + 1, d + (a - mean), q + (a - mean) ** 2)
        n_rows = max(len(accepted), 1)
        if self.call_rounds == 1:  # the first round after prefill runs slow: left out of the timings
            return
        w = self.arms.setdefault(k, [0.0, 0.0, 0.0])
        self.timed.setdefault(self.band, set()).add(k)
        since = self.rounds - self.stamp.get((self.band, k), self.rounds - 1) - 1  # rounds at other K since
        self.stamp[(self.band, k)] = self.rounds
        beyond = sum(max(a - k, 0) for a in accepted) / n_rows
        if w[0] > 0:  # a stall moves the K's price (stale or not) by STALL_CLIP at most
            seconds = min(seconds, STALL_CLIP * w[1] / w[0])
        for i, x in enumerate((1.0, seconds, beyond)):
            w[i] = self.DECAY * self.AGE ** since * w[i] + x

    def _pool(self, k: int, accepted: list[int]):
        """Each position 1..k of this round: the rows that reached it (accepted every draft before it) and
        those that accepted it."""
        for j in range(min(k, self.k_max)):
            self.reached[j] = self.POOL_DECAY * self.reached[j] + sum(a >= j for a in accepted)
            self.accepted[j] = self.POOL_DECAY * self.accepted[j] + sum(a > j for a in accepted)

    def charge(self, seconds: float, resync: bool = False):
        """Speculation's cost outside a round: the proposer's accept() after the last round (counted in that
        round's seconds), or a resync (after plain rounds) before the next speculative one (what turning
        speculation back on costs)."""
        if resync:
            self.resync_s = seconds if not self.resync_s else self.DECAY * self.resync_s + (1 - self.DECAY) * seconds
        elif self.last_k in self.arms and self.last_k > 0 and self.call_rounds > 1:  # the call's first round is untimed
            self.arms[self.last_k][1] += seconds

    def next_call(self):
        """A new stream() at the same batch size: the scores carry over, the call's own counters start afresh."""
        self.choices, self.call_rounds, self.off_rounds, self.warm_choices = [], 0, 0, 0
        self.row_accepted, self.remaining = {}, None  # a new call's rows
        self.last_k = -1  # no round yet (a fresh proposer, no resync); each band's probe wait carries over


class _Stats:
    """Counters of one stream() call; finish() turns them into GenerationResult.stats."""

    def __init__(self, k_cap: int):
        self.k_cap = k_cap
        self.rounds = self.row_rounds = self.target_forwards = 0
        self.proposed = self.accepted = self.reached = 0
        self.spec_rounds = 0
        self.pos_reached = [0] * k_cap
        self.pos_accepted = [0] * k_cap
        self.hist = [0] * (k_cap + 1)
        self.draft_s = self.verify_s = self.prefill_s = 0.0  # draft_s: rounds only (for c)
        self.draft_prefill_s = 0.0  # proposer begin()s: prompt prefill and resyncs
        self.forward_s = 0.0  # the target's forwards in rounds (verifies and plain steps), nothing around them
        self.draft_steps = 0
        self.tree_rounds = 0  # rounds verified as token trees (predicted_speedup is then an upper bound)
        self.max_verify = 1  # the most tokens one verify forward held (a tree's nodes + 1, or k + 1)
        self.max_rows = 1  # the most rows (batch x tokens) one decode or verify forward held
        self.k_sum = 0
        self.row_tokens = 0

    def round(self, k: int, n_acc: list[int], active: list[bool]):
        """Count one round: k drafts proposed (0: a plain step), n_acc accepted per row."""
        self.rounds += 1
        if k > 0:
            self.spec_rounds += 1
            self.k_sum += k
        for a, on in zip(n_acc, active):
            if not on:
                continue
            self.row_rounds += 1
            self.row_tokens += a + 1
            if k == 0:
                continue
            self.proposed += k
            self.accepted += a
            self.hist[a] += 1
            for i in range(min(a + 1, k)):
                self.pos_reached[i] += 1
                self.pos_accepted[i] += int(i < a)
            self.reached += min(a + 1, k)

    @property
    def alpha_hat(self) -> float:
        return self.accepted / self.reached if self.reached else 0.0

    @property
    def c(self) -> float:
        if not self.draft_steps or not self.rounds:
            return 0.0
        return (self.draft_s / self.draft_steps) / (self.verify_s / self.rounds)

    def finish(self, out, k_setting, device, k_choices: list[int], expected: float | None) -> dict:
        wall = time.perf_counter() - self.t0
        n_tokens = sum(len(o) for o in out)
        k_mean = self.k_sum / self.spec_rounds if self.spec_rounds else 0.0
        c = self.c
        pred = expected_speedup(self.alpha_hat, k_mean, c) if self.spec_rounds else 1.0
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process RSS peak
        return {
            "alpha": self.accepted / self.proposed if self.proposed else 0.0,
            "alpha_hat": self.alpha_hat,
            "tau": self.row_tokens / self.row_rounds if self.row_rounds else 0.0,
            "accept_per_pos": [x / r if r else 0.0 for x, r in zip(self.pos_accepted, self.pos_reached)],
            "accept_len_hist": self.hist,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "n_tokens": n_tokens,
            "wall_s": wall,
            "tokens_per_s": n_tokens / wall if wall > 0 else 0.0,
            "prefill_s": self.prefill_s,
            "draft_time_s": self.draft_s + self.draft_prefill_s,
            "draft_prefill_s": self.draft_prefill_s,
            "verify_time_s": self.verify_s,
            "forward_time_s": self.forward_s,
            # the decoder's own work: the acceptance walk, the tree mask, the sampling, the loop
            "host_ms_per_round": 1e3 * max(wall - self.prefill_s - self.draft_s - self.draft_prefill_s
                                           - self.forward_s, 0.0) / self.rounds if self.rounds else 0.0,
            "c": c,
            "predicted_speedup": pred,
            "tree_rounds": self.tree_rounds,
            "k": k_mean if k_setting == "auto" else k_setting,
            "k_setting": k_setting,
            "k_choices": k_choices,
            "spec_off_fraction": (k_choices.count(0) / len(k_choices)) if k_choices else 0.0,
            "expected_speedup": expected,
            "peak_mem_bytes": int(peak),
        }
