"""`draftsmith compare`: every draft method, and every divergence on the best one, trained on the same
generated data and judged the same way in our decoder -> one table (run dir, W&B, optionally docs/).

Step 1: the run's generate stage (reused when it exists; run_dir/generate and prompts/).
Step 2: per variant, a directory run_dir/compare/<name>/ whose generate/ and prompts/ link to the
run's, then the train stage and the evaluate stage exactly as `distill` runs them (resumable: a
finished variant is read back). The table shows each variant's final checkpoint.
Step 3: the hybrid (the best trained variant + n-gram lookups + its datastore), the same without the
datastore and the lookups without the draft (what each part adds), and the n-gram baseline.
Step 4: the divergences on the best method, and the best method trained on raw domain text (the
undistilled baseline; its τ against the distilled one is the distillation lift, both arms at
--lift-steps and judged on --lift-prompts when given). The best variant is then swept over K
(measured) to give its best K.

"best K" in the table is the K that maximises the predicted speedup (1-α^(K+1))/((1-α)(Kc+1)) from
the variant's measured α (per-token, accepted/reached) and c; the sweep measures it for the best one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from pathlib import Path

from eval import speedup
from eval.datastore import FILE as DATASTORE_FILE
from eval.family import text_config

from .methods import get_method, variants
from .shards import write_json_atomic
from .tracking import NoOpTracker

# The variants (name -> train overrides, "method" included) are the methods' own (DraftMethod.variants,
# pipeline.methods.variants()): e.g. "lora" is draft_lm with a LoRA adapter, "medusa_indep" Medusa-1's heads.
DIVERGENCES = ("fkl", "rkl", "jsd", "tv")


class CompareError(ValueError):
    pass


def best_k(alpha: float, c: float | None, k_max: int = 8) -> int | None:
    """The K with the best predicted speedup (eval.speedup), or None without a measured c or acceptance."""
    if c is None or alpha <= 0:
        return None
    return speedup.best_k(alpha, c, k_max)[0]


def _link(src: Path, dst: Path) -> None:
    if not dst.exists():
        dst.symlink_to(os.path.relpath(src, dst.parent))


def _override(section, overrides: dict) -> None:
    """Set a recipe section's keys; a dict value sets a nested section's keys (e.g. train.medusa).
    An unknown key is an error, not a new attribute nobody reads."""
    for k, v in overrides.items():
        if k not in {f.name for f in dataclasses.fields(section)}:
            raise CompareError(f"compare variant sets {type(section).__name__}.{k}, which is no recipe key")
        if isinstance(v, dict):
            _override(getattr(section, k), v)
        else:
            setattr(section, k, v)


def _variant_recipe(recipe, overrides: dict, steps: int | None, n_prompts: int | None = None):
    r = copy.deepcopy(recipe)
    _override(r.train, overrides)
    if steps:
        r.train.steps = steps
        r.train.warmup_steps = min(r.train.warmup_steps, max(steps // 10, 1))
    r.train.save_every = r.train.steps  # one checkpoint: the table judges the final one
    r.train.max_minutes = 0.0  # variants compare at equal steps, not at what one machine fits in a budget
    r.evaluate.hybrid, r.evaluate.baselines, r.evaluate.fp32_prompts = False, False, 0
    if n_prompts:
        r.evaluate.n_prompts = n_prompts
    r.train.__post_init__()
    r.evaluate.__post_init__()
    return r


def run_variant(name: str, recipe, run_dir: Path, target, tokenizer) -> dict:
    from .evaluate import run_evaluate
    from .features import FEATURES_FILE, RAW_TEACHER_FILE
    from .train import run_train

    L = text_config(target).num_hidden_layers
    if get_method(recipe.train.method).reuses_target_layers:
        own = getattr(recipe.train, recipe.train.method)  # the method's own section, train.<method>
        own.num_layers = min(own.num_layers, max(L // 2, 1))  # a small target: keep the draft a fraction of it
    vdir = run_dir / "compare" / name
    (vdir / "train").mkdir(parents=True, exist_ok=True)
    _link(run_dir / "generate", vdir / "generate")
    _link(run_dir / "prompts", vdir / "prompts")
    feats = run_dir / "compare" / f"features-{recipe.train.data}.safetensors"
    # The same target features for every variant: the compare's own, else the distill's train stage's
    # (its key is checked on load, and a mismatch is recomputed into the variant's own file).
    src = feats if feats.exists() else run_dir / "train" / FEATURES_FILE
    if src.exists() and not (vdir / "train" / FEATURES_FILE).exists():
        os.link(src, vdir / "train" / FEATURES_FILE)
    raw = run_dir / "compare" / RAW_TEACHER_FILE  # the scored raw-text mix: the same for every variant
    if recipe.train.raw_windows and raw.exists() and not (vdir / "train" / RAW_TEACHER_FILE).exists():
        os.link(raw, vdir / "train" / RAW_TEACHER_FILE)  # (its key is checked on load)
    train_dir = run_train(recipe, vdir, target=target, tokenizer=tokenizer)
    if (train_dir / FEATURES_FILE).exists() and not feats.exists():
        os.link(train_dir / FEATURES_FILE, feats)
    if (train_dir / RAW_TEACHER_FILE).exists() and not raw.exists():
        os.link(train_dir / RAW_TEACHER_FILE, raw)
    m = run_evaluate(recipe, vdir, target, tokenizer)
    tm = json.loads((train_dir / "manifest.json").read_text())
    return {"name": name, "method": recipe.train.method, "divergence": recipe.train.divergence,
            "data": recipe.train.data, "dir": str(vdir / "best"), "alpha": m["alpha"], "tau": m["tau"],
            "c": m["c"], "k": m["k"], "best_k": best_k(m["alpha_hat"], m["c"]), "speedup": m["speedup"],
            "predicted_speedup": m["predicted_speedup"], "tokens_per_s": m["tokens_per_s_spec"],
            "plain_tokens_per_s": m["tokens_per_s_plain"], "train_tokens_per_s": tm.get("tokens_per_s"),
            "steps": tm.get("steps"), "greedy_match": m.get("bf16_match_rate"),
            "all_near_ties": m["greedy_exact"]}


def _decode_row(name: str, src: str, recipe, run_dir: Path, target, tokenizer, k: int) -> dict:
    """A proposer without training (ngram) or a served combination (hybrid), cached by name and K."""
    from .evaluate import heldout_ids
    from .measure import MeasurementCache, decode_pairs, evaluate_settings

    cache = MeasurementCache(run_dir / "compare", {"evaluate": evaluate_settings(recipe)})
    extra = {"src": src, "k": k}
    prev = cache.read(f"{name}-k{k}", src, extra)
    if prev is not None:
        return prev["row"]
    from eval.proposers import load_proposer

    prompts = heldout_ids(recipe, run_dir, tokenizer)
    _, plain, _, s = decode_pairs(target, load_proposer(src, target), prompts, k, recipe.evaluate.max_new_tokens,
                                  tokenizer.eos_token_id, name)
    row = {"name": name, "method": name.split("@")[0], "divergence": None, "data": None, "dir": src,
           "alpha": s["alpha"], "tau": s["tau"], "c": s["c"], "k": k, "best_k": best_k(s["alpha_hat"], s["c"]),
           "speedup": s["tokens_per_s"] / plain["tokens_per_s"], "predicted_speedup": s.get("predicted_speedup"),
           "tokens_per_s": s["tokens_per_s"], "plain_tokens_per_s": plain["tokens_per_s"],
           "train_tokens_per_s": None, "steps": 0}
    cache.store(f"{name}-k{k}", {"row": row}, src, extra)
    return row


def check_choices(methods, divergences) -> list[str]:
    """--methods and --divergences checked against the methods' variants and DIVERGENCES."""
    known = variants()
    methods = list(methods or known)
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise CompareError(f"unknown method(s) {unknown} for --methods; choose from {sorted(known)}")
    bad = [d for d in divergences if d not in DIVERGENCES]
    if bad:
        raise CompareError(f"unknown divergence(s) {bad} for --divergences; choose from {list(DIVERGENCES)}")
    return methods


