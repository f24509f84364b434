"""draftsmith's speculative decoder: prefill, then rounds of [propose K] -> [verify K+1 in one target
forward] -> [accept] -> [update caches], greedy or lossless speculative sampling, ragged batches.

The hot loop is ours by design, not HF `generate(assistant_model=...)`: we need per-position
acceptance statistics, each row of a batch accepting its own number of drafts per round, a
position-indexed KV cache (rejected drafts are overwritten, never cropped), EAGLE heads that read
the target's features, and timings split into draft and verify. It is written to be read top to
bottom: `stream` is the loop, `verify_greedy` / `verify_sample` the accept rules, `_Stats` the counters.

Host syncs: one per round (`.tolist()` of the accept decision, the drafts and the bonus token),
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
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch

from .proposers import Proposer, Sampling, load_proposer
from .kernels import MAX_ROWS
from .speedup import best_k, expected_speedup
from .target import cpu_gemv, greedy_argmax, make_runner
from .tree import Tree

K_MAX_AUTO = 8
# How this decoder serves proposers and runs the target, part of the key of every cached measurement
# (pipeline.evaluate's per-checkpoint results, pipeline.compare's decode rows): bump it when speed or
# acceptance would change, so a rerun measures again instead of reading results of the old decoder.
# "tree-1": hybrids verify token trees (eval/tree.py). "lean-cpu-2": the CPU GEMV/packed-weight
# forward and fp32 attention (eval/target.py), hybrid trees of at most 8 nodes. "datastore-1": a hybrid
# whose draft directory holds a datastore (eval/datastore.py) adds its continuations to the tree.
# "kernels-1": on CPUs with avx512_bf16, the row-invariant matmul and attention kernels
# (eval/kernels.py): cheaper verifies, and bf16 speculative output equal to plain output.
# "medusa-tree-1": a hybrid over Medusa heads adds the heads' runner-up paths to its tree
# (HybridProposer.alt_branches), and 13-16-row verifies run the kernel in two passes.
# "kernels-2": the matmul kernel prefetches its weights, the attention kernel's head width is a
# compile-time constant, Medusa heads draft through packed copies, and a tree round's K/V move is two
# ops: faster rounds, same tokens; hybrid trees of up to 10 nodes with 3 runner-up paths.
# "suffix-1": a hybrid round whose suffix recurs >= 3 tokens is lookups alone, without the draft
# (HybridProposer.strong_match).
# "fused-1": the lean forward's residual adds, RMSNorms, RoPE and SiLU * up are CPU kernels
# (LeanLlama._forward_fused): faster steps; bf16 numbers differ from the ATen ops' in rare last bits.
# "fused-2": attention straight from the projections (one kernel call writes k/v and attends), the argmax
# and the tree's accept rule without ATen's small ops, RoPE vectorised, Medusa heads drafting through int8
# copies: faster steps and rounds, the same output tokens. "fused-3": and each layer of a forward of <= 16
# rows as one kernel call (ext.layer).
SERVING_REV = "fused-3"
PROBE_EVERY = 16  # with k="auto" and speculation off: one speculative round every this many
WARMUP_PLAIN = 3  # with k="auto": plain steps first (the first one untimed), to measure what speculation must beat


@dataclass
class GenerationResult:
    sequences: list[list[int]]  # new tokens per prompt (EOS included when emitted)
    stats: dict = field(default_factory=dict)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last dim; falls back to p where p <= q everywhere."""
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(1e-30), p)


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
        # CUDA only: compile the step (not the loop). Shapes: T in {1, k+1}; s_len is kept at the
        # full cache length so the shapes stay static.
        self.static = bool(compile) and self.device.type == "cuda"
        if self.static:
            self._fwd = torch.compile(self.runner.__call__, dynamic=False)
        # Token trees (eval/tree.py) for proposers that offer them, under greedy decoding: they need
        # the lean runner's slots/mask/move, and their shapes vary, so not with the compiled step.
        self.tree = tree and hasattr(self.runner, "move") and not self.static

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, eos_token_id=None, seed: int = 0) -> GenerationResult:
        out = [[] for _ in prompts]
        gen = self.stream(prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed)
        for batch in gen:
            for o, new in zip(out, batch):
                o.extend(new)
        return GenerationResult(out, self.last_stats)

    @torch.inference_mode()
    def stream(self, prompts: list[list[int]], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, eos_token_id=None, seed: int = 0):
        """Yields, once per round, a list (per prompt) of the newly verified tokens."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        dev, B = self.device, len(prompts)
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) \
            else set(eos_token_id)
        gen = torch.Generator(device=dev).manual_seed(seed)
        sampling = Sampling(temperature, top_k, top_p, gen)
        k_cap = K_MAX_AUTO if self.k == "auto" else self.k
        # A proposer may propose longer runs than k (a hybrid's free n-gram lookups): size for them.
        k_cap = max(k_cap, self.proposer.max_k if self.proposer else 0)
        L = [len(p) for p in prompts]
        # a tree round writes one cache slot per node past the current token
        ahead = max(k_cap, self.proposer.max_nodes if self.tree and self.proposer else 0)
        max_len = max(L) + max_new_tokens + ahead + 2
        st = _Stats(k_cap)
        st.t0 = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        self.runner.reset(B, max_len)
        s_full = max_len if self.static else None

        # ---- prefill: prompts right-padded, each row at positions 0..L_b-1
        T = max(L)
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            toks[b, : len(p)] = torch.tensor(p, device=dev)
        pos = torch.arange(T, device=dev).expand(B, T)  # [B, T]
        L_t = torch.tensor(L, device=dev)  # [B]
        t = time.perf_counter()
        logits, feats = self.runner(toks, pos, T, logit_idx=L_t - 1)  # [B, 1, V], [B, T, H]
        cur = greedy_argmax(logits[:, 0]) if sampling.greedy else sampling.sample(sampling.probs(logits[:, 0]))
        first = cur.tolist()  # host sync: the first token
        st.prefill_s = time.perf_counter() - t
        st.target_forwards += 1
        n = L_t.clone()  # [B] position of the current (emitted, not yet verified) token
        n_host = list(L)
        out = [[] for _ in prompts]
        done = [False] * B
        yield self._emit(out, done, [[t] for t in first], eos, max_new_tokens)

        prop = self.proposer
        keep_feats = prop is not None and prop.uses_features and self.k == "auto"
        if keep_feats:  # features by position, to resync an EAGLE head after plain rounds
            featbuf = torch.zeros(B, max_len, feats.shape[-1], dtype=feats.dtype, device=dev)
            featbuf[:, :T] = feats
        synced = False
        self._plain = False
        if prop is not None:
            t = time.perf_counter()
            prop.begin(prompts, cur, max_len, sampling, feats if prop.uses_features else None)
            st.draft_prefill_s += time.perf_counter() - t
            synced = True

        # ---- rounds
        while not all(done):
            k = self._choose_k(st) if prop is not None else 0
            if k > 0 and not synced:  # back on after plain rounds: re-prefill the proposer
                t = time.perf_counter()
                hist = [(p + o)[:m] for p, o, m in zip(prompts, out, n_host)]  # tokens before each row's current one
                prop.begin(hist, cur, max_len, sampling, featbuf[:, : max(n_host)] if keep_feats else None)
                dt = time.perf_counter() - t
                st.draft_prefill_s += dt
                # k="auto" charges the resync to speculation: turning it back on costs this much, which
                # is what kept it on at batch 16 when only the rounds were counted (docs/benchmarks.md).
                st.spec_wall += dt
                synced = True
            active = [not d for d in done]
            t_round = time.perf_counter()  # this round's wall time (resyncs excluded) for k="auto"

            if k > 0 and sampling.greedy and self.tree and prop.trees:
                # a tree round: several candidates in one forward, then back to the chain layout
                inp, pos, feats, n_acc, bonus, host, k = self._tree_round(prop, k, cur, n, n_host, st)
            else:
                # propose
                if k > 0:
                    t = time.perf_counter()
                    with cpu_gemv(B, dev):  # the heads' matmuls have B rows: the native GEMV at batch 1-2 on CPU
                        drafts, q = prop.propose(k)  # [B, k'], [B, k', V] | None  (k' <= k)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    st.draft_s += time.perf_counter() - t
                    st.draft_steps += max(drafts.shape[1] - 1, 0)
                else:
                    drafts, q = torch.empty(B, 0, dtype=torch.long, device=dev), None
                k = drafts.shape[1]

                # verify: [cur, d1..dk] at positions n..n+k in one target forward
                t = time.perf_counter()
                inp = torch.cat([cur[:, None], drafts], 1)  # [B, k+1]
                pos = n[:, None] + torch.arange(k + 1, device=dev)  # [B, k+1]
                logits, feats = self._fwd(inp, pos, s_full or max(n_host) + k + 1)  # [B, k+1, V], [B, k+1, H]
                st.max_verify = max(st.max_verify, k + 1)
                if sampling.greedy:
                    n_acc, bonus = verify_greedy(logits, drafts)
                else:
                    n_acc, bonus = verify_sample(sampling.probs(logits), q, drafts, sampling)
                host = torch.cat([n_acc[:, None], bonus[:, None], drafts], 1).tolist()  # host sync: the accept decision
                st.verify_s += time.perf_counter() - t
            st.target_forwards += 1
            if keep_feats:
                featbuf.scatter_(1, pos[..., None].expand(-1, -1, feats.shape[-1]), feats)

            new = [h[2:2 + h[0]] + [h[1]] for h in host]
            st.round(k, [h[0] for h in host], active, time.perf_counter() - t_round)
            yield self._emit(out, done, [nw if a else [] for nw, a in zip(new, active)], eos, max_new_tokens)

            # update: finished rows (including those that just finished) freeze with n_acc = -1
            a_eff = [h[0] if not d else -1 for h, d in zip(host, done)]
            a_t = torch.tensor(a_eff, device=dev)
            bonus = torch.where(a_t >= 0, bonus, cur)
            if prop is not None and self._plain:
                synced = False  # k="auto" switched drafting off: the proposer resyncs before drafting
            elif prop is not None:
                t = time.perf_counter()
                prop.accept(inp, n, a_t, bonus, feats if prop.uses_features else None)
                dt = time.perf_counter() - t
                st.draft_s += dt
                st.draft_steps += 1
                st.spec_wall += dt
            n = n + a_t + 1
            n_host = [x + a + 1 for x, a in zip(n_host, a_eff)]
            cur = bonus

        # Every verify forward of this call rounded each row like a one-token step (eval/kernels.py):
        # greedy output must then equal plain decoding's bit for bit, in bf16 too.
        row_invariant = bool(getattr(self.runner, "row_invariant", False)) and st.max_verify <= MAX_ROWS
        self.last_stats = st.finish(out, self.k, self.device) | {"row_invariant": row_invariant}

    # ------------------------------------------------------------------ helpers
    def _tree_round(self, prop, k, cur, n, n_host, st):
        """Propose a token tree, verify all its nodes in one forward, move the accepted path's K/V to
        consecutive slots, and return the round in the chain layout the rest of the loop uses:
        inp [B, D+1] (current token + the accepted path, padded by repeating its last node), pos,
        feats [B, D+1, H], n_acc [B], bonus [B], host rows [n_acc, bonus, path tokens...], and the
        tree's depth (its longest candidate: the round's K in the statistics)."""
        dev = cur.device
        t = time.perf_counter()
        with cpu_gemv(cur.shape[0], dev):
            tree = Tree.from_lists(prop.propose_tree(k), dev)
        st.tree_rounds += 1
        st.draft_s += time.perf_counter() - t
        st.draft_steps += max(tree.max_depth - 1, 0)
        t = time.perf_counter()
        N1 = tree.depth.shape[1]
        inp = torch.cat([cur[:, None], tree.tokens], 1)  # [B, N+1]
        s_len = max(n_host) + N1
        slots = n[:, None] + torch.arange(N1, device=dev)  # [B, N+1]: one cache slot per node
        logits, feats = self.runner(inp, n[:, None] + tree.depth, s_len, slots=slots,
                                    mask=tree.mask(n, s_len))  # [B, N+1, V], [B, N+1, H]
        st.max_verify = max(st.max_verify, N1)
        dec = tree.accept_greedy(greedy_argmax(logits).tolist())  # host sync: the argmax at every node
        D = max(a for _, a, _ in dec)
        paths = [tree.path(b, bst) for b, (bst, _, _) in enumerate(dec)]
        paths = [p + [p[-1]] * (D + 1 - len(p)) for p in paths]  # pad: junk beyond each row's path
        path_idx = torch.tensor(paths, device=dev)  # [B, D+1]
        if any(p != list(range(D + 1)) for p in paths):  # host-side check: a chain needs no move
            self.runner.move(n[:, None] + path_idx[:, 1:], n[:, None] + torch.arange(1, D + 1, device=dev))
        inp = inp.gather(1, path_idx)  # [B, D+1]
        feats = feats.gather(1, path_idx[..., None].expand(-1, -1, feats.shape[-1]))  # [B, D+1, H]
        st.verify_s += time.perf_counter() - t
        host = [[a, bn] + row[1:] for (_, a, bn), row in zip(dec, inp.tolist())]
        pos = n[:, None] + torch.arange(D + 1, device=dev)  # [B, D+1]
        n_acc, bonus = torch.tensor([[a, bn] for _, a, bn in dec], device=dev).unbind(1)  # [B] each
        return inp, pos, feats, n_acc, bonus, host, tree.max_depth

    _plain = False  # set by _choose_k: this round is a plain (speculation off) round

    def _choose_k(self, st: "_Stats") -> int:
        """k="auto": warm up with WARMUP_PLAIN plain steps (their cost is what speculation must beat)
        and two rounds at K=4 (alpha, c and the verify cost), then pick the K with the best expected
        speedup; below 1, rounds go plain with a speculative probe every PROBE_EVERY rounds."""
        if self.k != "auto":
            return self.k
        self._plain = False
        if st.rounds < WARMUP_PLAIN:
            self._plain = True
            st.k_choices.append(0)
            return 0
        if st.spec_rounds < 2 or st.reached == 0:
            K = 4  # warm-up: measure alpha and c first
        else:
            K, v = best_k(st.alpha_hat, st.c, K_MAX_AUTO)
            # best_k assumes a verify forward of K+1 tokens costs a plain step, and nothing else costs
            # anything. That holds roughly at batch 1 on CPU, not at larger batches, where the
            # forward stops being memory-bound and the per-round overheads add up. So the on/off
            # decision uses measured throughput: tokens per second of speculative rounds against
            # plain rounds (the warm-up's, and every plain round since). This is what turns
            # speculation off as the batch grows.
            if st.plain_wall > 0 and st.spec_wall > 0:
                v = (st.spec_toks / st.spec_wall) / (st.plain_toks / st.plain_wall)
            st.expected_speedup = v
            if v < 1.0:  # speculation does not pay: plain rounds, probing back periodically
                st.off_rounds += 1
                if st.off_rounds % PROBE_EVERY:
                    self._plain = True
                    st.k_choices.append(0)
                    return 0
        st.k_choices.append(K)
        return K

    @staticmethod
    def _emit(out, done, new, eos, max_new):
        """Append each row's new tokens, cut at EOS (kept) and at max_new; returns what was kept."""
        kept = []
        for b, toks in enumerate(new):
            if done[b]:
                kept.append([])
                continue
            toks = toks[: max_new - len(out[b])]
            for i, t in enumerate(toks):
                if t in eos:
                    toks = toks[: i + 1]
                    break
            out[b].extend(toks)
            done[b] = len(out[b]) >= max_new or (bool(toks) and toks[-1] in eos)
            kept.append(toks)
        return kept


