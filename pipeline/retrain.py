"""`draftsmith retrain` and `draftsmith monitor`: the scheduled job that keeps a domain's draft current.

retrain (one job per domain: pipeline.lock.DomainLock), idempotent and safe to repeat:
1. ingest the new traffic (pipeline/traffic.py): deduplicated against every prompt used before, a fresh
   held-out slice split off; an interrupted batch is resumed before anything new is read, and no new
   prompt exits 0 saying "nothing new" with nothing changed;
2. generate the target's outputs for the new prompts only (generate.run_generate_incremental: the
   previous run's shards are reused under the same target files and generate settings);
3. train a challenger on all of it, warm-started from the champion (retrain.warm_start) or from scratch;
4. judge challenger, champion, the n-gram baseline and plain decoding in ONE interleaved measurement
   (measure.decode_together, through evaluate.HeldOut) on the fresh slice;
5. the gate (pipeline/gate.py) decides; the challenger is registered, promoted only when the gate passes,
   and the decision is recorded either way (registry decisions, run_dir/gate.json, W&B).
distill's best/ is admitted the same way (admit_distill): through the absolute checks when the domain
has no champion, judged against the champion otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

from eval import draft_dir

from . import gate
from .atomic import write_json_atomic, write_text_atomic
from .data import read_jsonl, write_jsonl
from .faults import kill_point
from .registry import Registry
from .traffic import Ledger, ingest, prompt_key, read_traffic

EXIT_DRIFT = 1
METRIC_KEYS = ("speedup", "tau", "alpha", "accept_per_pos", "mean_acceptance_length", "draft_acceptance_rate",
               "greedy_exact", "lossless", "k", "target", "draft_method")


class RetrainError(ValueError):
    """retrain or monitor cannot go on; the message says why and what to do."""


def domain_dir(recipe) -> Path:
    return Path(recipe.runs_dir) / recipe.domain


# ------------------------------------------------------------------------------- data state

def _state_path(ddir: Path) -> Path:
    return ddir / "traffic" / "state.json"


def data_state(ddir: Path) -> dict | None:
    """The run whose generate stage holds every training row so far: {"run_dir", "generate", "reuse_key"}."""
    p = _state_path(ddir)
    return json.loads(p.read_text()) if p.exists() else None


def set_data_state(ddir: Path, run_dir: Path, reuse_key: str) -> None:
    write_json_atomic(_state_path(ddir), {"run_dir": str(run_dir), "generate": str(Path(run_dir) / "generate"),
                                          "reuse_key": reuse_key, "updated": time.time()})


def _read_jsonl(p: Path) -> list[dict]:
    return read_jsonl(p) if p.exists() else []


def all_train_rows(run_dir: Path) -> list[dict]:
    """Every prompt a run's draft was trained on: prompts/all_train.jsonl (retrain), else prompts/train.jsonl."""
    p = Path(run_dir) / "prompts" / "all_train.jsonl"
    return _read_jsonl(p if p.exists() else Path(run_dir) / "prompts" / "train.jsonl")


# ------------------------------------------------------------------------------- judging

def check_target(draft: Path, recipe, champion: dict | None) -> None:
    """A draft is judged only against a champion of the same target: one line otherwise."""
    theirs = (champion or {}).get("metrics", {}).get("target")
    if champion is not None and theirs != recipe.target:
        raise RetrainError(f"the champion {champion['id']} serves target {theirs!r} but this recipe's target is "
                           f"{recipe.target!r}; a draft for another target is never compared with it: use a "
                           f"new domain for the new target, or roll back to a champion of {recipe.target!r}")
    ours = draft_dir.read_meta(draft).get("target")
    if ours is not None and ours != recipe.target:
        raise RetrainError(f"draft {draft} was trained for target {ours!r}, but this recipe serves {recipe.target!r}; "
                           f"train it on this target (draftsmith distill) or use the other target's recipe")