def applicable(methods: list[str], target, chosen: bool) -> list[str]:
    """The variants that apply to `target`: a variant the user named (--methods) that cannot is refused in
    one line; from the default list it is left out, saying so."""
    from .methods import check_applies, methods_for

    method = {v: over["method"] for v, over in variants().items()}
    if chosen:
        for m in methods:
            check_applies(method[m], target, f"compare variant {m} (train.method={method[m]})")
        return methods
    ok = set(methods_for(target))
    out = [m for m in methods if method[m] in ok]
    if len(out) < len(methods):
        print(f"[compare] leaving out {', '.join(m for m in methods if m not in out)}: they run the target's layers "
              f"in draftsmith's lean forward, which does not cover this target", file=sys.stderr)
    return out


def _method_rows(recipe, run_dir, target, tokenizer, methods, steps) -> list[dict]:
    """Step 2: every method with the recipe's divergence, on the generated data."""
    div = recipe.train.divergence
    return [run_variant(f"{m}-{div}", _variant_recipe(recipe, {**variants()[m], "divergence": div, "data": "generated"},
                                                      steps), run_dir, target, tokenizer) for m in methods]


def _served_rows(recipe, run_dir, target, tokenizer, rows: list[dict], best: dict, best_m: str) -> list[dict]:
    """Step 3: the best trained variant as a hybrid (and, with a datastore, without it and the lookups
    without the draft), the int8 copy with lookups, and the n-gram baseline, at the recipe's K."""
    k, d = recipe.evaluate.k, best["dir"]
    served = [("hybrid", f"hybrid:{d}", f"hybrid ({best_m} + ngram)")]
    if (Path(d) / DATASTORE_FILE).exists():  # what the datastore adds, and what the draft adds
        served = [("hybrid", f"hybrid:{d}", f"hybrid ({best_m} + ngram + datastore)"),
                  ("hybrid-nostore", f"hybrid-nostore:{d}", f"hybrid ({best_m} + ngram), no datastore"),
                  ("ngram+datastore", f"datastore:{d}", "ngram + datastore (no draft)")]
    for r in rows:  # an untrained draft with lookups too (int8: accepts almost everything, costs much of a target step)
        m = r["method"]
        if not get_method(m).trains:
            served.append((f"{m}+ngram", f"hybrid:{r['dir']}", f"hybrid ({m} + ngram)"))
    out = []
    for name, src, method in served:
        out.append(_decode_row(name, src, recipe, run_dir, target, tokenizer, k) | {"method": method})
    return out + [_decode_row("ngram", "ngram", recipe, run_dir, target, tokenizer, k)]


