"""`draftsmith`: one console script, a subcommand per stage, and `distill` for all of them.

    draftsmith distill --recipe recipes/code.yaml [section.key=value ...]
    draftsmith generate|train|evaluate --recipe recipes/code.yaml [--run-id ID] [section.key=value ...]
    draftsmith compare --recipe recipes/code.yaml [--methods eagle,medusa,...] [--steps N] [--docs F]
                       [--lift-steps N] [--lift-prompts P]
    draftsmith bench --draft runs/code/champion --prompts prompts.jsonl [...]
    draftsmith prompts --out data/code/humaneval_prompts.jsonl [--run-dir runs/chat/latest]
    draftsmith export --draft runs/code/champion --format speculators|eagle3|medusa|hf --out DIR
                      [--verifier TARGET] [--k K] [--force]
    draftsmith verify-export --export DIR [--target HF_DIR] [--prompts P.jsonl] [--n N] [--k K] [--json OUT]
    draftsmith drafts list|show [ID]|rollback [--to ID] --domain D [--runs-dir runs]
    draftsmith retrain --domain code [--traffic LOGS ...] [section.key=value ...]   (docs/retraining.md)
    draftsmith monitor --domain code --traffic LOGS [section.key=value ...]       (exit 1: drift)
    draftsmith report --domain code [--runs-dir runs] [--run-dir DIR] [--draft DIR] [--prompts F.jsonl]
                      [--out report.html] [report.key=value ...]
    draftsmith recipe-help

Errors a user can fix (a bad recipe key, a missing model, empty data, a corrupted shard...) print
one line naming the problem and the fix and exit 2; nothing already written is removed, and
rerunning the same command resumes an interrupted run.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import shlex
import sys
import time
from pathlib import Path

from eval.cli_args import OneLineParser, out_file_problem

from .config import Recipe, RecipeError, help_table, load_recipe
from .faults import kill_point

EXIT_USER_ERROR = 2


def _os_error_line(e: OSError) -> str | None:
    """One line for a write the machine refused (disk full, no permission, a file where a directory should be);
    None for other OS errors (a traceback is the most useful report of those)."""
    path = e.filename or "a file"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full while writing {path}: free space and rerun (the finished parts are kept)"
    # EEXIST/ENOTDIR: a file stands where a directory goes; EISDIR: a directory where a file goes
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return (f"cannot write {path} ({e.strerror}): make it writable or choose another location (runs_dir=..., "
                f"--out), then rerun (the finished parts are kept)")
    return None


def _check_out(path: str | None, flag: str) -> None:
    """An output file given as `flag` (None: not given) refused in one line where it cannot be written."""
    why = path and out_file_problem(path, flag)
    if why:
        raise RecipeError(why)


def _is_user_error(e: BaseException) -> bool:
    """Our own exception classes (defined in pipeline/ or eval/) carry messages written for users."""
    mod = type(e).__module__
    return isinstance(e, (ValueError, RuntimeError)) and (mod.startswith("pipeline") or mod.startswith("eval"))


# ---------------------------------------------------------------- run directories
def _status_path(run_dir: Path) -> Path:
    return run_dir / "status.json"


def _read_status(run_dir: Path) -> dict:
    p = _status_path(run_dir)
    if not p.exists():
        return {}
    try:
        st = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        st = None
    if not isinstance(st, dict):
        raise RecipeError(f"{p} is corrupted (not a JSON object); delete it and rerun: the run's finished stages "
                          f"are kept and read back")
    return st


def _write_status(run_dir: Path, **kw) -> None:
    from .shards import write_json_atomic

    write_json_atomic(_status_path(run_dir), {**_read_status(run_dir), **kw})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def _point_latest(run_dir: Path) -> None:
    """runs/<domain>/latest -> run_dir, a run with a result (its promoted best/), moved atomically."""
    link = run_dir.parent / "latest"
    for old in run_dir.parent.glob(".latest-*"):  # left by a run killed while it moved the pointer
        pid = old.name.split("-")[-1]
        if pid.isdigit() and not _alive(int(pid)):
            old.unlink()
    tmp = run_dir.parent / f".latest-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_dir.name)
    kill_point("cli.latest_pointer")
    os.replace(tmp, link)


def _runs(domain_dir: Path) -> list[tuple[Path, dict]]:
    """The domain's distill runs (directories with a status.json, retrain's own left out), oldest started first."""
    found = []
    for d in domain_dir.iterdir() if domain_dir.is_dir() else ():
        if d.is_symlink() or not d.is_dir() or d.name.startswith("."):
            continue
        st = _read_status(d)
        if st and st.get("kind") != "retrain":
            found.append((d, st))
    return sorted(found, key=lambda x: (x[1].get("started") or 0, x[0].name))


def record_recipe(run_dir: Path, recipe: Recipe) -> None:
    """run_dir/recipe.yaml: the recipe the run's stages last ran with."""
    import yaml

    from .atomic import write_text_atomic

    write_text_atomic(run_dir / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))


