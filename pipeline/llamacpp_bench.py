"""llama.cpp, the engine a CPU user would pick instead, on the same held-out prompts as `draftsmith bench`:
plain greedy decoding and its prompt lookup (n-gram) speculation, batch 1, in the llama.cpp venv
(`make bench-peers` builds llama-cpp-python from source there and makes a bf16 GGUF of the target).

    python -m pipeline.llamacpp_bench --gguf F.gguf --prompts he.jsonl --n 16 \
        --method plain --method lookup:4 --json llamacpp.json

The prompts are our tokenizer's ids, given to llama.cpp as tokens, so both engines decode the same input.
Each speculative method's outputs are compared with plain's, prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).parent / "engines" / "llamacpp_worker.py"
PEERS_PYTHON = "DRAFTSMITH_PEERS_PYTHON"


class PeerError(RuntimeError):
    """The llama.cpp venv is missing or its run failed; the message says what to do."""


def peers_python() -> Path:
    py = Path(os.environ.get(PEERS_PYTHON) or ".venv-peers/bin/python")
    if not py.exists():
        raise PeerError(f"no llama.cpp venv at {py}: run `make bench-peers` (it builds llama-cpp-python from "
                        f"source, 5-18 min on 2 cores) or set {PEERS_PYTHON}")
    return py


def run(gguf: str, prompts: list[list[int]], methods: list[str], max_new_tokens: int, eos: list[int],
        threads: int) -> dict:
    """The worker's result for one job: {llama_cpp_version, runs: [{method, tokens_per_s, outputs, ...}]}."""
    with tempfile.TemporaryDirectory(prefix="draftsmith-llamacpp-") as d:
        job, res = Path(d) / "job.json", Path(d) / "result.json"
        job.write_text(json.dumps({"gguf": str(Path(gguf).resolve()), "prompts": prompts, "methods": methods,
                                   "max_new_tokens": max_new_tokens, "eos_token_ids": eos, "threads": threads}))
        p = subprocess.run([str(peers_python()), "-I", str(WORKER), str(job), str(res)], capture_output=True,
                           text=True)
        if p.returncode != 0 or not res.exists():
            tail = "\n".join((p.stderr or p.stdout).splitlines()[-10:])
            raise PeerError(f"llama.cpp worker exited with {p.returncode}:\n{tail}")
        return json.loads(res.read_text())


def main(argv=None) -> int:
    from eval.bench import BenchError, encode_prompts, load_prompts

    from .generate import target_eos_ids
    from .models import ModelError, load_target
    from .options import RecipeError, positive

    ap = argparse.ArgumentParser(prog="python -m pipeline.llamacpp_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, help="the target as a GGUF (make bench-peers makes a bf16 one)")
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct", help="for the tokenizer and EOS ids")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--method", action="append", default=[], help="plain or lookup:K")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    bad = [m for m in args.method if m != "plain" and not (m.startswith("lookup:") and m[7:].isdigit())]
    if bad:
        ap.error(f"--method {bad[0]}: use plain or lookup:K")
    methods = ["plain"] + [m for m in args.method if m != "plain"]
    try:  # bad input is reported in one line; the prompts before the target loads
        for flag, value in (("--n", args.n), ("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
            positive(flag, value)
        prompt_rows = load_prompts(args.prompts, args.n)
        model, tok = load_target(args.target, "float32", "cpu")
        prompts = encode_prompts(prompt_rows, tok)
        res = run(args.gguf, prompts, methods, args.max_new_tokens, sorted(target_eos_ids(model, tok)), args.threads)
    except (PeerError, BenchError, ModelError, RecipeError) as e:
        print(f"llamacpp_bench: {e}", file=sys.stderr)
        return 2
    plain = res["runs"][0]
    rows = []
    for r in res["runs"]:
        same = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
        rows.append({"engine": "llama.cpp", "version": res["llama_cpp_version"], "gguf": Path(args.gguf).name,
                     "method": r["method"], "batch_size": 1, "tokens_per_s": r["tokens_per_s"],
                     "speedup": r["tokens_per_s"] / plain["tokens_per_s"], "new_tokens": r["new_tokens"],
                     "identical_to_plain": same, "n_prompts": len(prompts), "threads": args.threads})
    print("| llama.cpp method | tok/s | vs its plain | outputs identical to plain |\n| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {r['identical_to_plain']}/{r['n_prompts']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