def _divergence_rows(recipe, run_dir, target, tokenizer, own: list[dict], best_m: str, divergences, steps):
    """Step 4: the best method with each other divergence, after its own rows (`own`)."""
    default = recipe.train.divergence
    rows = list(own)
    for d in divergences:
        if d != default:
            rv = _variant_recipe(recipe, {**variants()[best_m], "divergence": d, "data": "generated"}, steps)
            rows.append(run_variant(f"{best_m}-{d}", rv, run_dir, target, tokenizer))
    return rows


def _lift_arm(recipe, run_dir, target, tokenizer, best_m: str, data: str, steps: int, n_prompts: int, tag: str):
    extra = {"raw_windows": 0} if data == "raw" else {}
    rv = _variant_recipe(recipe, {**variants()[best_m], "divergence": recipe.train.divergence, "data": data, **extra},
                         steps, n_prompts)
    name = f"{best_m}-{recipe.train.divergence}{'-raw' if data == 'raw' else ''}{tag}"
    return run_variant(name, rv, run_dir, target, tokenizer)


def _lift(recipe, run_dir, target, tokenizer, best: dict, best_m: str, steps, lift_steps, lift_prompts):
    """The lift: the best method on the generated data against the same method on raw text, both at
    lift_steps and judged on lift_prompts held-out prompts. Given either, both arms are variants of
    their own ("-s<steps>-p<prompts>"): a short table's steps understate what distillation does at the
    recipe's, and τ on a handful of prompts moves by more than the lift. Returns (distilled, raw)."""
    own = lift_steps == (steps or recipe.train.steps) and lift_prompts == recipe.evaluate.n_prompts
    tag = "" if own else f"-s{lift_steps}-p{lift_prompts}"
    arm = (recipe, run_dir, target, tokenizer, best_m)
    dist = best if own else _lift_arm(*arm, "generated", lift_steps, lift_prompts, tag)  # own: the table's row
    return dist, _lift_arm(*arm, "raw", lift_steps, lift_prompts, tag)


