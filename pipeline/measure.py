"""Measuring proposers in the project's decoder: plain and speculative decoding taking turns on each
prompt, their per-prompt stats summed, and the cache that keeps each measurement with what it
depends on. Used by the evaluate stage and by `draftsmith compare`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from eval.cpu import cpu_path
from eval.decoder import SERVING_REV, SpeculativeDecoder
from eval.proposers import load_proposer, serve_with
from eval.speedup import expected_speedup

from .config import ENGINE_RANK_KEYS, drop_later_defaults
from .engines.vllm import acceptance
from .shards import write_json_atomic


def proposer_for(src: str, target, settings: dict | None = None):
    """load_proposer(src) with serving settings when given (a hybrid's fitted budget, its sampled chain)."""
    return serve_with(load_proposer(src, target), settings, src)


def decode_pairs(target, proposer, prompts: list[list[int]], k, max_new_tokens: int, eos, desc: str,
                 compile: bool = False, sampling: dict | None = None):
    """One proposer against plain decoding, batch 1, the two taking turns on each prompt (decode_together).
    Returns (plain seqs, plain stats, spec seqs, spec stats)."""
    plain_seqs, plain, out = decode_together(target, {desc: (proposer, k)}, prompts, max_new_tokens, eos, desc,
                                             compile, sampling)
    return plain_seqs, plain, *out[desc]


def sampling_kwargs(sampling: dict | None, i: int) -> dict:
    """generate()'s sampling arguments for prompt i: none (greedy), or the settings with seed `seed + i`."""
    if not sampling:
        return {}
    return {"temperature": sampling["temperature"], "top_p": sampling["top_p"], "top_k": sampling["top_k"],
            "seed": sampling["seed"] + i}


def decode_together(target, proposers: dict, prompts: list[list[int]], max_new_tokens: int, eos, desc: str,
                    compile: bool = False, sampling: dict | None = None):
    """Plain decoding and several proposers ({name: (proposer, k)}), batch 1: on each prompt every one
    takes a turn, in an order that rotates by prompt, so the speed drift of a shared machine falls on
    all of them alike and the ratios between them hold. compile: the decoders' compiled step (evaluate.compile).
    sampling: {temperature, top_p, top_k, seed} for lossless speculative sampling instead of greedy; on
    prompt i every decoder, plain included, draws from a generator seeded `seed + i`, so a rerun draws the
    same samples (the runs do not share tokens: speculative sampling consumes its draws differently, and
    each run is a sample of the same distribution).
    Returns (plain seqs, plain stats, {name: (seqs, stats)})."""
    decs = [(None, SpeculativeDecoder(target, None, compile=compile))] + [
        (name, SpeculativeDecoder(target, prop, k=k, compile=compile)) for name, (prop, k) in proposers.items()]
    for _, dec in decs:  # warm-up, not timed; compiled: at the longest cache, which later calls reuse
        if compile:
            dec.generate([max(prompts, key=len)], max_new_tokens=max_new_tokens, eos_token_id=eos,
                         **sampling_kwargs(sampling, 0))
        else:
            dec.generate([prompts[0][:16]], max_new_tokens=4, eos_token_id=eos, **sampling_kwargs(sampling, 0))
    seqs = {name: [] for name, _ in decs}
    stats = {name: [] for name, _ in decs}
    for i, p in enumerate(tqdm(prompts, desc=desc, leave=False)):
        r = i % len(decs)
        for name, dec in decs[r:] + decs[:r]:
            res = dec.generate([p], max_new_tokens=max_new_tokens, eos_token_id=eos, **sampling_kwargs(sampling, i))
            seqs[name].append(res.sequences[0])
            stats[name].append(res.stats)
    return seqs[None], aggregate(stats[None]), {n: (seqs[n], aggregate(stats[n])) for n in proposers}


def _sum(per: list[dict], key: str):
    return sum(s.get(key, 0) or 0 for s in per)


def _acceptance(per: list[dict]) -> dict:
    """The summed accepted-length histogram and P(draft position i accepted | position i reached)."""
    hists = [s.get("accept_len_hist") or [] for s in per]
    width = max((len(h) for h in hists), default=0)
    hist = [sum(h[j] if j < len(h) else 0 for h in hists) for j in range(width)]
    per_pos = [sum(hist[i + 1:]) / sum(hist[i:]) if sum(hist[i:]) else 0.0 for i in range(max(width - 1, 0))]
    return {"accept_len_hist": hist, "accept_per_pos": per_pos}


PER_PROMPT_KEYS = ("n_tokens", "wall_s", "target_forwards", "proposed", "accepted")


def aggregate(per: list[dict]) -> dict:
    """Sum counters over batch-1 runs; rates are recomputed from the sums, not averaged."""
    n_tokens, wall = _sum(per, "n_tokens"), _sum(per, "wall_s")
    out = {"n_tokens": n_tokens, "wall_s": wall, "tokens_per_s": n_tokens / wall if wall else 0.0}
    for key in ("target_forwards", "proposed", "accepted", "rounds", "tree_rounds", "draft_time_s", "verify_time_s"):
        out[key] = _sum(per, key)
    out["peak_mem_bytes"] = max((s.get("peak_mem_bytes") or 0) for s in per)
    out["row_invariant"] = bool(per) and all(s.get("row_invariant", False) for s in per)
    # τ here: the emitted tokens per target forward, each prompt's prefill included; the decoder's own
    # stats (and eval.replay) count verify rounds only, so they read a little higher on the same run.
    out["tau"] = n_tokens / out["target_forwards"] if out["target_forwards"] else 0.0
    out["alpha"] = out["accepted"] / out["proposed"] if out["proposed"] else 0.0
    out |= _acceptance(per)
    # per prompt, in prompt order: what a paired bootstrap over prompts and the worst-prompt list read
    out["per_prompt"] = [{k: s.get(k) for k in PER_PROMPT_KEYS} for s in per]
    cs = [(s["c"], s.get("proposed", 0)) for s in per if s.get("c") is not None]
    w = sum(x[1] for x in cs)
    out["c"] = sum(c * n for c, n in cs) / w if w else None
    ks = [s.get("k") for s in per if s.get("k") is not None]
    out["k"] = sum(ks) / len(ks) if ks else None
    # The formula's α is the per-token acceptance of a geometric run (accepted / reached), as in the
    # decoder's own `alpha_hat`; accepted / proposed would count the drafts after a rejection too.
    hist = out["accept_len_hist"]
    K = len(hist) - 1
    reached = sum(n * min(j + 1, K) for j, n in enumerate(hist))
    out["alpha_hat"] = out["accepted"] / reached if reached else 0.0
    if out["c"] is not None and out["k"]:
        out["predicted_speedup"] = expected_speedup(out["alpha_hat"], out["k"], out["c"])
    return out


def vllm_acceptance(stats: dict) -> dict:
    """{mean_acceptance_length, acceptance_per_pos, draft_acceptance_rate, drafts} under vLLM's definitions
    (pipeline.engines.vllm.acceptance) from aggregate()'s counters: a draft is a round that proposed at least
    one token; acceptance at position i is accepted there / drafts, not conditioned on reaching i."""
    hist = stats["accept_len_hist"]
    return acceptance({"num_drafts": sum(hist), "num_draft_tokens": stats["proposed"],
                       "num_accepted_tokens": stats["accepted"],
                       "num_accepted_tokens_per_pos": [sum(hist[i + 1:]) for i in range(len(hist) - 1)]})


def source_fingerprint(src: str) -> list:
    """What a cached measurement of `src` ("ngram", a draft directory, "hybrid:<dir>", ...) depends on
    besides the decoder: the draft directory's file names and sizes, so that e.g. a datastore added to
    a checkpoint later measures again instead of reading back the result without it."""
    d = Path(str(src).split(":", 1)[-1])
    if not d.is_dir():
        return []
    return sorted([p.name, p.stat().st_size] for p in d.iterdir() if p.is_file() and p.name != "trainer_state.pt")


SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def evaluate_settings(recipe) -> dict:
    """The evaluate section as a measurement key: `serve` only picks among measurements, so it is left out;
    so are the sampling keys, which a greedy measurement does not depend on (a sampled one carries them in
    its own key); keys added later enter only when set (config.LATER_KEYS), so older measurements are read back."""
    ev = drop_later_defaults({"evaluate": recipe.to_dict()["evaluate"]})["evaluate"]
    for k in ("serve", *ENGINE_RANK_KEYS, *SAMPLING_KEYS):
        ev.pop(k, None)
    return ev


def cpu_key() -> dict:
    """The CPU path's part of a measurement's key: none for avx512-bf16, the path every measurement before
    the key existed was made on (so those still read), else {"cpu_path": name}."""
    path = cpu_path().name
    return {} if path == "avx512-bf16" else {"cpu_path": path}


class MeasurementCache:
    """Measurements kept as `<directory>/<name>.json`, each with the key it was measured under: the
    caller's settings, the decoder's serving revision (a decoder change measures again), the CPU path, the files of
    its source when it has one (source_fingerprint) and any extra settings. A measurement is read
    back only when its key matches, so a finished stage resumes without measuring again."""

    def __init__(self, directory: Path, settings: dict):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # The CPU path too: each rounds bf16 its own way and runs at its own speed (eval/cpu.py).
        self.settings = settings | {"serving": SERVING_REV} | cpu_key()

    def key(self, source=None, extra: dict | None = None) -> dict:
        files = {"files": source_fingerprint(source)} if source is not None else {}
        return self.settings | files | (extra or {})

    def read(self, name: str, source=None, extra: dict | None = None) -> dict | None:
        path = self.directory / f"{name}.json"
        if not path.exists():
            return None
        prev = json.loads(path.read_text())
        return prev if prev.get("key") == self.key(source, extra) else None

    def store(self, name: str, result: dict, source=None, extra: dict | None = None) -> dict:
        result["key"] = self.key(source, extra)
        write_json_atomic(self.directory / f"{name}.json", result)
        return result
