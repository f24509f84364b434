"""Rows per second of each generate.engine on the same training prompts, and how far their rows agree.

    python -m pipeline.generate_bench --recipe recipes/code.yaml --n 32 --out docs/reference/generate-engines.md

The draftsmith decoder and HF generate take turns batch by batch (the order rotating), so a shared machine's
drift falls on both alike; vLLM runs its own engine process over the same batches afterwards (one engine
at a time), timed without its startup, which is reported beside. Each engine's time includes what its
rows cost in the stage: the draftsmith and HF rows' top-k come from one teacher-forced forward per batch,
vLLM's from its decode loop.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch


def _prompt_batches(recipe, tok, n: int, workdir: Path):
    from .data import build_prompt_sets
    from .generate import plan_batches

    rows = build_prompt_sets(recipe.data, workdir, tok, recipe.seed)["train"]
    rows = random.Random(recipe.seed).sample(rows, min(n, len(rows)))
    return plan_batches(rows, tok, recipe.data.chat, recipe.generate.batch_size)


def measure(recipe, n: int, workdir: Path) -> dict:
    from .generate import batch_seed, generate_batch, make_decoder, target_eos_ids, vllm_rows
    from .models import load_target

    model, tok = load_target(recipe.target, recipe.dtype, "cpu")
    g = recipe.generate
    batches = _prompt_batches(recipe, tok, n, workdir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = target_eos_ids(model, tok)
    decoders = {"draftsmith": make_decoder(model, "draftsmith"), "hf": None}
    rows = {e: [] for e in decoders}
    secs = dict.fromkeys(decoders, 0.0)
    generate_batch(model, batches[0][:1], pad_id=pad, eos_ids=eos, max_new_tokens=4, temperature=0.0,
                   top_k=g.top_k_logprobs, seed=0, decoder=decoders["draftsmith"])  # warm-up, not timed
    for b, batch in enumerate(batches):
        order = list(decoders)[b % 2:] + list(decoders)[:b % 2]
        for e in order:
            t0 = time.perf_counter()
            rows[e] += generate_batch(model, batch, pad_id=pad, eos_ids=eos, max_new_tokens=g.max_new_tokens,
                                      temperature=g.temperature, top_k=g.top_k_logprobs,
                                      seed=batch_seed(recipe.seed, b), decoder=decoders[e])
            secs[e] += time.perf_counter() - t0
            print(f"[generate-bench] batch {b} {e}: {secs[e]:.0f}s so far", file=sys.stderr)
    t0 = time.perf_counter()
    rows["vllm"] = vllm_rows(recipe, list(enumerate(batches)), eos, workdir / "vllm")
    total = time.perf_counter() - t0
    res = json.loads((workdir / "vllm" / "generate.result.json").read_text())
    secs["vllm"] = res["runs"][0]["wall_s"]
    return {"rows": rows, "seconds": secs, "vllm_startup_s": res["startup_s"], "vllm_total_s": total,
            "vllm_version": res["vllm_version"], "n": sum(len(b) for b in batches), "threads": torch.get_num_threads()}


def markdown(m: dict, command: str, recipe) -> str:
    from .generate import agreement

    ref = m["rows"]["draftsmith"]
    g = recipe.generate
    lines = ["# generate.engine: rows per second and agreement", "",
             "`generate.engine` picks who decodes the training completions: `draftsmith` (this project's decoder; "
             "HF generate where the target is not Llama-shaped), `hf` (HF generate), `vllm` (vLLM from "
             "`.venv-engines`, `make engines`, through `pipeline/engines/vllm_worker.py`). All three write the same "
             "shard columns and manifest; the manifest's `engine` says which ran, and a greedy vLLM run records "
             "`engine_check`: its rows against our decoder's on the first batch. The draftsmith and HF rows' top-k "
             "log-probs come from one teacher-forced forward per batch, vLLM's from its own decode loop (raw "
             "log-softmax over the full vocabulary). In fp32 on a tiny Llama the three agree row for row, top-k "
             "included (tests/test_engines.py); in bf16 they part at near-ties, which the table counts.", "",
             f"Measured with `{command}` on {m['n']} training prompts of the code domain "
             f"(generate.batch_size={g.batch_size}, max_new_tokens={g.max_new_tokens}, greedy, "
             f"top_k_logprobs={g.top_k_logprobs}, dtype={recipe.dtype}).", "",
             "| engine | rows/s | new tokens/s | rows identical to the draftsmith decoder's | "
             "mean share of a row before the first difference |", "| --- | --- | --- | --- | --- |"]
    for e in ("draftsmith", "hf", "vllm"):
        rows, s = m["rows"][e], m["seconds"][e]
        toks = sum(len(r["completion_ids"]) for r in rows)
        a = agreement(rows, ref)
        lines.append(f"| {e} | {len(rows) / s:.2f} | {toks / s:.1f} | {a['identical']} of {a['rows']} | "
                     f"{a['prefix_agreement']:.2f} |")
    lines += ["", f"vLLM {m['vllm_version']}: its engine started in {m['vllm_startup_s']:.0f} s (not in its "
              f"rows/s; {m['vllm_total_s']:.0f} s for the whole subprocess). The draftsmith decoder and HF ran "
              f"with {m['threads']} torch threads in this process; vLLM-CPU's default binding on a 2-core "
              f"machine keeps one core for its front end and runs the model on the other."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from eval.loading import LoadError

    from .config import load_recipe
    from .data import DataError
    from .engines.vllm import EngineError
    from .models import ModelError
    from .options import RecipeError, positive

    ap = argparse.ArgumentParser(prog="python -m pipeline.generate_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", help="a recipe YAML (default: the --domain's)")
    ap.add_argument("--domain", default="code", help="the recipe of this domain, when no --recipe is given")
    ap.add_argument("--n", type=int, default=32, help="training prompts (default 32)")
    ap.add_argument("--out", help="write the Markdown table here")
    ap.add_argument("--json", help="write the timings here")
    ap.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    args = ap.parse_args(argv)
    try:
        positive("--n", args.n)
        recipe = load_recipe(args.recipe, args.overrides, domain=args.domain)
        with tempfile.TemporaryDirectory(prefix="draftsmith-genbench-") as d:
            m = measure(recipe, args.n, Path(d))
    except (RecipeError, DataError, ModelError, LoadError, EngineError) as e:
        print(f"generate_bench: {e}", file=sys.stderr)
        return 2
    command = "python -m pipeline.generate_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(m, command.strip(), recipe)
    print(md)
    if args.out:
        Path(args.out).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in m.items() if k != "rows"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