def _best_measured(recipe, run_dir, target, tokenizer, served: dict, sweep: list[dict], ngram: dict) -> dict:
    """The best swept K against the n-gram proposer at its best measured K (the recipe's, the best
    sweep K's, and 8, the hybrid's lookup length): a hybrid's lookups propose 8 tokens at any K, so
    "the same K" would not be like with like."""
    k = recipe.evaluate.k
    best_sweep = max(sweep, key=lambda r: r["speedup"])
    ngram_rows = [ngram] + [_decode_row("ngram", "ngram", recipe, run_dir, target, tokenizer, kk)
                            for kk in sorted({best_sweep["k"], 8} - {k})]
    ngram_best = max(ngram_rows, key=lambda r: r["speedup"])
    return {"ngram_by_k": {r["k"]: r["speedup"] for r in ngram_rows},
            "best_measured": {"name": served["name"], "k": best_sweep["k"], "tau": best_sweep["tau"],
                              "speedup": best_sweep["speedup"], "ngram_speedup": ngram_best["speedup"],
                              "ngram_k": ngram_best["k"],
                              "vs_ngram": best_sweep["speedup"] / ngram_best["speedup"] if ngram_best["speedup"]
                              else None}}


def run_compare(recipe, run_dir: Path, target, tokenizer, methods=None, divergences=DIVERGENCES,
                steps: int | None = None, raw_baseline: bool = True, k_sweep=(2, 3, 4, 6, 8),
                tracker=None, lift_steps: int | None = None, lift_prompts: int | None = None) -> dict:
    tracker = tracker or NoOpTracker()
    run_dir = Path(run_dir)
    if not (run_dir / "generate" / "manifest.json").exists():
        raise CompareError(f"{run_dir}/generate is missing; run `draftsmith generate` (or distill) first")
    methods = applicable(check_choices(methods, divergences), target, chosen=bool(methods))
    (run_dir / "compare").mkdir(exist_ok=True)
    ctx = (recipe, run_dir, target, tokenizer)
    rows = _method_rows(*ctx, methods, steps)
    trained = [r for r in rows if get_method(r["method"]).trains]
    best = max(trained or rows, key=lambda r: r["speedup"])
    best_m = best["name"].rsplit("-", 1)[0]
    rows += _served_rows(*ctx, rows, best, best_m)
    ngram = rows[-1]
    own = [r for r in rows if r["name"] == f"{best_m}-{recipe.train.divergence}"]
    div_rows = _divergence_rows(*ctx, own, best_m, divergences, steps)
    dist = raw = None
    lift_steps, lift_prompts = lift_steps or steps or recipe.train.steps, lift_prompts or recipe.evaluate.n_prompts
    if raw_baseline and get_method(variants()[best_m]["method"]).trains:
        dist, raw = _lift(*ctx, best, best_m, steps, lift_steps, lift_prompts)
    # K sweep (measured) on the best served proposer: a variant's best/ dir, or "hybrid:<dir>"
    served = max([r for r in rows if r["name"] not in ("ngram", "ngram+datastore")], key=lambda r: r["speedup"])
    sweep = [_decode_row(f"{served['name']}@k", served["dir"], *ctx, kk) for kk in k_sweep]
    out = {"methods": rows, "divergences": div_rows, "raw_baseline": raw, "best_method": best_m,
           "k_sweep": sweep, "served": served["name"], "n_prompts": recipe.evaluate.n_prompts,
           "max_new_tokens": recipe.evaluate.max_new_tokens, "dtype": recipe.dtype,
           "steps": steps or recipe.train.steps,
           "lift": {"steps": lift_steps, "n_prompts": lift_prompts, "distilled": dist} if raw else None,
           "distillation_tau_lift": (dist["tau"] / raw["tau"] - 1) if raw and raw["tau"] else None}
    out |= _best_measured(*ctx, served, sweep, ngram)
    write_json_atomic(run_dir / "compare" / "compare.json", out)
    _log(tracker, out)
    return out


