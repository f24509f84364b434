"""Greedy speculative rounds replayed offline: the τ of any proposer or tree policy, without timing.

Greedy decoding commits the target's greedy output whatever the draft proposes, so a round's accepted
length depends only on the proposal and that output: a node is accepted exactly when its path equals
the output's next tokens. `reference()` decodes each prompt once (plain greedy) and keeps the
target's features along the way, as plain decoding computes them; `replay()` then drives any
proposer through the same rounds the decoder would run (propose, accept, `accept()` with the
verified tokens and their features) in a fraction of a decode's time and free of this machine's
timing noise. Given verify times measured on this machine (`verify_ms()`), it also estimates the
speedup, to rank tree policies (docs/reference/replay.md); the decoder (`draftsmith bench`) stays the
judge of real speed.

Why not the decoder itself: it cannot skip the target's verify forwards, which are the time a
replay saves, and it has no place for a hypothetical proposer's what-ifs (a different node budget,
a synthetic draft of given accuracy).

Batch 1. With `sampling` (`--temperature`) the reference is the target's sampled text, along which
fixed drafts (lookups, argmax chains, runner-ups) accept as the decoder's sampled rounds do (replay()).
Where the kernels make every verify forward round like a one-token step (bf16 on every CPU path with
kernels: eval/cpu.py), the replayed rounds are the decoder's exactly; elsewhere features differ in the
last bits and a near-tie in a draft's choice may go the other way.

    python -m eval.replay --draft hybrid-nostore:runs/code/latest/best --prompts humaneval.jsonl \
        --n-prompts 40 --k 2 --costs --try max_nodes=8 --try k=3,max_nodes=12
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from .cli_args import OneLineParser
from .decoder import SpeculativeDecoder
from .proposers import NoDraft, Proposer, Sampling, check_sampling, serve_with
from .cpu import greedy_argmax
from .tree import Tree, build_trie


@dataclass
class Reference:
    prompts: list[list[int]]
    seqs: list[list[int]]  # per prompt: the greedy continuation, its first token included, no EOS stop
    feats: list[torch.Tensor]  # per prompt: [len(prompt) + len(seq) - 1, H] features at positions 0..


class _Recorder(NoDraft):
    """Proposes nothing and keeps the features the decoder hands over: the prefill's, then each
    step's (the feature at the current token's position), i.e. exactly plain decoding's."""

    uses_features = True

    def begin(self, prompts, first, max_len, sampling, features=None):
        super().begin(prompts, first, max_len, sampling, features)
        self.feats = [features[0, :len(prompts[0])].clone()]  # [L, H]

    def accept(self, tokens, start, n_acc, bonus, features=None):
        self.feats.append(features[0, :1].clone())  # [1, H] at position start


@torch.inference_mode()
def reference(target, prompts: list[list[int]], max_new_tokens: int, extra: int = 17,
              feature_layers: tuple[int, ...] | None = None, sampling: dict | None = None) -> Reference:
    """Each prompt decoded for max_new_tokens + extra tokens, EOS ignored: a round of the replay may
    accept past the end of the emitted output or past EOS (the decoder counts those tokens in τ too), up
    to the tree's depth, which `extra` must exceed (a kernel forward holds <= 16 rows). Greedily, or with
    `sampling` ({"temperature", "top_p", "top_k", "seed"}: prompt i drawn with seed + i) the target's own
    sampled continuation. The features kept are the final ones, or those of `feature_layers` (a
    proposer's, e.g. EAGLE-3's)."""
    rec = _Recorder()
    rec.feature_layers = feature_layers
    dec = SpeculativeDecoder(target, rec, k=1)
    sampling = sampling or {}
    warp = {key: sampling[key] for key in ("temperature", "top_p", "top_k") if key in sampling}
    seqs, feats = [], []
    for i, p in enumerate(prompts):
        seqs.append(dec.generate([p], max_new_tokens + extra, seed=sampling.get("seed", 0) + i, **warp).sequences[0])
        feats.append(torch.cat(rec.feats))  # [len(p) + len(seq) - 1, H]
    return Reference(prompts, seqs, feats)


def _accepted(seq: list[int], j: int, tokens: list[int], parents: list[int]) -> int:
    """The trie (tokens, parents; node 0 = the current token, seq[j]) against the greedy sequence ->
    how many of its nodes, root excluded, the longest path matching seq[j + 1:] holds."""
    kids = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens), start=1)}
    node, a = 0, 0
    while j + a + 1 < len(seq) and (node, seq[j + a + 1]) in kids:
        node, a = kids[(node, seq[j + a + 1])], a + 1
    return a


