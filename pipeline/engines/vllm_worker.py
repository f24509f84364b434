"""Run one vLLM engine on a JSON job and write a JSON result (runs under the engine venv's python).

    python -I vllm_worker.py JOB.json RESULT.json

Imports only vllm (and its torch) and the standard library: vLLM pins an older transformers than draftsmith's venv, so
draftsmith never imports it and talks to this script through files (pipeline/engines/vllm.py).

Job keys: model (HF dir, or a speculators dir), dtype, speculative_config (dict or null), prompts (token-id
lists), max_tokens, batch_sizes (each one decodes every prompt in groups of that size), seed, logprobs (k > 0:
the top-k log-probs of each generated token), temperature (0: greedy), seeds (one per prompt, or null: seed),
ignore_eos, eos_token_ids (stop tokens besides the model's), max_model_len, max_num_seqs, kv_cache_gib,
warmup, profile (true: time vLLM's own step functions, see PROFILED), python_path (folders put first on
sys.path before vLLM starts: an export that ships the module a custom_class proposer names). Result keys: vllm_version, startup_s and
one entry of `runs` per batch size: outputs (generated ids per prompt), wall_s, new_tokens, tokens_per_s, spec
(vLLM's own spec-decode counters over that run, or null without speculation), with logprobs
topk_ids/topk_logprobs per prompt ([len][k]) and, with profile, `profile`: {part: {"s": seconds, "calls": n}}.
"""

import json
import os
import sys
import time

# This file's folder holds draftsmith's vllm.py: run as a script, `import vllm` must find the engine, not it.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def cap_cpu_isa():
    """DRAFTSMITH_CPU_PATH=avx2 (the emulated AVX2-only CPU of docs/reference/kernels.md) also gives vLLM an
    AVX2-only CPU: vLLM picks its kernel build (_C_AVX2 or the AVX-512 ones) and attention ISA from these torch
    checks, and oneDNN and ATen are capped by their own variables. Module level, so that the engine core, which
    vLLM-CPU starts with spawn (importing this script again), is capped too."""
    if os.environ.get("DRAFTSMITH_CPU_PATH") != "avx2":
        return
    import torch

    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)


cap_cpu_isa()


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