def _log(tracker, out: dict) -> None:
    cols = ["name", "method", "divergence", "data", "alpha", "tau", "c", "k", "best_k", "speedup",
            "predicted_speedup", "train_tokens_per_s"]
    raw = [out["raw_baseline"]] if out["raw_baseline"] else []
    rows = out["methods"] + out["divergences"][1:] + raw
    tracker.table("compare/methods", cols, [[r.get(c) for c in cols] for r in rows])
    b = out["best_measured"]
    tracker.summary({"compare/best_speedup": b["speedup"], "compare/best_tau": b["tau"],
                     "compare/distillation_tau_lift": out["distillation_tau_lift"] or 0.0})


def _fmt(v, nd=2):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def markdown(out: dict, command: str) -> str:
    """The comparison as a Markdown document (run dir's compare.md, and docs/ with --docs)."""
    head = "| variant | divergence | data | α | τ | c | K | best K (pred.) | speedup | predicted | train tok/s |\n" \
           "|---|---|---|---|---|---|---|---|---|---|---|\n"

    def line(r):
        served = ('hybrid', 'hybrid-nostore', 'ngram+datastore', 'int8+ngram', 'ngram')
        return (f"| {r['method'] if r['name'] in served else r['name']} | {_fmt(r['divergence'])} | "
                f"{_fmt(r['data'])} | {_fmt(r['alpha'], 3)} | {_fmt(r['tau'])} | {_fmt(r['c'], 3)} | {_fmt(r['k'])} | "
                f"{_fmt(r['best_k'])} | **{_fmt(r['speedup'])}×** | {_fmt(r['predicted_speedup'])}× | "
                f"{_fmt(r['train_tokens_per_s'], 0)} |\n")

    best_method = out["best_method"]
    s = ["# Draft methods compared\n\n",
         f"Made by: `{command}`\n\n",
         f"Greedy, batch 1, {out['dtype']}, {out['n_prompts']} held-out HumanEval prompts, {out['max_new_tokens']} new "
         f"tokens; every trained variant: {out['steps']} steps on the same generated data; speedup = our "
         "speculative decoding over plain decoding in our decoder, the two taking turns prompt by prompt.\n\n",
         "## Methods (default divergence)\n\n", head, *map(line, out["methods"]),
         f"\n## Divergences on the best method ({out['best_method']})\n\n", head, *map(line, out["divergences"])]
    if out.get("raw_baseline"):
        lift = out.get("lift") or {}
        s += ["\n## Distillation vs raw domain text\n\n",
              f"{best_method} trained {_fmt(lift.get('steps', out['steps']))} steps on the target's generated outputs "
              f"and on raw domain text (one-hot next tokens), judged on {_fmt(lift.get('n_prompts', out['n_prompts']))} "
              "held-out prompts.\n\n", head, *([line(lift["distilled"])] if lift.get("distilled") else []),
              line(out["raw_baseline"]),
              f"\nτ lift of distillation over raw-text training: {_fmt(out['distillation_tau_lift'] * 100, 0)}%\n"]
    s += [f"\n## K sweep (measured) on {out['served']}\n\n", "| K | α | τ | speedup |\n|---|---|---|---|\n"]
    s += [f"| {r['k']} | {_fmt(r['alpha'], 3)} | {_fmt(r['tau'])} | {_fmt(r['speedup'])}× |\n" for r in out["k_sweep"]]
    b = out["best_measured"]
    s.append(f"\nBest: {b['name']} at K={b['k']}: τ {_fmt(b['tau'])}, speedup {_fmt(b['speedup'])}×, "
             f"{_fmt(b['vs_ngram'])}× the n-gram proposer's best speedup "
             f"({_fmt(b.get('ngram_speedup'))}× at K={b.get('ngram_k')}; n-gram by K: "
             + ", ".join(f"K={kk} {_fmt(v)}×" for kk, v in sorted(out.get("ngram_by_k", {}).items())) + ").\n")
    return "".join(s)