def open_run(recipe: Recipe, *, for_stage: bool, new: bool = False, creates: bool = True) -> Path:
    """Pick the run directory (`creates`: a single stage that may begin a run with an explicit run_id, as generate
    does; train and evaluate need one that exists). Its recipe.yaml is written here only for a run without one: a
    command refused on an existing run leaves that run's recorded recipe as it was.

    distill: an explicit run_id; else the newest run of the same recipe if it was interrupted (so rerunning
    `make distill` resumes); else a new timestamped run.
    A single stage: an explicit run_id, else the newest run (the stages continue one pipeline).
    `latest` is not moved here: only a run with a result moves it (`_point_latest`)."""
    domain_dir = Path(recipe.runs_dir) / recipe.domain
    run_id = recipe.run_id
    if run_id is None and not new:
        runs = _runs(domain_dir)
        if not for_stage:
            runs = [r for r in runs if r[1].get("recipe_hash") == recipe.hash()]
        if runs and (for_stage or not runs[-1][1].get("complete")):
            run_id = runs[-1][0].name
            print(f"draftsmith: continuing run {domain_dir / run_id}", file=sys.stderr)
    if run_id is None:
        if for_stage:
            raise RecipeError(f"no run under {domain_dir}; run `draftsmith distill` or `draftsmith generate` "
                              f"first, or pass --run-id")
        from .lock import new_run_id

        for _ in range(100):  # claim a fresh directory: another process may draw the same id
            try:
                (domain_dir / (run_id := new_run_id())).mkdir(parents=True)
                break
            except FileExistsError:
                continue
    run_dir = domain_dir / run_id
    if for_stage and not creates and not run_dir.is_dir():
        raise RecipeError(f"--run-id {run_id}: no run {run_dir}; run `draftsmith generate` (or distill) with it first, "
                          f"or leave --run-id out to continue the newest run")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "recipe.yaml").exists():  # a run's recipe is recorded again only once a stage succeeds
        record_recipe(run_dir, recipe)
    if not _read_status(run_dir):
        _write_status(run_dir, recipe_hash=recipe.hash(), complete=False, started=time.time())
    from .lock import note_run

    note_run(domain_dir, run_id)
    return run_dir


def refuse_early(recipe: Recipe) -> None:
    """What would stop a distill only after its compute, refused first (nothing written yet): a data file that
    cannot be read, a target other than the one the domain's champion serves (admission refuses those)."""
    from .data import check_sources
    from .registry import Registry

    check_sources(recipe.data)
    Registry(Path(recipe.runs_dir) / recipe.domain).check_target(recipe.target)


# ---------------------------------------------------------------- stages
def _load(recipe: Recipe):
    from .models import load_target

    return load_target(recipe.target, recipe.dtype, recipe.device)


def stage_generate(recipe, run_dir, target=None, tok=None):
    from .generate import run_generate
    from .shards import read_manifest
    from .tracking import make_tracker

    if target is None:
        target, tok = _load(recipe)
    tracker = make_tracker(recipe, run_dir, "generate")
    try:
        out = run_generate(recipe, run_dir, model=target, tokenizer=tok)
        m = read_manifest(out)
        tracker.summary({"generate/rows": sum(s["rows"] for s in m["shards"].values()),
                         "generate/shards": len(m["shards"])})
        if recipe.data.synth.check_json:  # a JSON domain: how many of the target's own answers parse
            from .synth import json_parse_rate, write_data_report
            rate, n = json_parse_rate(out, tok)
            write_data_report(run_dir, {"json_parse_rate": rate, "json_checked": n})
            tracker.summary({"generate/json_parse_rate": rate})
    finally:
        tracker.finish()
    return out


def stage_train(recipe, run_dir, target=None, tok=None):
    from accelerate import PartialState

    from .tracking import NoOpTracker, make_tracker
    from .train import run_train

    if target is None:
        target, tok = _load(recipe)
    # under `accelerate launch` every process trains; one W&B run, from the main process
    tracker = make_tracker(recipe, run_dir, "train") if PartialState().is_main_process else NoOpTracker()
    try:
        return run_train(recipe, run_dir, target=target, tokenizer=tok, tracker=tracker)
    finally:
        tracker.finish()