# Where an engine step's time goes: (part, module, class, method). The engine runs in this process for a
# profile (VLLM_ENABLE_V1_MULTIPROCESSING=0), so wrapping the classes' methods times every call.
PROFILED = (
    ("engine_step", "vllm.v1.engine.core", "EngineCore", "step"),
    ("engine_step", "vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"),
    ("execute_model", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("target_forward", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
    ("sample_tokens", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    ("sample", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample"),
    ("draft", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids"),
    ("draft_forward", "vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM", "forward"),
    ("draft_forward", "vllm.model_executor.models.medusa", "Medusa", "forward"),
)
TIMES: dict = {}


def install_timers():
    """Wrap each PROFILED method that this vLLM has with a timer adding to TIMES[part]; the parts it lacks
    are left out of the profile (so a renamed method shows as a missing part, never as zero time)."""
    import functools
    import importlib

    for part, mod, cls, meth in PROFILED:
        try:
            klass = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            continue
        fn = klass.__dict__.get(meth)
        if fn is None:
            continue

        def timed(*a, _fn=fn, _slot=TIMES.setdefault(part, {"s": 0.0, "calls": 0}), **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                _slot["s"] += time.perf_counter() - t
                _slot["calls"] += 1

        setattr(klass, meth, functools.wraps(fn)(timed))


def spec_counters(llm):
    """vLLM's cumulative spec-decode counters, summed over engines: {num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos}, or None when the engine does not speculate."""
    out, per_pos = {}, None
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            key = m.name.removeprefix("vllm:spec_decode_")
            out[key] = out.get(key, 0) + m.value
        elif m.name == PER_POS:
            per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else list(m.values)
    if not out:
        return None
    out["num_accepted_tokens_per_pos"] = per_pos or []
    return out


def counter_delta(after, before):
    if after is None:
        return None
    if before is None:
        return after
    d = {k: after[k] - before[k] for k in after if k != "num_accepted_tokens_per_pos"}
    a, b = after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"]
    d["num_accepted_tokens_per_pos"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return d


def top_logprobs(step_logprobs, k):
    """One generated position's {token id: Logprob} -> (ids, logprobs) of its k most likely tokens, most
    likely first (vLLM adds the sampled token when it falls outside the top k; that entry drops off)."""
    top = sorted(((-lp.logprob, lp.rank, tid) for tid, lp in step_logprobs.items()))[:k]
    return [t for _, _, t in top], [-v for v, _, _ in top]


def build_llm(job):
    from vllm import LLM

    kw = dict(model=job["model"], dtype=job.get("dtype", "bfloat16"), seed=job.get("seed", 0),
              disable_log_stats=False, max_num_seqs=job.get("max_num_seqs") or max(job["batch_sizes"]),
              enforce_eager=job.get("enforce_eager", False), max_logprobs=max(20, job.get("logprobs") or 0),
              # a fixed KV-cache size: on CPU the default reserves 92% of the machine's memory up front
              kv_cache_memory_bytes=int(job.get("kv_cache_gib", 1) * 2**30))
    if job.get("max_model_len"):
        kw["max_model_len"] = job["max_model_len"]
    if job.get("speculative_config"):
        kw["speculative_config"] = job["speculative_config"]
    if job.get("model_loader_extra_config"):  # what an export needs to load (pipeline/formats.py ExportFormat.loader)
        kw["model_loader_extra_config"] = job["model_loader_extra_config"]
    return LLM(**kw)


def sampling_params(job, seed=None):
    from vllm import SamplingParams

    kw = dict(temperature=job.get("temperature", 0.0), max_tokens=job["max_tokens"],
              seed=job.get("seed", 0) if seed is None else seed, ignore_eos=job.get("ignore_eos", False),
              detokenize=False)
    if job.get("top_p", 1.0) < 1.0:
        kw["top_p"] = job["top_p"]
    if job.get("top_k"):
        kw["top_k"] = job["top_k"]
    if job.get("logprobs"):
        kw["logprobs"] = job["logprobs"]
    if job.get("eos_token_ids"):
        kw["stop_token_ids"] = list(job["eos_token_ids"])
    return SamplingParams(**kw)


def decode(llm, job, batch_size, k):
    """Every prompt, `batch_size` at a time (per-prompt seeds when the job has them): (outputs, topk_ids,
    topk_logprobs, wall seconds)."""
    prompts, seeds = job["prompts"], job.get("seeds")
    params = [sampling_params(job, s) for s in seeds] if seeds else [sampling_params(job)] * len(prompts)
    outs, ids, lps = [], [], []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        group = [{"prompt_token_ids": p} for p in prompts[i:i + batch_size]]
        for r in llm.generate(group, params[i:i + batch_size], use_tqdm=False):  # results in request order
            c = r.outputs[0]
            outs.append(list(c.token_ids))
            if k:
                pairs = [top_logprobs(step, k) for step in c.logprobs]
                ids.append([a for a, _ in pairs])
                lps.append([b for _, b in pairs])
    return outs, ids, lps, time.perf_counter() - t0


def run(job):
    for p in reversed(job.get("python_path") or []):  # the engine core inherits sys.path (fork and spawn)
        sys.path.insert(0, p)
    if job.get("profile"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, where the timers are
        install_timers()
    import vllm

    t0 = time.perf_counter()
    llm = build_llm(job)
    startup = time.perf_counter() - t0
    k = job.get("logprobs") or 0
    if job.get("warmup", True):  # the first requests pay for lazy initialisation; keep them out of the timings
        warm = sampling_params({**job, "max_tokens": 8, "logprobs": 0})
        llm.generate([{"prompt_token_ids": job["prompts"][0]}], warm, use_tqdm=False)
    runs = []
    for b in job["batch_sizes"]:
        before, timed = spec_counters(llm), {p: dict(v) for p, v in TIMES.items()}
        outs, ids, lps, wall = decode(llm, job, b, k)
        new = sum(len(o) for o in outs)
        run = {"batch_size": b, "outputs": outs, "wall_s": wall, "new_tokens": new,
               "tokens_per_s": new / wall if wall > 0 else 0.0,
               "spec": counter_delta(spec_counters(llm), before)}
        if job.get("profile"):
            run["profile"] = {p: {"s": v["s"] - timed.get(p, {}).get("s", 0.0),
                                  "calls": v["calls"] - timed.get(p, {}).get("calls", 0)} for p, v in TIMES.items()}
        if k:
            run["topk_ids"], run["topk_logprobs"] = ids, lps
        runs.append(run)
        print(f"vllm_worker: batch {b}: {new} tokens in {wall:.1f}s", file=sys.stderr, flush=True)
    return {"vllm_version": vllm.__version__, "startup_s": startup, "runs": runs}


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: vllm_worker.py JOB.json RESULT.json")
    with open(argv[0]) as f:
        job = json.load(f)
    result = run(job)
    with open(argv[1], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
