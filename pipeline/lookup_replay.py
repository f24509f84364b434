"""How much the datastore proposer (`--format vllm-proposer`) accepts, and what its datastore's size and sources
are worth, replayed offline over the target's greedy text (eval/replay.py: a round's accepted length depends only
on the proposal and that text, so no verify forward runs and no timing noise enters).

    python -m pipeline.lookup_replay --export exports/store --prompts runs/humaneval.jsonl --n-prompts 16 \\
        --k 16 --fractions 0.25,0.5,1 --context-only --add stdlib

A row per datastore: the first fraction f of its sequences (`--fractions`), none (`--context-only`: the request's
own context alone, as prompt lookup), and the whole datastore with another corpus appended (`--add`: `stdlib`,
the standard library's sources the code recipe's prompts come from, tokenized as raw text, or a .npy of token
ids in datastore.npy's layout). Each row gives tau (tokens a verify round), the rounds, the drafted tokens a
round and the share of rounds that drafted nothing. The lookup's settings are the export's config.json's.
Measured: docs/reference/engines.md ("What more datastore buys").
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .datastore_proposer import LookupProposer
from .engines.draftsmith_vllm.lookup import DATASTORE, SEP, SuffixLookup, read_config
from .options import positive


class ReplayError(ValueError):
    """A bad argument or input: main() prints it on one line and returns 2."""


def fractions(text: str) -> list[float]:
    try:
        out = [float(f) for f in text.split(",")]
    except ValueError:
        raise ReplayError(f"--fractions {text!r}: give fractions in (0, 1] separated by commas, e.g. 0.5,1") from None
    if not out or any(not 0.0 < f <= 1.0 for f in out):
        raise ReplayError(f"--fractions {text!r}: each fraction must be in (0, 1], e.g. 0.25,0.5,1")
    return out


def head_sequences(corpus: np.ndarray, f: float) -> np.ndarray:
    """The first fraction f of the corpus's SEP-ended sequences (at least one)."""
    ends = np.flatnonzero(corpus == SEP)
    if not len(ends):
        return corpus
    return corpus[:ends[max(1, round(len(ends) * f)) - 1] + 1]


def stdlib_corpus(tok) -> np.ndarray:
    """The standard library's sources the code recipe draws its prompts from, each file's tokens then SEP."""
    from .data import _stdlib_files

    parts = [np.asarray(tok(p.read_text(errors="replace"), add_special_tokens=False)["input_ids"] + [SEP])
             for p in _stdlib_files(Path(sysconfig.get_paths()["stdlib"]))]
    return np.concatenate(parts).astype(np.int64)


def extra_corpus(spec: str, tok) -> np.ndarray:
    if spec == "stdlib":
        return stdlib_corpus(tok)
    p = Path(spec)
    if p.suffix != ".npy" or not p.is_file():
        raise ReplayError(f"--add {spec}: give 'stdlib' or an existing .npy of token ids (datastore.npy's layout)")
    arr = np.load(p, allow_pickle=False)
    if arr.ndim != 1 or arr.dtype.kind != "i":
        raise ReplayError(f"--add {spec}: holds a {arr.dtype} array of shape {arr.shape}, not 1-D token ids")
    return arr.astype(np.int64)


def joined(*corpora: np.ndarray) -> np.ndarray:
    """Corpora in datastore.npy's layout one after another, a SEP after each that does not end in one, so no match
    runs from one into the next."""
    parts = [part for c in corpora for part in ((c, [SEP]) if len(c) and c[-1] != SEP else (c,))]
    return np.concatenate(parts).astype(np.int64)


def variants(store: np.ndarray, fracs: list[float], context_only: bool, extra: dict[str, np.ndarray]):
    """(label, corpus) per row."""
    out = [("context only", None)] if context_only else []
    out += [(f"datastore {f:.0%}", head_sequences(store, f)) for f in fracs]
    out += [(f"datastore + {name}", joined(store, arr)) for name, arr in extra.items()]
    return out


def measure(ref, corpus, settings: dict, k: int, max_new_tokens: int, eos) -> dict:
    from eval.replay import replay

    lookup = SuffixLookup(corpus, **settings)
    res = replay(LookupProposer(lookup), ref, k, max_new_tokens, eos=eos)
    empty = res["rounds"] - sum(res["hist"].values())
    return {"corpus_tokens": lookup.n_tokens, "tau": res["tau"], "rounds": res["rounds"],
            "drafted_per_round": res["rows"] - 1, "no_draft_share": empty / res["rounds"] if res["rounds"] else 0.0}


def main(argv: list[str] | None = None) -> int:
    from eval.bench import BenchError, _eos_set, encode_prompts, load_prompts, resolve_target
    from eval.loading import LoadError
    from eval.replay import reference

    ap = argparse.ArgumentParser(prog="python -m pipeline.lookup_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True,
                    help="a --format vllm-proposer export, or a draft directory holding datastore.npy")
    ap.add_argument("--prompts", required=True, help="JSONL with 'prompt' or 'messages' per line (held-out)")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--target", default="embedded", help="'embedded' (default) or a local HF checkpoint dir")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=16, help="the most tokens a round drafts (the export's K)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--fractions", default="1", help="datastore sizes to replay: fractions of its sequences")
    ap.add_argument("--context-only", action="store_true", help="also a row without the datastore")
    ap.add_argument("--add", action="append", default=[], metavar="stdlib|FILE.npy",
                    help="also a row with this corpus appended to the whole datastore (repeatable)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        fracs = fractions(args.fractions)
        for flag, value in (("--k", args.k), ("--n-prompts", args.n_prompts), ("--max-new-tokens", args.max_new_tokens)):
            positive(flag, value)
        path = Path(args.export) / DATASTORE
        if not path.is_file():
            raise ReplayError(f"{path}: no datastore; give a draft trained with train.datastore=true or its "
                              f"`draftsmith export --format vllm-proposer` directory")
        store = np.load(path, allow_pickle=False).astype(np.int64)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tdir = resolve_target(args.target)
        tok = AutoTokenizer.from_pretrained(tdir)
        extra = {spec: extra_corpus(spec, tok) for spec in args.add}
        target = AutoModelForCausalLM.from_pretrained(tdir, dtype=getattr(torch, args.dtype)).eval()
        prompts = encode_prompts(load_prompts(args.prompts, args.n_prompts), tok)
    except (ReplayError, BenchError, LoadError, OSError, ValueError) as e:
        print(f"lookup_replay: {e}", file=sys.stderr)
        return 2
    settings = read_config(args.export)
    ref = reference(target, prompts, args.max_new_tokens)
    eos = _eos_set(tok, target)
    rows = []
    for label, corpus in variants(store, fracs, args.context_only, extra):
        r = {"datastore": label, **measure(ref, corpus, settings, args.k, args.max_new_tokens, eos)}
        rows.append(r)
        print(f"{label}: {r['corpus_tokens']:,} tokens, tau {r['tau']:.3f}, {r['rounds']} rounds, "
              f"{r['drafted_per_round']:.1f} drafted a round, {r['no_draft_share']:.1%} drafted nothing", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"export": str(args.export), "prompts": args.prompts,
                                               "n_prompts": len(prompts), "k": args.k, "dtype": args.dtype,
                                               "max_new_tokens": args.max_new_tokens, "settings": settings,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
