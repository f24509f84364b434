"""Traffic for the retraining demo (docs/retraining-demo.md), written as a model owner's logs would be.

    python docs/demo/make_traffic.py code --run runs/code/demo-champion --n 300 --out traffic/code.jsonl
    python docs/demo/make_traffic.py chat --n 160 --out traffic/chat.jsonl

code: standard-library functions the champion's run never saw (neither trained on nor held out), as prompt rows.
chat: requests the embedded target writes from its own chat template's user turn (Magpie, pipeline/synth.py),
as OpenAI chat-completion request logs: another domain than the code champion was trained for.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def code_traffic(run: Path, n: int) -> list[dict]:
    from pipeline.data import normalise, read_jsonl, stdlib_prompts

    seen = {normalise(r["prompt"]) for f in ("train.jsonl", "heldout.jsonl", "val.jsonl")
            if (run / "prompts" / f).exists() for r in read_jsonl(run / "prompts" / f) if "prompt" in r}
    fresh = [r for r in stdlib_prompts() if normalise(r["prompt"]) not in seen]
    return [{"id": r["id"], "prompt": r["prompt"], "category": r["id"].split(":")[0].split(".")[0]}
            for r in fresh[:n]]


def chat_traffic(n: int, seed: int) -> list[dict]:
    from pipeline.models import load_target
    from pipeline.synth import SynthOptions, sample_requests

    model, tok = load_target("embedded:smollm2-135m-instruct", "bfloat16", "cpu")
    requests, _ = sample_requests(model, tok, SynthOptions(), n, seed, desc="chat traffic")
    return [{"custom_id": f"chat-{i}", "body": {"model": "smollm2", "messages": [{"role": "user", "content": q}]}}
            for i, q in enumerate(requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("code", "chat"))
    ap.add_argument("--run", type=Path, help="code: the champion's run directory (its prompts are left out)")
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = code_traffic(a.run, a.n) if a.kind == "code" else chat_traffic(a.n, a.seed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} {a.kind} traffic rows -> {a.out}")


if __name__ == "__main__":
    main()