def stage_evaluate(recipe, run_dir, target=None, tok=None):
    from .evaluate import run_evaluate
    from .report import write_report
    from .tracking import make_tracker

    if target is None:
        target, tok = _load(recipe)
    tracker = make_tracker(recipe, run_dir, "evaluate")
    try:
        metrics = run_evaluate(recipe, run_dir, target, tok, tracker=tracker)
    finally:
        tracker.finish()
    kill_point("evaluate.before_report")
    report = write_report(run_dir)
    print(f"draftsmith: {metrics['draft_method']} {metrics['checkpoint']}: alpha {metrics['alpha']:.3f}, "
          f"tau {metrics['tau']:.2f}, speedup {metrics['speedup']:.2f}x, greedy_exact {metrics['greedy_exact']}"
          f" -> {report}")
    return metrics


def stage_report(recipe, run_dir, target=None, tok=None, command=None, **kw) -> Path:
    """The owner's report.html (pipeline/owner_report.py), its curves measured unless report.curves is false."""
    from .owner_report import write_html_report

    out = write_html_report(run_dir, recipe=recipe, target=target, tokenizer=tok, command=command, **kw)
    print(f"draftsmith: report -> {out}", file=sys.stderr)
    return out


def compare_choices(args) -> tuple[list[str], list[str]]:
    """--methods / --divergences, checked (a one-line error before any model loads or run opens)."""
    from .compare import DIVERGENCES, CompareError, check_choices

    divergences = args.divergences.split(",") if args.divergences else list(DIVERGENCES)
    for flag, v in (("--steps", args.steps), ("--lift-steps", args.lift_steps), ("--lift-prompts", args.lift_prompts)):
        if v is not None and v < 1:
            raise CompareError(f"{flag} must be a positive integer (got {v})")
    return check_choices(args.methods.split(",") if args.methods else None, divergences), divergences


def stage_compare(recipe, run_dir, args, methods, divergences, target=None, tok=None) -> dict:
    """Every draft method (and every divergence on the best) on this run's generated data."""
    from .compare import markdown, run_compare
    from .tracking import make_tracker

    if target is None:
        target, tok = _load(recipe)
    if not (run_dir / "generate" / "manifest.json").exists():
        stage_generate(recipe, run_dir, target, tok)
    tracker = make_tracker(recipe, run_dir, "compare")
    try:
        out = run_compare(recipe, run_dir, target, tok,
                          methods=methods, divergences=divergences,
                          steps=args.steps, raw_baseline=not args.no_raw, tracker=tracker,
                          lift_steps=args.lift_steps, lift_prompts=args.lift_prompts)
    finally:
        tracker.finish()
    command = "draftsmith " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["compare"] else "draftsmith compare"
    md = markdown(out, command)
    (run_dir / "compare" / "compare.md").write_text(md)
    if args.docs:
        Path(args.docs).write_text(md)
    if (run_dir / "metrics.json").exists():  # the run's report gains the comparison
        from .report import write_report

        write_report(run_dir)
    b = out["best_measured"]
    print(f"draftsmith: best {b['name']} K={b['k']}: tau {b['tau']:.2f}, speedup {b['speedup']:.2f}x "
          f"({b['vs_ngram']:.2f}x the n-gram proposer) -> {run_dir / 'compare' / 'compare.md'}")
    return out


def distill(recipe: Recipe, new: bool = False, command: str | None = None) -> Path:
    """Step 1 generate -> Step 2 train -> Step 3 evaluate (+ Step 4 logging inside each) -> report.html."""
    run_dir = open_run(recipe, for_stage=False, new=new)
    t0 = time.time()
    target, tok = _load(recipe)
    stage_generate(recipe, run_dir, target, tok)
    stage_train(recipe, run_dir, target, tok)
    stage_evaluate(recipe, run_dir, target, tok)
    from .retrain import admit_distill

    admit_distill(recipe, run_dir, target, tok)  # best/ enters the registry; champion only through the gate
    stage_report(recipe, run_dir, target, tok, command)
    record_recipe(run_dir, recipe)
    kill_point("cli.before_complete")
    _point_latest(run_dir)  # before `complete`: a run killed between the two is found again and finished
    _write_status(run_dir, complete=True, wall_s=time.time() - t0)
    print(f"draftsmith: done in {time.time() - t0:.0f}s; outputs in {run_dir} (and {run_dir.parent / 'latest'}); "
          f"{_in_service(run_dir.parent)}")
    return run_dir