def serve_like(src: Path, dst: Path, champion: dict | None, hybrid: bool = True) -> Path:
    """The challenger's draft directory (dst), served the way the champion is (bare or as a hybrid at its
    node budget) so the two are compared in the same form; without a champion, as a hybrid when `hybrid`."""
    tmp = dst.with_name(f".{dst.name}-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("trainer_state.pt"))
    meta = draft_dir.read_meta(tmp)
    fresh = {"proposer": "hybrid" if hybrid else "draft"}
    cmeta = draft_dir.read_meta(Path(champion["draft_dir"])) if champion else fresh
    meta["proposer"] = cmeta.get("proposer", "draft")
    meta.pop("serve", None)
    if cmeta.get("serve"):
        meta["serve"] = cmeta["serve"]
    draft_dir.write_meta(tmp, meta)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def judge(recipe, run_dir: Path, target, tokenizer, challenger: Path, champion: dict | None) -> dict:
    """Challenger, champion and the n-gram baseline against plain decoding, in one decode_together call on
    run_dir/prompts/heldout.jsonl (cached in run_dir/gate/, all or nothing, so a rerun reads them back paired);
    greedy exactness marked as evaluate does. -> {"challenger", "champion" or None, "ngram" or None}."""
    from .evaluate import BASELINE, CHECKPOINT, Candidate, HeldOut, check_fp32, heldout_ids, mark_exactness
    from .measure import MeasurementCache, evaluate_settings

    cfg = recipe.evaluate
    prompts = heldout_ids(recipe, run_dir, tokenizer)
    settings = {"evaluate": evaluate_settings(recipe), "dtype": recipe.dtype, "n": len(prompts),
                "champion": champion["id"] if champion else None}
    held = HeldOut(target, prompts, cfg, tokenizer.eos_token_id, MeasurementCache(Path(run_dir) / "gate", settings),
                   recipe.seed)
    cands = [Candidate("challenger", str(challenger), cfg.k, CHECKPOINT)]
    if champion is not None:
        cands.append(Candidate("champion", champion["draft_dir"], cfg.k, CHECKPOINT))
    if cfg.baselines:
        cands.append(Candidate("ngram", "ngram", cfg.ngram_k, BASELINE))
    if any(held.cache.read(c.name, c.files, c.settings or {}) is None for c in cands):
        for c in cands:  # paired only when measured together: never mix a cached result with a new one
            (held.cache.directory / f"{c.name}.json").unlink(missing_ok=True)
    res = held.measure(cands)
    exact32, _ = check_fp32(held, res["challenger"])
    mark_exactness(list(res.values()), res["challenger"], recipe.dtype, exact32)
    return {"challenger": res["challenger"], "champion": res.get("champion"), "ngram": res.get("ngram")}


def _metrics_of(r: dict, recipe) -> dict:
    from .measure import vllm_acceptance

    s = r["stats"]
    return {"speedup": r["speedup"], "tau": s["tau"], "alpha": s["alpha"], "accept_per_pos": s["accept_per_pos"],
            **{k: vllm_acceptance(s)[k] for k in ("mean_acceptance_length", "draft_acceptance_rate")},
            "greedy_exact": r["greedy_exact"], "lossless": r["lossless"], "k": recipe.evaluate.k, "target": recipe.target}


def serving(recipe) -> gate.Serving:
    """The serving setting the gate protects: evaluate.serve's engine, at the K its serve command uses."""
    engine = recipe.evaluate.serve
    k = recipe.evaluate.k if engine == "draftsmith" else (recipe.export.k or recipe.evaluate.k)
    return gate.Serving(engine, k)


def decide(recipe, judged: dict) -> gate.Decision:
    rc = recipe.retrain
    return gate.decide(judged["challenger"], judged["champion"], judged["ngram"], serving=serving(recipe),
                       min_gain=rc.min_gain, confidence=rc.confidence, n_boot=rc.bootstrap,
                       position_tolerance=rc.position_tolerance, min_prompts=rc.min_prompts,
                       min_tokens=rc.min_tokens, seed=recipe.seed)


def first_draft_judged(run_dir: Path, m: dict) -> dict:
    """A first draft's judged results, from evaluate's own measurement of it (run_dir/eval/): the promoted
    result and the n-gram baseline's, each with the plain runs it took turns with, at the temperature it was
    promoted by; lossless from metrics.json. -> {"challenger", "champion": None, "ngram" or None}."""
    from .evaluate import SAMPLED

    sampled = bool((m.get("sampled") or {}).get("draft"))  # measured at the serving temperature (None: greedy)
    suffix = SAMPLED if sampled else ""
    name = m["sampled"]["draft"]["name"] if sampled else m["checkpoint"]  # sampling measured its twin once
    ev = Path(run_dir) / "eval"
    challenger = json.loads((ev / f"{name}{suffix}.json").read_text())
    challenger |= {"greedy_exact": m["greedy_exact"], "lossless": m.get("lossless", m["greedy_exact"])}
    base = ev / f"ngram{suffix}.json"
    ngram = json.loads(base.read_text()) if m.get("ngram_baseline") and base.exists() else None
    return {"challenger": challenger, "champion": None, "ngram": ngram}


def register(recipe, run_dir: Path, draft: Path, decision: gate.Decision, metrics: dict, kind: str,
             champion: dict | None, traffic: dict, tracker=None) -> dict:
    """Add the challenger to the registry (once per run: its id is kept in run_dir/gate.json's sibling
    status), promote it only when the gate passed, record the decision always, write run_dir/gate.json."""
    from .generate import generate_hash, target_fingerprint

    reg = Registry(domain_dir(recipe))
    mark = run_dir / "registered.json"
    if mark.exists():
        entry = reg.entry(json.loads(mark.read_text())["id"])
    else:
        hashes = {"recipe": recipe.hash(), "data": generate_hash(recipe), "target": target_fingerprint(recipe.target)}
        entry = reg.add(draft, run_dir=run_dir, metrics=metrics, kind=kind, hashes=hashes, traffic=traffic,
                        parent=champion["id"] if champion else None)
        write_json_atomic(mark, {"id": entry["id"]})
    kill_point("retrain.after_register")
    record = {"kind": kind, "run_dir": str(run_dir), "challenger": entry["id"],
              "champion": champion["id"] if champion else None, **decision.to_dict()}
    kill_point("retrain.before_promote")
    if decision.promote:  # a rerun after the pointer moved only completes the decision log
        reg.promote(entry["id"], record)
    kill_point("retrain.after_promote")
    if not (run_dir / "gate.json").exists():
        reg.record_decision(record)
    write_json_atomic(run_dir / "gate.json", record)
    if tracker is not None:
        cols, rows = gate.table_rows(decision)
        tracker.table("gate/decision", cols, rows)
        tracker.summary({"gate/promote": decision.promote, "gate/challenger": entry["id"]}
                        | {f"gate/challenger_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
                        | ({"gate/gain_lower": decision.figures["bootstrap"]["lower"] - 1,
                            "gate/gain": decision.figures["bootstrap"]["ratio"] - 1}
                           if "bootstrap" in decision.figures else {}))
        name = f"{recipe.domain}-draft"
        if champion is not None:
            tracker.draft_artifact(name, Path(champion["draft_dir"]), aliases=[champion["id"], "champion"],
                                   metadata={"registry_id": champion["id"], **(champion.get("metrics") or {})},
                                   used=True)
        aliases = [entry["id"], "challenger"] + (["promoted"] if decision.promote else [])
        tracker.draft_artifact(name, draft, aliases=aliases,
                               metadata={"registry_id": entry["id"], "parent": champion["id"] if champion else None,
                                         "promoted": decision.promote, **metrics})
    return record


def pinned_champion(reg: Registry, run_dir: Path) -> dict | None:
    """The champion a run is judged against, fixed when the run first asks (run_dir/judged_against.json): a
    rerun after a crash that followed the promotion still compares with the champion it replaced."""
    p = Path(run_dir) / "judged_against.json"
    if p.exists():
        cid = json.loads(p.read_text())["id"]
        return reg.entry(cid) if cid else None
    champion = reg.champion()
    write_json_atomic(p, {"id": champion["id"] if champion else None})
    return champion


def _say(record: dict) -> None:
    print(f"draftsmith: gate: {record['summary']} -> {record['run_dir']}/gate.json")


# ------------------------------------------------------------------------------- distill's admission

def admit_distill(recipe, run_dir: Path, target, tokenizer) -> dict:
    """After a distill: its best/ enters the registry; it becomes the champion through the gate's absolute
    checks when the domain has none, else only when it beats the champion like a retrain's challenger.
    Its prompts enter the traffic ledger (they are used), and its generate stage is what retrain builds on.
    Runs inside distill's domain lock; a rerun of a finished admission reads gate.json back."""
    from .generate import reuse_key

    run_dir = Path(run_dir)
    if (run_dir / "gate.json").exists():
        return json.loads((run_dir / "gate.json").read_text())
    ddir = domain_dir(recipe)
    champion = pinned_champion(Registry(ddir), run_dir)
    best = run_dir / "best"
    check_target(best, recipe, champion)
    m = json.loads((run_dir / "metrics.json").read_text())
    metrics = {k: m.get(k) for k in METRIC_KEYS}
    if champion is None:  # the first draft: its own evaluate measured it against plain and the n-gram baseline
        decision = decide(recipe, first_draft_judged(run_dir, m))
    else:
        judged = judge(recipe, run_dir, target, tokenizer, best, champion)
        decision = decide(recipe, judged)
        metrics |= {"gate_" + k: v for k, v in _metrics_of(judged["challenger"], recipe).items()}
    splits = {s: _read_jsonl(run_dir / "prompts" / f"{s}.jsonl") for s in ("train", "val", "heldout")}
    record_prompts(ddir, f"distill-{run_dir.name}", splits, run_dir)
    if decision.promote or data_state(ddir) is None:  # a distill the gate rejects keeps the traffic rows' base
        set_data_state(ddir, run_dir, reuse_key(recipe))
    traffic = {"rows": sum(len(v) for v in splits.values()), "new_rows": sum(len(v) for v in splits.values())}
    record = register(recipe, run_dir, best, decision, metrics, "distill", champion, traffic)
    _say(record)
    return record


def record_prompts(ddir: Path, batch_id: str, splits: dict[str, list[dict]], run_dir: Path) -> None:
    """A distill's prompts in the ledger as a decided batch, so traffic repeating them is not new."""
    ledger = Ledger(ddir)
    if batch_id in ledger.batch_ids():
        return
    d = ledger.batch_dir(batch_id)
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / "manifest.json", {"id": batch_id, "created": time.time(), "status": "decided",
                                            "run_dir": str(run_dir), "kind": "distill",
                                            **{f"n_{s}": len(v) for s, v in splits.items()}})
    old = ledger.path.read_text() if ledger.path.exists() else ""
    lines = [{"key": prompt_key(r), "batch": batch_id, "split": s} for s, rs in splits.items() for r in rs]
    write_text_atomic(ledger.path, old + "".join(json.dumps(x) + "\n" for x in lines))


# ------------------------------------------------------------------------------- retrain

def retrain(recipe, traffic: list[str]) -> int:
    """The retrain job (module docstring); returns the exit status."""
    from .lock import DomainLock

    ddir = domain_dir(recipe)
    check_evidence_reachable(recipe)
    if traffic:
        read_traffic(traffic)  # bad traffic stops here, before the lock or any file
    with DomainLock(ddir, "retrain"):
        champion = Registry(ddir).champion()
        if champion is not None:
            check_target(Path(champion["draft_dir"]), recipe, champion)  # another target: refused before any work
        ledger = Ledger(ddir)
        batch = ledger.pending()
        _check_run_id(recipe, ddir, batch)
        if batch is not None:
            print(f"draftsmith: resuming traffic batch {batch['id']} (interrupted before its decision)",
                  file=sys.stderr)
        else:
            batch = ingest(ddir, traffic, recipe.retrain, recipe.seed) if traffic else None
            if batch is None:
                print(f"draftsmith: nothing new in {', '.join(traffic) or '(no --traffic given)'}: every prompt was "
                      f"used before; the champion stays and nothing changed")
                return 0
        return _run_batch(recipe, ddir, ledger, batch)


def check_evidence_reachable(recipe) -> None:
    """A retrain judges at most retrain.fresh_prompts prompts of a batch, and of those evaluate.n_prompts
    (0: all): a gate that needs more (retrain.min_prompts) could never promote, so the recipe is refused."""
    rc, n = recipe.retrain, recipe.evaluate.n_prompts
    judged = min(rc.fresh_prompts, n) if n else rc.fresh_prompts
    if judged < rc.min_prompts:
        which = "evaluate.n_prompts" if n and n < rc.fresh_prompts else "retrain.fresh_prompts"
        raise RetrainError(f"retrain.min_prompts={rc.min_prompts} but the gate judges at most {judged} prompts "
                           f"({which}={judged}), so no challenger could ever be promoted; raise {which} or "
                           f"lower retrain.min_prompts")


def _check_run_id(recipe, ddir: Path, pending: dict | None) -> None:
    """A retrain given --run-id writes its run there: refused where that directory already holds another run
    (a distill's, or another batch's retrain), whose status, prompts and generate stage it would overwrite."""
    if not recipe.run_id or not (ddir / recipe.run_id).exists():
        return
    run_dir = ddir / recipe.run_id
    if pending is not None and Path(pending.get("run_dir") or "") == run_dir:
        return  # the interrupted batch's own run, resumed
    raise RetrainError(f"--run-id {recipe.run_id}: {run_dir} already holds a run; a retrain writes a new one "
                       f"(leave --run-id out, or name a directory that does not exist)")


def _open_retrain_run(recipe, ddir: Path, ledger: Ledger, batch: dict) -> Path:
    from .lock import new_run_id

    if batch.get("run_dir"):
        return Path(batch["run_dir"])
    run_dir = ddir / (recipe.run_id or new_run_id())
    run_dir.mkdir(parents=True, exist_ok=True)
    import yaml

    write_text_atomic(run_dir / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    write_json_atomic(run_dir / "status.json", {"kind": "retrain", "batch": batch["id"], "complete": False,
                                                "recipe_hash": recipe.hash(), "started": time.time()})
    ledger.update(batch["id"], run_dir=str(run_dir))
    return run_dir


def _run_batch(recipe, ddir: Path, ledger: Ledger, batch: dict) -> int:
    from .data import encode_prompt
    from .generate import reuse_key, run_generate_incremental
    from .models import load_target
    from .tracking import make_tracker
    from .train import WarmStartError, run_train

    t0 = time.time()
    reg = Registry(ddir)
    run_dir = _open_retrain_run(recipe, ddir, ledger, batch)
    champion = pinned_champion(reg, run_dir)
    from .lock import note_run

    note_run(ddir, run_dir.name)  # the lock names the run it guards
    print(f"draftsmith: retrain of {recipe.domain} in {run_dir}: batch {batch['id']} ({batch['new_rows']} new prompts, "
          f"{batch['n_fresh']} held out fresh); champion {champion['id'] if champion else '(none yet)'}",
          file=sys.stderr)
    target, tok = load_target(recipe.target, recipe.dtype, recipe.device)
    state = data_state(ddir)
    prompts = run_dir / "prompts"
    if not (prompts / "all_train.jsonl").exists():
        base_rows = all_train_rows(Path(state["run_dir"])) if state else []
        new = [r for r in ledger.rows(batch["id"], "train")
               if len(encode_prompt(r, tok, recipe.data.chat)) <= recipe.data.max_prompt_tokens]
        write_jsonl(prompts / "heldout.jsonl", ledger.rows(batch["id"], "fresh"))
        write_jsonl(prompts / "train.jsonl", new)
        write_jsonl(prompts / "all_train.jsonl", base_rows + new)
    base = {"generate": state["generate"], "reuse_key": state["reuse_key"]} if state else None
    _, info = run_generate_incremental(recipe, run_dir, base, target, tok)
    kill_point("retrain.after_generate")
    set_data_state(ddir, run_dir, reuse_key(recipe))

    rc = recipe.retrain
    crecipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, steps=rc.steps or recipe.train.steps))
    init = None
    if champion is not None and rc.warm_start:
        cmeta = draft_dir.read_meta(Path(champion["draft_dir"]))
        if cmeta.get("method", cmeta.get("kind")) == recipe.train.method:
            init = Path(champion["draft_dir"])
        else:
            print(f"draftsmith: the champion is a {cmeta.get('method', cmeta.get('kind'))} draft and the recipe trains "
                  f"{recipe.train.method}: the challenger starts from scratch", file=sys.stderr)
    tracker = make_tracker(recipe, run_dir, "retrain", group=f"{recipe.domain}-retrain")
    try:
        try:
            run_train(crecipe, run_dir, target=target, tokenizer=tok, tracker=tracker, init_from=init)
        except WarmStartError as e:  # as for a champion of another method: the weights cannot carry over
            print(f"draftsmith: {e}: the challenger starts from scratch", file=sys.stderr)
            init = None
            run_train(crecipe, run_dir, target=target, tokenizer=tok, tracker=tracker)
        from .checkpoints import checkpoints

        challenger = serve_like(checkpoints(run_dir / "train")[-1], run_dir / "challenger", champion,
                                recipe.evaluate.hybrid)
        kill_point("retrain.after_train")
        check_target(challenger, recipe, champion)
        judged = judge(recipe, run_dir, target, tok, challenger, champion)
        kill_point("retrain.after_judge")
        decision = decide(recipe, judged)
        metrics = _metrics_of(judged["challenger"], recipe) | {"draft_method": draft_dir.read_meta(challenger).get(
            "method"), "warm_start": init is not None}
        traffic = {"rows": info["reused_rows"] + info["new_rows"], "new_rows": batch["new_rows"], "batch": batch["id"],
                   "generate": info}
        record = register(recipe, run_dir, challenger, decision, metrics, "retrain", champion, traffic, tracker)
    finally:
        tracker.finish()
    ledger.update(batch["id"], status="decided", decision=record["promote"])
    write_json_atomic(run_dir / "status.json", {"kind": "retrain", "batch": batch["id"], "complete": True,
                                                "recipe_hash": recipe.hash(), "wall_s": time.time() - t0})
    _say(record)
    write_report(recipe, run_dir, target, tok)
    return 0