@torch.inference_mode()  # as the decoder's stream(): proposers write their caches in place
def replay(proposer: Proposer, ref: Reference, k: int, max_new_tokens: int, eos=(),
           verify_ms: dict[int, float] | None = None, draft_ms: float | None = 0.0, host_ms: float = 0.0) -> dict:
    """Run `proposer` through the decoder's rounds on `ref` -> {"tau", "rounds", "tokens",
    "rows" (mean tokens per verify forward), "hist" (accepted drafts per round that proposed any, the
    decoder's accept_len_hist), "first" (the share of those rounds that accepted their first draft)}; given
    verify_ms (rows -> ms of one verify forward) also "est_ms_per_round" and "est_speedup": plain decoding at
    verify_ms[1] a token against each round's verify_ms[rows] (the largest row count measured, for more
    rows) + host_ms, + draft_ms when the model ran (a hybrid's lookup-only rounds do not run it), or with
    draft_ms=None the proposer's own time in the round (propose and accept, measured here: "proposer_ms" is
    its mean). Trees where the proposer has `propose_tree`, else chains of k.

    On a sampled reference this is the decoder's sampled rounds for a proposer whose drafts are fixed
    tokens (lookups, argmax chains and runner-ups: one-hot q). Verifying a node's one-hot children in turn
    accepts child c with probability p(c), as drawing the next token from p and following the child it
    names does, so the accepted lengths have the distribution of walking the target's own sampled text
    (docs/reference/trees.md). A proposer that samples its drafts from q is not replayed this way."""
    eos = {eos} if isinstance(eos, int) else set(eos or ())  # one id, as the decoder takes it, or several
    timed = verify_ms is not None and draft_ms is None
    cuda = bool(ref.feats) and ref.feats[0].is_cuda
    proposer_s = 0.0
    tree = proposer.trees
    rounds = tokens = rows = 0
    hist: dict[int, int] = {}
    est = 0.0
    for p, seq, feats in zip(ref.prompts, ref.seqs, ref.feats):
        full = p + seq
        dev = feats.device  # the target's: the proposer's tensors live there
        first = torch.tensor([seq[0]], device=dev)
        proposer.begin([p], first, len(full) + 2, Sampling(0.0), feats[None, :len(p)] if proposer.uses_features else None)
        j = len(p)  # position of the current (emitted, not yet verified) token
        out = [seq[0]]
        done = len(out) >= max_new_tokens or seq[0] in eos
        while not done:
            lookups_before = proposer.lookup_rounds
            t0 = time.perf_counter()
            if tree:
                toks, pars = proposer.propose_tree(k)[0]
                t_prop = time.perf_counter()
                a = _accepted(full, j, toks, pars)
                n_rows = len(toks) + 1
                inp = [full[j + i] for i in range(a + 1)]  # the accepted path: the current token + a drafts
            else:
                drafts = proposer.propose(k)[0][0].tolist()  # host sync, as the decoder's round
                t_prop = time.perf_counter()
                a = _accepted(full, j, drafts, list(range(len(drafts))))  # a chain: node i's parent is i - 1
                n_rows = len(drafts) + 1
                inp = [full[j]] + drafts  # as the decoder's chain round passes it: every draft, a of them accepted
            if j + a + 1 >= len(full):
                raise ValueError(f"the reference is too short for a round accepting {a} drafts at position {j}: "
                                 "build it with a larger `extra`")
            bonus = full[j + a + 1]
            f = feats[j:j + len(inp)]  # [len(inp), H]: the reference's (only accepted positions are read)
            t1 = time.perf_counter()
            proposer.accept(torch.tensor([inp], device=dev), torch.tensor([j], device=dev),
                            torch.tensor([a], device=dev), torch.tensor([bonus], device=dev),
                            f[None] if proposer.uses_features else None)
            if cuda:
                torch.cuda.synchronize()  # host sync: the proposer's queued work belongs to this round's time
            # the proposer's time: propose and accept (the acceptance walk between them is the decoder's)
            round_s = (t_prop - t0) + (time.perf_counter() - t1) if timed else 0.0
            proposer_s += round_s
            rounds, tokens, rows = rounds + 1, tokens + a + 1, rows + n_rows
            if n_rows > 1:  # a round that proposed nothing is a plain step, outside the histogram (as the decoder's)
                hist[a] = hist.get(a, 0) + 1
            if verify_ms:
                ran_model = proposer.lookup_rounds == lookups_before
                drafting = round_s * 1e3 if timed else (draft_ms if ran_model else 0.0)
                est += verify_ms[min(n_rows, max(verify_ms))] + host_ms + drafting
            new = full[j + 1:j + a + 2][:max_new_tokens - len(out)]
            cut = next((i for i, t in enumerate(new) if t in eos), None)
            out += new if cut is None else new[:cut + 1]
            done = len(out) >= max_new_tokens or cut is not None
            j += a + 1
    drafted = sum(hist.values())
    res = {"tau": tokens / rounds if rounds else 0.0, "rounds": rounds, "tokens": tokens,
           "rows": rows / rounds if rounds else 0.0, "hist": dict(sorted(hist.items())),
           "first": 1 - hist.get(0, 0) / drafted if drafted else 0.0}
    if verify_ms and rounds:
        res["est_ms_per_round"] = est / rounds
        res["est_speedup"] = tokens * verify_ms[1] / est
        if timed:
            res["proposer_ms"] = proposer_s * 1e3 / rounds
    return res