def _in_service(domain_dir: Path) -> str:
    """Where the registry's champion is served from, for distill's last line."""
    from .registry import Registry

    link = Registry(domain_dir).link_path
    if not link.is_symlink():
        return "no draft in service yet: the gate promoted none (gate.json says why)"
    return f"the draft in service: {link} (entry {link.resolve().parent.name})"


# ---------------------------------------------------------------- argument parsing
def _recipe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--recipe", help="recipe YAML (e.g. recipes/code.yaml)")
    g.add_argument("--domain", help="shorthand for --recipe recipes/<domain>.yaml")
    p.add_argument("--run-id", help="run directory name under runs/<domain>/ (reuse one to resume it)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override any recipe value")


def _recipe_from(args) -> Recipe:
    overrides = list(args.overrides)
    if args.run_id:
        overrides.append(f"run_id={args.run_id}")
    if args.recipe is None and args.domain is None:
        raise RecipeError("give --recipe recipes/<domain>.yaml or --domain NAME")
    return load_recipe(args.recipe, overrides, domain=args.domain)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="draftsmith", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="store_true", help="the version, torch's, and the CPU path in use")
    sub = p.add_subparsers(dest="cmd", required=False)
    sub.add_parser("doctor", help="which CPU path this machine takes and why, and which paths it runs "
                                  "(DRAFTSMITH_CPU_PATH, DRAFTSMITH_KERNELS: README)")
    d = sub.add_parser("distill", help="generate -> train -> evaluate -> report")
    _recipe_args(d)
    d.add_argument("--new", action="store_true", help="start a new run even if the latest was interrupted")
    for name, h in [("generate", "stage 1: target completions with top-k log-probs"),
                    ("train", "stage 2: train the draft (resumes from the last checkpoint)"),
                    ("evaluate", "stage 3: every checkpoint in the decoder; promote the fastest")]:
        _recipe_args(sub.add_parser(name, help=h))
    c = sub.add_parser("compare", help="train and judge every draft method x divergence; one table")
    _recipe_args(c)
    from .compare import DIVERGENCES
    from .methods import variants

    c.add_argument("--methods", help=f"comma-separated subset of: {', '.join(variants())} (default: all)")
    c.add_argument("--divergences", help=f"divergences tried on the best method (default: {','.join(DIVERGENCES)})")
    c.add_argument("--steps", type=int, help="training steps per variant (default: the recipe's train.steps)")
    c.add_argument("--no-raw", action="store_true", help="skip the raw-text (undistilled) baseline")
    c.add_argument("--lift-steps", type=int, help="training steps of both arms of the distillation lift "
                   "(generated vs raw text; default: --steps)")
    c.add_argument("--lift-prompts", type=int, help="held-out prompts the lift's two arms are judged on "
                   "(default: evaluate.n_prompts)")
    c.add_argument("--docs", help="also write the table to this Markdown file (e.g. docs/compare.md)")
    sub.add_parser("bench", help="compare our decoder with HF generate / assisted / prompt lookup", add_help=False)
    pr = sub.add_parser("prompts", help="write held-out prompts as JSONL (for bench)")
    pr.add_argument("--out", required=True, help="JSONL path to write the held-out prompts to (HumanEval's 164 "
                    "by default)")
    pr.add_argument("--run-dir", help="write the held-out prompts this run was judged on instead (runs/<domain>/<id>: "
                    "its own split of your data, or its synthesised requests)")
    pr.add_argument("--force", action="store_true", help="replace an --out file that holds other content")
    r = sub.add_parser("retrain", help="the scheduled job: new traffic -> challenger -> gate -> promote or keep")
    _recipe_args(r)
    r.add_argument("--traffic", action="append", default=[], metavar="PATH", help="new traffic (repeat for more): "
                   ".jsonl/.jsonl.gz/.parquet files or folders, in any format distill reads (prompts, served logs, "
                   "OpenAI request/response)")
    m = sub.add_parser("monitor", help="the champion's acceptance on the newest traffic; exit 1 on drift")
    _recipe_args(m)
    m.add_argument("--traffic", action="append", required=True, metavar="PATH", help="the newest traffic (as for "
                   "retrain; repeat for more)")
    rep = sub.add_parser("report", help="the model owner's acceptance-rate report: one self-contained HTML file")
    rep.add_argument("--domain", required=True, help="the domain whose run is reported (runs/<domain>/)")
    rep.add_argument("--runs-dir", default="runs", help="where run directories are (default: runs)")
    rep.add_argument("--run-dir", help="the run to report (default: the registry champion's run, else "
                   "runs/<domain>/latest)")
    rep.add_argument("--draft", help="measure this draft directory instead of the run's promoted best/")
    rep.add_argument("--prompts", help="measure on this JSONL (a 'prompt' or 'messages' per line, optionally a "
                   "'category') instead of the run's held-out prompts")
    rep.add_argument("--out", help="the HTML file to write (default: <run>/report.html)")
    rep.add_argument("overrides", nargs="*", metavar="report.key=value", help="override the run's recipe (e.g. "
                   "report.curves=false, report.ks=[1,2,4])")
    sub.add_parser("recipe-help", help="every recipe key with its default and meaning")
    from . import registry

    registry.add_parser(sub)
    from .export import FORMATS, k_table

    e = sub.add_parser("export", help="write a draft in a format vLLM, SGLang or HF loads")
    e.add_argument("--draft", required=True, help="draft directory (a checkpoint or best/)")
    e.add_argument("--format", required=True, help=f"what to write: {', '.join(FORMATS)} (pipeline/export.py)")
    e.add_argument("--out", required=True, help="output directory (must be new or empty unless --force)")
    e.add_argument("--verifier", help="the target it will be served with (default: the target the draft records)")
    e.add_argument("--k", type=int, help="speculative tokens per round written into the serve commands (default 2)")
    e.add_argument("--k-by-batch", type=k_table, metavar="JSON",
                   help="vLLM's num_speculative_tokens_per_batch_size for the vLLM serve command, e.g. "
                        "'[[1, 4, 4], [5, 256, 0]]' (the owner report's recommended table; --k defaults to its "
                        "largest K)")
    e.add_argument("--force", action="store_true", help="replace a non-empty --out")
    _verify_export_args(sub.add_parser("verify-export", help="load an export in vLLM (make engines) at batch 1 and 4; "
                                       "compare its acceptance and its outputs with our decoder's"))
    return p