def write_report(recipe, run_dir: Path, target, tok) -> Path | None:
    """run_dir/report.html: the champion in service after the decision, measured on this batch's fresh slice."""
    import shlex

    from .owner_report import write_html_report

    champ = Registry(domain_dir(recipe)).champion()
    if champ is None:
        return None
    cmd = shlex.join(["draftsmith", *sys.argv[1:]]) if sys.argv[1:2] == ["retrain"] else \
        f"draftsmith retrain --domain {recipe.domain}"
    out = write_html_report(run_dir, out=run_dir / "report.html", command=cmd, recipe=recipe, target=target,
                            tokenizer=tok, draft=champ["draft_dir"], prompts=run_dir / "prompts" / "heldout.jsonl")
    print(f"draftsmith: report of the champion {champ['id']} -> {out}", file=sys.stderr)
    return out


# ------------------------------------------------------------------------------- monitor

def monitor(recipe, traffic: list[str]) -> int:
    """The champion's α and τ on the newest traffic's prompts (the target's greedy outputs in our decoder)
    against its own recorded figures; writes runs/<domain>/monitor/<time>.json; 1 when τ dropped by more
    than retrain.drift_threshold (relative), else 0."""
    from .data import encode_prompt
    from .measure import decode_together, proposer_for
    from .models import load_target

    if not traffic:
        raise RetrainError("monitor needs --traffic PATH (the newest traffic: a .jsonl, .parquet or folder)")
    ddir = domain_dir(recipe)
    champion = Registry(ddir).champion()
    if champion is None:
        raise RetrainError(f"{ddir} has no champion to monitor; run `draftsmith distill --domain {recipe.domain}` "
                           f"first")
    ref = champion["metrics"]
    if not ref.get("tau"):  # drift is measured against it: without it every run would read "no drift"
        raise RetrainError(f"the champion {champion['id']} has no recorded tau to measure drift against "
                           f"({champion['draft_dir']}); promote a draft evaluate measured "
                           f"({Registry(ddir).command('rollback --to ID')})")
    rows = read_traffic(traffic)
    rc, cfg = recipe.retrain, recipe.evaluate
    target, tok = load_target(recipe.target, recipe.dtype, recipe.device)
    rows = rows[-rc.monitor_prompts:]  # the newest
    prompts = [encode_prompt(r, tok, recipe.data.chat) for r in rows]
    prompts = [p[-recipe.data.max_prompt_tokens:] for p in prompts]
    _, plain, outs = decode_together(target, {"champion": (proposer_for(champion["draft_dir"], target), cfg.k)},
                                     prompts, cfg.max_new_tokens, tok.eos_token_id, "monitor")
    s = outs["champion"][1]
    drop = 1 - s["tau"] / ref["tau"]
    fired = drop > rc.drift_threshold
    out = {"time": time.time(), "champion": champion["id"], "traffic": [str(Path(p).resolve()) for p in traffic],
           "n_prompts": len(prompts), "alpha": s["alpha"], "tau": s["tau"], "speedup": s["tokens_per_s"] /
           plain["tokens_per_s"] if plain["tokens_per_s"] else None, "champion_alpha": ref.get("alpha"),
           "champion_tau": ref.get("tau"), "tau_drop": drop, "threshold": rc.drift_threshold, "drift": fired}
    path = ddir / "monitor" / (time.strftime("%Y%m%d-%H%M%S") + f"-{int(time.time() * 1e6) % 1000000:06d}.json")
    write_json_atomic(path, out)
    print(f"draftsmith: monitor: champion {champion['id']} on {len(prompts)} new prompts: tau {s['tau']:.2f} vs "
          f"{ref['tau']:.2f} recorded ({-drop:+.1%}), alpha {s['alpha']:.2f} vs {ref.get('alpha', 0):.2f}: "
          + (f"DRIFT (tau fell more than {rc.drift_threshold:.0%}): retrain" if fired else
             f"no drift (threshold {rc.drift_threshold:.0%})") + f" -> {path}")
    return EXIT_DRIFT if fired else 0
