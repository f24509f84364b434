"""vLLM on `draftsmith bench`'s prompts: plain and n-gram speculative decoding, greedy, one request at a time
(batch 1, as bench's headline rows), tokens/s and the token match against vLLM's plain output. Its rows go
into bench's JSON under "vllm", beside our decoder's. `make bench-gpu` runs it where vLLM imports:

    python -m pipeline.vllm_bench --prompts runs/humaneval.jsonl --n-prompts 16 --json runs/bench-gpu.json

vLLM starts worker processes, so this runs as a module (`if __name__ == "__main__"`); each engine is torn
down before the next starts. Not run by `make test`: it needs vLLM (docs/reference/gpu.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from eval.bench import EMBEDDED, BenchError, encode_prompts, load_prompts, match_rate, resolve_target


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipeline.vllm_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=EMBEDDED, help="'embedded' (default) or a local HF checkpoint dir")
    ap.add_argument("--prompts", required=True, help="JSONL with 'prompt' or 'messages' per line")
    ap.add_argument("--n-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="n-gram speculative tokens (vLLM's prompt lookup)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--json", required=True, help="bench's JSON: its 'vllm' key is written (the file is created "
                    "if missing)")
    return ap


def run_engine(target: str, args, prompts: list[list[int]], speculative_config: dict | None) -> dict:
    """One vLLM engine: an untimed warm-up, then each prompt alone -> {tokens_per_s, n_tokens, time_s, sequences}."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=target, dtype=args.dtype, seed=0, speculative_config=speculative_config,
              gpu_memory_utilization=args.gpu_memory_utilization)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=16),
                 use_tqdm=False)
    seqs, elapsed = [], 0.0
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        elapsed += time.perf_counter() - t0
        seqs.append(list(out[0].outputs[0].token_ids))
    del llm  # its engine process exits; the next engine fits beside it anyway (--gpu-memory-utilization)
    gc.collect()
    n = sum(len(s) for s in seqs)
    return {"tokens_per_s": n / elapsed if elapsed else None, "n_tokens": n, "time_s": elapsed, "sequences": seqs}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from transformers import AutoTokenizer

        target = resolve_target(args.target)
        prompts = encode_prompts(load_prompts(args.prompts, args.n_prompts), AutoTokenizer.from_pretrained(target))
    except BenchError as e:
        print(f"vllm_bench: {e}", file=sys.stderr)
        return 2
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    rows = {"plain": run_engine(target, args, prompts, None), f"ngram@{args.k}": run_engine(target, args, prompts, ngram)}
    import vllm

    path = Path(args.json)
    out = json.loads(path.read_text()) if path.is_file() else {}
    ours = (out.get("plain") or {}).get("tokens_per_s")
    vl = {"version": vllm.__version__, "batch_size": 1, "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    for name, r in rows.items():
        vl[name] = {"tokens_per_s": r["tokens_per_s"], "n_tokens": r["n_tokens"], "time_s": r["time_s"],
                    "match_rate_vs_vllm_plain": match_rate(rows["plain"]["sequences"], r["sequences"]),
                    "vs_our_plain": r["tokens_per_s"] / ours if ours and r["tokens_per_s"] else None}
        print(f"vllm {name:<10} {r['tokens_per_s']:.1f} tok/s")
    out["vllm"] = vl
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