def _verify_export_args(v: argparse.ArgumentParser) -> None:
    v.add_argument("--export", required=True, help="directory written by `draftsmith export`")
    v.add_argument("--target", help="target HF directory (default: the export's manifest or verifier)")
    v.add_argument("--draft", help="the source draft directory (default: the export's manifest)")
    v.add_argument("--prompts", help="JSONL prompts (default: HumanEval's, as `draftsmith prompts` writes them)")
    v.add_argument("--n", type=int, default=16, help="prompts used (default 16)")
    v.add_argument("--k", type=int, help="drafted tokens per round (default: the export's K)")
    v.add_argument("--max-new-tokens", type=int, default=128)
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    v.add_argument("--json", help="write the comparison as JSON here")
    v.add_argument("--workdir", help="keep vLLM's jobs, results and logs here (default: a temporary directory)")
    v.add_argument("--eager", action="store_true", help="skip vLLM's torch.compile (starts faster, decodes slower)")


def _lock_domain(recipe: Recipe, cmd: str) -> None:
    """One writing job per domain (pipeline/lock.py); under `accelerate launch` only rank 0 holds it."""
    if int(os.environ.get("RANK", "0")) == 0:
        from .lock import DomainLock

        _locks.append(DomainLock(Path(recipe.runs_dir) / recipe.domain, f"draftsmith {cmd}", recipe.run_id).acquire())


_locks: list = []


def _releasing_locks(fn):
    """The domain lock main took goes when main returns or raises."""
    def wrapped(*a, **kw):
        try:
            return fn(*a, **kw)
        finally:
            while _locks:
                _locks.pop().release()
    return functools.wraps(fn)(wrapped)


