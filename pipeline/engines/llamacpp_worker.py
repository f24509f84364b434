"""Runs inside the llama.cpp venv (`make bench-peers`: llama-cpp-python built from source), isolated (-I):
reads a job (a GGUF, prompts as token ids, methods), decodes every prompt greedily at batch 1 with each
method in turn, and writes tokens/s and the outputs. Imports nothing of draftsmith.

    python -I llamacpp_worker.py JOB.json RESULT.json
"""

import json
import sys
import time


def decode(llm, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    llm.reset()
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        if tok in eos:
            break
        out.append(tok)
        if len(out) >= max_new:
            break
    return out


def main(job_path: str, res_path: str) -> int:
    from llama_cpp import Llama, __version__
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    job = json.load(open(job_path))
    n_ctx = max(len(p) for p in job["prompts"]) + job["max_new_tokens"] + 16
    eos = set(job["eos_token_ids"])
    runs = []
    for method in job["methods"]:
        draft = None
        if method.startswith("lookup:"):  # prompt lookup decoding, llama.cpp's n-gram speculation
            draft = LlamaPromptLookupDecoding(num_pred_tokens=int(method.split(":")[1]))
        llm = Llama(model_path=job["gguf"], n_ctx=n_ctx, n_threads=job["threads"], n_batch=512, verbose=False,
                    draft_model=draft, seed=0)
        decode(llm, job["prompts"][0], 8, eos)  # warm-up
        outputs, t0 = [], time.perf_counter()
        for p in job["prompts"]:
            outputs.append(decode(llm, p, job["max_new_tokens"], eos))
        wall = time.perf_counter() - t0
        n = sum(len(o) for o in outputs)
        runs.append({"method": method, "tokens_per_s": n / wall, "new_tokens": n, "wall_s": wall, "outputs": outputs})
        del llm
    json.dump({"llama_cpp_version": __version__, "runs": runs}, open(res_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