class _Stats:
    def __init__(self, k_cap: int):
        self.k_cap = k_cap
        self.rounds = self.row_rounds = self.target_forwards = 0
        self.proposed = self.accepted = self.reached = 0
        self.spec_rounds = self.spec_row_tokens = self.spec_row_rounds = 0
        self.pos_reached = [0] * k_cap
        self.pos_accepted = [0] * k_cap
        self.hist = [0] * (k_cap + 1)
        self.draft_s = self.verify_s = self.prefill_s = 0.0  # draft_s: rounds only (for c)
        self.draft_prefill_s = 0.0  # proposer begin()s: prompt prefill and resyncs
        self.draft_steps = 0
        self.off_rounds = 0
        self.tree_rounds = 0  # rounds verified as token trees (predicted_speedup is then an upper bound)
        self.max_verify = 1  # the most tokens one verify forward held (a tree's nodes + 1, or k + 1)
        self.plain_wall = self.spec_wall = 0.0  # k="auto": round wall time, plain and speculative
        self.plain_toks = self.spec_toks = 0  # ... and the tokens those rounds produced
        self.expected_speedup = None  # k="auto": the last estimate that drove the on/off decision
        self.k_sum = 0
        self.k_choices: list[int] = []
        self.row_tokens = 0

    def round(self, k: int, n_acc: list[int], active: list[bool], dt: float):
        """Count one round: k drafts proposed (0: a plain step), n_acc accepted per row, dt seconds."""
        self.rounds += 1
        if k > 0:
            self.spec_rounds += 1
            self.k_sum += k
        toks_before = self.row_tokens
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
        # k="auto" compares the throughput of plain and speculative rounds; the first round after
        # prefill runs ~25% slow (measured at batch 16), so it is left out.
        if self.rounds > 1:
            toks = self.row_tokens - toks_before
            if k == 0:
                self.plain_wall, self.plain_toks = self.plain_wall + dt, self.plain_toks + toks
            else:
                self.spec_wall, self.spec_toks = self.spec_wall + dt, self.spec_toks + toks

    @property
    def alpha_hat(self) -> float:
        return self.accepted / self.reached if self.reached else 0.0

    @property
    def c(self) -> float:
        if not self.draft_steps or not self.rounds:
            return 0.0
        return (self.draft_s / self.draft_steps) / (self.verify_s / self.rounds)

    def finish(self, out, k_setting, device) -> dict:
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
            "c": c,
            "predicted_speedup": pred,
            "tree_rounds": self.tree_rounds,
            "k": k_mean if k_setting == "auto" else k_setting,
            "k_setting": k_setting,
            "k_choices": self.k_choices,
            "spec_off_fraction": (self.k_choices.count(0) / len(self.k_choices)) if self.k_choices else 0.0,
            "expected_speedup": self.expected_speedup,
            "peak_mem_bytes": int(peak),
        }