def _version() -> int:
    from importlib.metadata import version

    import torch

    from eval.cpu import CpuPathError, cpu_path

    try:
        path = cpu_path().line()
    except CpuPathError as e:
        print(f"draftsmith: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"draftsmith {version('draftsmith')}, torch {torch.__version__}; {path}")
    return 0


@_releasing_locks
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # bench owns its arguments and imports nothing from pipeline's stages
        from eval.bench import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    # parse_known_args: overrides may come before or after --run-id (argparse would otherwise take
    # the positional list only once); anything else unknown is still an error.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        if "overrides" not in args:  # a command without recipe overrides: a stray key=value is a mistake, not a no-op
            parser.error(f"unrecognized arguments: {' '.join(extra)} (draftsmith {args.cmd} takes no recipe "
                         f"overrides; its options: draftsmith {args.cmd} --help)")
        args.overrides = list(args.overrides) + extra
    from .methods import PLUGIN_ERRORS

    if PLUGIN_ERRORS:  # a method the user installed is missing: nothing runs without it
        print(f"draftsmith: error: {PLUGIN_ERRORS[0]}", file=sys.stderr)
        return 2
    if args.version or args.cmd is None:
        if not args.version:
            parser.error("a command is required (draftsmith --help lists them)")
        return _version()
    try:
        if args.cmd == "doctor":
            from eval.cpu import main as doctor

            return doctor()
        if args.cmd == "recipe-help":
            for key, default, h in help_table():
                print(f"{key:32s} {default:32s} {h}")
            return 0
        if args.cmd == "prompts":
            from .data import export_heldout_jsonl

            _check_out(args.out, "--out")
            export_heldout_jsonl(args.out, run_dir=args.run_dir, force=args.force)
            return 0
        if args.cmd == "export":
            from .export import MANIFEST, export_draft

            out = export_draft(args.draft, args.format, args.out, args.verifier, args.k, args.force,
                               args.k_by_batch)
            serve = json.loads((out / MANIFEST).read_text())["serve"]
            print(f"draftsmith: {args.format} export in {out}; serve with:\n" + "\n".join(serve.values()))
            return 0
        if args.cmd == "verify-export":
            from .options import positive
            from .verify_export import verify_export

            for flag, value in (("--n", args.n), ("--max-new-tokens", args.max_new_tokens),
                                ("--k", 1 if args.k is None else args.k)):
                positive(flag, value)  # checked before the engine starts, not minutes after
            _check_out(args.json, "--json")
            verify_export(args.export, target=args.target, k=args.k, draft=args.draft, prompts_path=args.prompts,
                          n=args.n, max_new_tokens=args.max_new_tokens, dtype=args.dtype, json_out=args.json,
                          workdir=args.workdir, eager=args.eager)
            return 0
        if args.cmd == "drafts":
            from .registry import command

            return command(args)
        if args.cmd == "report":
            from .config import load_recipe
            from .owner_report import report_run_dir

            _check_out(args.out, "--out")  # before the curves are measured, not after
            run_dir = report_run_dir(args.domain, args.runs_dir, args.run_dir)
            recipe = load_recipe(run_dir / "recipe.yaml", list(args.overrides))
            stage_report(recipe, run_dir, command=shlex.join(["draftsmith", *argv]), out=args.out, draft=args.draft,
                         prompts=args.prompts)
            return 0
        recipe = _recipe_from(args)
        from .models import resolve_target

        resolve_target(recipe.target)  # a missing target: refused before any run directory is touched
        if args.cmd == "distill":
            refuse_early(recipe)
        _lock_domain(recipe, args.cmd)  # released when main returns
        if args.cmd == "distill":
            distill(recipe, new=args.new, command=shlex.join(["draftsmith", *argv]))
            return 0
        if args.cmd in ("retrain", "monitor"):
            from .retrain import monitor, retrain

            return (retrain if args.cmd == "retrain" else monitor)(recipe, args.traffic)
        if args.cmd == "compare":
            methods, divergences = compare_choices(args)
            try:  # continue the latest run (its generated data), else start one
                run_dir = open_run(recipe, for_stage=True)
            except RecipeError:
                run_dir = open_run(recipe, for_stage=False)
            stage_compare(recipe, run_dir, args, methods, divergences)
            record_recipe(run_dir, recipe)
            _point_latest(run_dir)  # the run has a result now: its comparison
            return 0
        run_dir = open_run(recipe, for_stage=True, creates=args.cmd == "generate")
        {"generate": stage_generate, "train": stage_train, "evaluate": stage_evaluate}[args.cmd](recipe, run_dir)
        record_recipe(run_dir, recipe)
        if args.cmd == "evaluate":  # the run has a promoted draft now
            _point_latest(run_dir)
        return 0
    except KeyboardInterrupt:
        print("draftsmith: interrupted; rerun the same command to resume (finished shards and checkpoints are kept)",
              file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        line = _os_error_line(e) if isinstance(e, OSError) else str(e) if _is_user_error(e) else None
        if line is None or os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        print(f"draftsmith: error: {line}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