def mid_context(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The cached tokens of a round halfway through decoding these prompts (their mean length + half the new
    tokens): what a typical verify attends to, so its measured cost is the decode's."""
    return round(statistics.mean(len(p) for p in prompts) + max_new_tokens / 2)


@torch.inference_mode()
def verify_ms(target, rows=range(1, 17), context: int = 230, reps: int = 7) -> dict[int, float]:
    """Median ms of one verify forward of T rows (a chain trie: the decoder's tree path, mask
    included; a chain on a runner without trees) after `context` cached tokens, for T in rows: the cost
    model of replay()'s estimate."""
    dec = SpeculativeDecoder(target, None, k=1)
    r, dev = dec.runner, dec.device
    r.reset(1, context + max(rows) + 1)
    V = target.config.vocab_size
    ids = torch.randint(V // 4, V, (1, context), device=dev)  # any tokens: the cost does not depend on them
    r(ids, torch.arange(context, device=dev)[None], context, logit_idx=torch.tensor([context - 1], device=dev))
    n = torch.tensor([context], device=dev)
    times: dict[int, list[float]] = {T: [] for T in rows}
    for _ in range(reps):  # interleaved, so a drift of this machine's speed hits every T alike
        for T in rows:
            t = Tree.from_lists([build_trie([[(7 + i) % V for i in range(T - 1)]], T - 1)], dev)
            inp = torch.cat([torch.tensor([[5]], device=dev), t.tokens], 1)  # [1, T]
            s_len = context + T
            t0 = time.perf_counter()
            if r.trees:
                logits, _ = r(inp, n[:, None] + t.depth, s_len, slots=n[:, None] + torch.arange(T, device=dev),
                              mask=t.mask(n, s_len))
            else:  # a runner without trees verifies the chain itself (a chain trie's nodes are its positions)
                logits, _ = r(inp, n[:, None] + t.depth, s_len)
            greedy_argmax(logits).tolist()  # host sync, as a round's accept does
            times[T].append((time.perf_counter() - t0) * 1e3)
    return {T: statistics.median(v[1:] if len(v) > 1 else v) for T, v in times.items()}


def host_ms(target, proposer: Proposer, prompts: list[list[int]], k: int, max_new_tokens: int, eos=(),
            sampling: dict | None = None) -> float:
    """The decoder's own work in a round (the acceptance walk, the tree mask, the sampling, the loop: neither
    the target's forwards nor the proposer's), measured here by decoding the first two prompts with
    `proposer` after a short warm-up -> ms a round. replay()'s estimate adds it to every round: it grows
    with the tree and with sampling, and differs by machine."""
    sampling = sampling or {}
    warp = {key: sampling[key] for key in ("temperature", "top_p", "top_k") if key in sampling}
    dec = SpeculativeDecoder(target, proposer, k=k)
    eos = [eos] if isinstance(eos, int) else list(eos or ())
    dec.generate(prompts[:1], min(16, max_new_tokens), eos_token_id=eos, seed=sampling.get("seed", 0), **warp)
    return dec.generate(prompts[:2], max_new_tokens, eos_token_id=eos, seed=sampling.get("seed", 0),
                        **warp).stats["host_ms_per_round"]


def fit_budget(target, proposers: dict, prompts: list[list[int]], k: int, max_new_tokens: int, eos=(),
               budgets=(4, 6, 8, 10, 12), costs: dict[int, float] | None = None,
               sampling: dict | None = None) -> dict:
    """The tree's node budget (`max_nodes`) that this machine serves fastest, for each tree proposer.

    What a node costs depends on the machine (docs/reference/trees.md): Sequoia (Chen et al., 2024)
    sizes its trees from the hardware's measured forward times for the same reason. Each budget is
    replayed (greedy acceptance is exact, so no timing noise enters τ) and costed with verify times
    measured here and the proposer's own time measured in the replay; the best estimated speedup wins.
    With `sampling` (the serving temperature's settings, see reference()) the replay walks the target's
    sampled text, which is how the argmax tree accepts when serving samples: there a node's siblings each
    add their token's probability, so a wider tree than greedy's can pay.

    proposers: {name: a zero-argument function building a fresh proposer with `max_nodes`}; costs:
    rows -> verify ms (measured here when None, after `context` cached tokens: mid_context()) ->
    {"verify_ms": {rows: ms}, "context", "host_ms": the decoder's own ms a round (host_ms(), measured with the first
    proposer at the middle budget), "fits": {name: {"max_nodes": best, "budgets": {n: {"tau", "rows",
    "est_speedup", "proposer_ms"}}}}}."""
    budgets = sorted(set(int(b) for b in budgets))
    if not budgets or budgets[0] < 1:
        raise ValueError(f"tree budgets must be positive node counts, got {budgets}")
    refs = {}  # per proposer's feature_layers: the reference with its features
    context = mid_context(prompts, max_new_tokens)
    if costs is None:  # a round verifies its nodes and the current token, after the cache a mid-decode round has
        costs = verify_ms(target, rows=range(1, budgets[-1] + 2), context=context)
    name, make = next(iter(proposers.items()))
    host = host_ms(target, serve_with(make(), {"max_nodes": budgets[len(budgets) // 2]}, name), prompts, k,
                   max_new_tokens, eos, sampling)
    fits = {}
    for name, make in proposers.items():
        by = {}
        for n in budgets:
            proposer = serve_with(make(), {"max_nodes": n}, name)
            layers = proposer.feature_layers
            if layers not in refs:
                refs[layers] = reference(target, prompts, max_new_tokens, extra=max(17, budgets[-1] + 2),
                                         feature_layers=layers, sampling=sampling)
            r = replay(proposer, refs[layers], k, max_new_tokens, eos, verify_ms=costs, draft_ms=None,
                       host_ms=host)
            by[n] = {key: r[key] for key in ("tau", "rows", "est_speedup", "proposer_ms")}
        fits[name] = {"max_nodes": max(budgets, key=lambda n: by[n]["est_speedup"]), "budgets": by}
    return {"verify_ms": costs, "context": context, "host_ms": host, "fits": fits}


def settings(proposer: Proposer) -> dict[str, int]:
    """The proposer's integer settings that --set/--try may change: the arguments it was built with
    (its constructor's parameters) that it keeps as int attributes, e.g. max_nodes or alt_branches.
    Counters and state (lookup_rounds, hist) are not settings."""
    params = inspect.signature(type(proposer).__init__).parameters
    return {k: v for k, v in vars(proposer).items() if k in params and type(v) is int}


def _parse_set(items: list[str]) -> dict[str, int]:
    """["max_nodes=8", "alt_branches=2,k=3"] -> {"max_nodes": 8, "alt_branches": 2, "k": 3}."""
    out = {}
    for it in (x for item in items for x in item.split(",") if x):
        key, sep, val = it.partition("=")
        if not sep or not val.lstrip("-").isdigit():
            raise ValueError(f"--set/--try want KEY=INT (a proposer setting, or k), got {it!r}")
        out[key] = int(val)
    return out


def main(argv: list[str] | None = None) -> int:
    from .bench import BenchError, _eos_set, encode_prompts, load_prompts, resolve_target
    from .loading import LoadError
    from .proposers import load_proposer

    ap = OneLineParser(prog="python -m eval.replay", description=__doc__.split("\n\n")[0], lead="replay")
    ap.add_argument("--target", default="embedded", help="'embedded' (default) or a local HF checkpoint dir")
    ap.add_argument("--draft", required=True, help="what `draftsmith bench --draft` takes (e.g. hybrid:DIR, ngram)")
    ap.add_argument("--prompts", required=True, help="JSONL with 'prompt' or 'messages' per line")
    ap.add_argument("--n-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="a proposer setting for this replay, e.g. max_nodes=8 or alt_branches=2 (repeatable)")
    ap.add_argument("--try", dest="tries", action="append", default=[], metavar="KEY=INT[,KEY=INT...]",
                    help="one more configuration replayed on the same reference (on top of --set; k=N sets K); "
                         "repeatable, each a row of the output")
    ap.add_argument("--costs", action="store_true", help="measure verify times here and estimate the speedup")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="replay along the target's text sampled at this temperature (the proposer's fixed "
                         "drafts accept as they would when serving it); 0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="prompt i's sampled reference is drawn with seed + i")
    args = ap.parse_args(argv)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if args.k < 1 or args.max_new_tokens < 1 or (args.n_prompts is not None and args.n_prompts < 1):
            raise BenchError("--k, --max-new-tokens and --n-prompts must be >= 1")
        check_sampling(args.temperature, 0, args.top_p, names=("--temperature", "--top-k", "--top-p"))
        if args.temperature == 0 and args.top_p < 1.0:
            raise BenchError(f"--top-p {args.top_p} shapes sampling, which --temperature 0 (greedy) never does: "
                             f"give --temperature > 0, or leave --top-p out")
        rows = load_prompts(args.prompts, args.n_prompts)  # a bad file is reported before the target loads
        path = resolve_target(args.target)
        tok = AutoTokenizer.from_pretrained(path)
        target = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        prompts = encode_prompts(rows, tok)
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed} \
            if args.temperature > 0 else None
        configs = [_parse_set(args.set)] + [_parse_set(args.set + [t]) for t in args.tries]

        def make(cfg: dict):
            proposer = load_proposer(args.draft, target)
            known = settings(proposer)
            for key, val in cfg.items():
                if key == "k":
                    if val < 1:
                        raise BenchError(f"--set/--try k={val}: K must be >= 1")
                    continue
                if key not in known:
                    raise BenchError(f"--set/--try {key}: {type(proposer).__name__} has no integer setting "
                                     f"{key!r} (it has: {', '.join(sorted(known)) or 'none'})")
                setattr(proposer, key, val)
            return proposer, cfg.get("k", args.k)
        made = [make(cfg) for cfg in configs]  # every bad key reported before the reference is decoded
    except (BenchError, LoadError, ValueError, OSError) as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    t = time.time()
    # an aux-layer draft (EAGLE-3, DFlash) reads the residual streams entering its layers (as fit_budget's references)
    ref = reference(target, prompts, args.max_new_tokens, feature_layers=made[0][0].feature_layers, sampling=sampling)
    print(f"reference: {len(prompts)} prompts decoded in {time.time() - t:.0f}s", file=sys.stderr)
    costs = verify_ms(target, context=mid_context(prompts, args.max_new_tokens)) if args.costs else None
    host = 0.0
    if costs:
        # the estimate's other costs: the proposer's time in each round (measured in the replay) and the
        # decoder's own work, measured with the first configuration's proposer (a fresh one: replay's is used once)
        proposer, k = make(configs[0])
        host = host_ms(target, proposer, prompts, k, args.max_new_tokens, _eos_set(tok, target), sampling)
        print("verify ms by rows: " + ", ".join(f"{T}:{v:.2f}" for T, v in costs.items())
              + f"; the decoder's own work {host:.2f} ms a round")
    for cfg, (proposer, k) in zip(configs, made):
        res = replay(proposer, ref, k, args.max_new_tokens, eos=_eos_set(tok, target), verify_ms=costs,
                     draft_ms=None, host_ms=host)
        label = ",".join(f"{key}={v}" for key, v in cfg.items() if key != "k") or "as loaded"
        line = (f"K={k} {label}: tau {res['tau']:.3f}, first position accepted {res['first']:.3f}, "
                f"{res['rows']:.1f} rows a verify")
        if costs:
            line += (f", est. {res['est_speedup']:.3f}x ({res['est_ms_per_round']:.2f} ms a round, "
                     f"{res['proposer_ms']:.2f} of it the proposer's)")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
