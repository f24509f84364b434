"""Stage 1: the target's own completions for the training prompts, with its top-k log-probs.

Run in-process (`draftsmith distill` passes the loaded model/tokenizer) or under accelerate:

    accelerate launch --num_processes 2 -m pipeline.generate --recipe recipes/code.yaml --run-dir runs/code/X

On a CPU-only machine use `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 ...`:
in accelerate 1.15 `--cpu` always starts a single process.

Prompts are sorted by token length (then id) and cut into batches; shard i holds batches
[i*batches_per_shard, (i+1)*batches_per_shard) and process p of n writes the shards with i % n == p,
so the rows do not depend on the process count. Sampling (temperature > 0) reseeds from
(recipe.seed, batch index) before each batch, for the same reason.

Completions come from this project's decoder (plain decoding, ragged batches on every family's runner;
see `make_decoder`), and their top-k log-probs from the same decode loop's logits (`generate(logprobs=k)`):
its steps run the row-invariant kernels a verify runs, so they are the distribution a draft is judged
against, and no second forward is needed (it cost as much as the decoding on the AVX2 path:
docs/reference/kernels.md). For a method that trains on the target's final-norm features (medusa, eagle)
the same steps keep them too (`generate(features=True)`, saved in each shard: `shards.SHARD_FEATURES`),
the features the served decoder hands the draft, so the train stage runs no teacher-forced pass for them.
`generate.engine` picks HF `generate` or vLLM instead (its own venv, through pipeline/engines:
`vllm_rows`, whose top-k also come from vLLM's decode loop). `generate.max_minutes` caps the stage's wall
time: each process stops before a shard that would end past it, and the manifest's "budget" names the shards
left out (`skipped`), which a resume does not write either. HF `generate`'s rows get theirs from one
teacher-forced HF forward over prompt+completion, untouched by generate's logits processors. In bf16
that top-1 can differ from a greedy token at near-ties; position i is still the target's distribution
for completion_ids[i].
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

from eval.loading import exclusive_lock, target_eos_ids

from . import shards
from .config import drop_budgets, drop_later_defaults, stable_hash
from .data import build_prompt_sets, encode_prompt, read_jsonl
from .faults import kill_point
from .models import compute_copy

log = logging.getLogger("draftsmith.generate")

STAGE = "generate"


def _versions() -> dict:
    import accelerate
    import datasets
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "datasets": datasets.__version__, "accelerate": accelerate.__version__}


def generate_hash(recipe) -> str:
    """Hash of what changes the generated rows (target, dtype, seed, data, generate); a resume must match.
    The engine is recorded in the manifest, not hashed: every engine gives the target's own outputs (they
    differ at bf16 near-ties), so a run resumed on another engine keeps its shards."""
    d = drop_later_defaults(drop_budgets(recipe.to_dict()))
    g = {k: v for k, v in d["generate"].items() if k != "engine"}
    return stable_hash({**{k: d[k] for k in ("target", "dtype", "seed", "data")}, "generate": g})


PROMPTS_KEY = "prompts.json"  # prompts/prompts.json: the settings the prompt sets were built under


def prompts_key(recipe) -> str:
    """Hash of what changes the prompt sets (seed, data; a new target is refused by generate_hash): a run's
    prompts/ must match it."""
    d = drop_later_defaults(drop_budgets(recipe.to_dict()))
    return stable_hash({k: d[k] for k in ("seed", "data")})


def check_prompts(run_dir: Path, recipe) -> None:
    """prompts/ built under other seed/data settings (an override after the run began) is refused in one line: its
    sets would be generated and judged on as if they were this recipe's. Sets from before the key was stored
    are kept as they are."""
    path = run_dir / "prompts" / PROMPTS_KEY
    if path.exists() and json.loads(path.read_text())["key"] != prompts_key(recipe):
        raise shards.ShardError(f"{run_dir / 'prompts'} was built with different seed/data settings; use a "
                                f"new run id, or delete {run_dir / 'prompts'} and {run_dir / 'generate'}")


def batch_seed(seed: int, batch_index: int) -> int:
    return (seed * 1_000_003 + batch_index * 7919 + 12345) % (2**63 - 1)


def _manifest_lock(stage_dir: Path):
    """Serialise manifest read-modify-writes between processes (shards.record_shard has one writer)."""
    return exclusive_lock(stage_dir / ".manifest.lock")


def plan_batches(rows: list[dict], tokenizer, chat: bool, batch_size: int):
    """[(id, prompt_ids)] sorted by (length, id), cut into batches."""
    enc = sorted(((r["id"], encode_prompt(r, tokenizer, chat)) for r in rows), key=lambda x: (len(x[1]), x[0]))
    return [enc[i:i + batch_size] for i in range(0, len(enc), batch_size)]


def keeps_features(recipe) -> bool:
    """Whether generate keeps the target's features for the train stage: our decoder generates, and the
    recipe's method trains on final-norm features of the generated rows."""
    from .methods import get_method

    return (recipe.generate.engine == "draftsmith" and get_method(recipe.train.method).needs_features
            and recipe.train.data == "generated")


def make_decoder(model, engine: str = "draftsmith"):
    """This project's decoder (eval/decoder.py, plain decoding, ragged batches on every family's runner)
    for the generate stage where generate.engine is 'draftsmith', else None: HF `generate` (engine=hf).
    Why not HF `generate` for all: it is slower on CPU (docs/reference/kernels.md), and its bf16 greedy
    tokens are not the ones the served decoder produces (they differ at near-ties: HF's attention runs in
    bf16, ours in fp32), while drafts are judged against the served decoder's. The decoder's batches are
    ragged: each row at its own positions, so a row's tokens do not depend on the batch it is in."""
    from eval.decoder import SpeculativeDecoder

    return SpeculativeDecoder(model, None, k=1) if engine == "draftsmith" else None


def engine_name(engine: str) -> str:
    """The manifest's "engine": who decoded the rows."""
    return {"vllm": "vllm", "draftsmith": "draftsmith-decoder"}.get(engine, "transformers-generate")


@torch.no_grad()
def generate_batch(model, batch, *, pad_id: int, eos_ids: set[int], max_new_tokens: int,
                   temperature: float, top_k: int, seed: int, decoder=None, teacher=None,
                   features: bool = False) -> list[dict]:
    """Generate for one batch and return shard rows with the target's top-k log-probs. `decoder`
    (make_decoder's) decodes when given, its top-k from its own steps, and with `features` each row's
    features at every position under "features" (a tensor [len(prompt) + n, H], which `_save` stores
    beside the rows); else HF `generate` over the left-padded batch, its top-k from a teacher-forced
    forward run by `teacher` (default `model`; models.compute_copy's fp32 copy where bf16 matmuls are slow)."""
    if decoder is not None:
        # Seeded per batch (its own generator), so the process count does not matter.
        res = decoder.generate([ids for _, ids in batch], max_new_tokens, temperature=temperature,
                               eos_token_id=eos_ids, seed=seed, logprobs=top_k,
                               features=features)  # cut after EOS (kept)
        rows = [_row(rid, ids, c, idx, vals)
                for (rid, ids), c, (idx, vals) in zip(batch, res.sequences, res.logprobs)]
        for r, f in zip(rows, res.features or []):
            r["features"] = f
        return rows
    device = model.device
    P = max(len(ids) for _, ids in batch)
    input_ids = torch.full((len(batch), P), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), P), dtype=torch.long)
    for j, (_, ids) in enumerate(batch):
        input_ids[j, P - len(ids):] = torch.tensor(ids)
        attn[j, P - len(ids):] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    completions, gen = _hf_generate(model, input_ids, attn, pad_id=pad_id, eos_ids=eos_ids,
                                    max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    T = gen.shape[1]
    # teacher-forced forward over prompt + completion (minus its last token); logits for the last T columns
    full = torch.cat([input_ids, gen[:, :T - 1]], dim=1) if T > 1 else input_ids
    fmask = torch.cat([attn, torch.ones_like(gen[:, :T - 1])], dim=1) if T > 1 else attn
    pos = (fmask.cumsum(-1) - 1).clamp(min=0)
    logits = (teacher or model)(input_ids=full, attention_mask=fmask, position_ids=pos, logits_to_keep=T).logits
    rows = []
    for j, (rid, ids) in enumerate(batch):
        n = len(completions[j])
        lp = torch.log_softmax(logits[j, :n].float(), dim=-1)
        vals, idx = lp.topk(top_k, dim=-1)  # sorted descending
        rows.append(_row(rid, ids, completions[j], idx, vals))
    return rows


def _row(rid, prompt_ids: list[int], completion: list[int], idx: torch.Tensor, vals: torch.Tensor) -> dict:
    """A shard row: idx, vals [n, k] the target's top-k ids and log-probs at each of the n completion tokens."""
    return {"id": rid, "prompt_ids": prompt_ids, "completion_ids": completion,
            "topk_ids": idx.to(torch.int32).cpu().tolist(), "topk_logprobs": vals.float().cpu().tolist()}


def _hf_generate(model, input_ids, attn, *, pad_id, eos_ids, max_new_tokens, temperature, seed):
    """HF `generate` over a left-padded batch -> (completions cut after their first EOS, kept; the
    generated columns [B, T])."""
    from transformers import GenerationConfig

    sample = temperature > 0
    gcfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample,
                            temperature=temperature if sample else None, top_k=0 if sample else None,
                            top_p=1.0 if sample else None, pad_token_id=pad_id,
                            eos_token_id=sorted(eos_ids) or None)
    if sample:
        torch.manual_seed(seed)  # also seeds CUDA; batch-indexed so the process count does not matter
    gen = model.generate(input_ids=input_ids, attention_mask=attn, generation_config=gcfg)[:, input_ids.shape[1]:]
    completions = []
    for j in range(gen.shape[0]):
        c = gen[j].tolist()
        for t, tok in enumerate(c):
            if tok in eos_ids:
                c = c[:t + 1]
                break
        completions.append(c)
    return completions, gen


def _features():
    from datasets import Features, List, Value
    return Features({"id": Value("string"), "prompt_ids": List(Value("int32")),
                     "completion_ids": List(Value("int32")),
                     "topk_ids": List(List(Value("int32"))), "topk_logprobs": List(List(Value("float32")))})


def run_generate(recipe, run_dir, model=None, tokenizer=None, accelerator=None) -> Path:
    """Generate (or resume) the stage into `run_dir/generate`; return that directory.

    Reads `run_dir/prompts/train.jsonl` (built from the recipe by the main process when missing).
    Shards already complete are kept; missing or corrupted ones are logged and regenerated."""
    from accelerate import Accelerator

    from .models import load_target

    started = time.monotonic()  # generate.max_minutes counts from here: loading the target is the stage's time
    run_dir = Path(run_dir)
    stage = run_dir / STAGE
    if recipe.generate.engine == "vllm":
        from .engines.vllm import engine_python

        engine_python()  # a missing engine stops here, before the target loads
    if accelerator is None:
        accelerator = Accelerator(cpu=recipe.device == "cpu")
    p, n_proc, is_main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    if model is None or tokenizer is None:
        device = "cpu" if accelerator.device.type == "cpu" else "auto"
        model, tokenizer = load_target(recipe.target, recipe.dtype, device)
        if accelerator.device.type != "cpu":
            model.to(accelerator.device)
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = target_eos_ids(model, tokenizer)

    train_path = run_dir / "prompts" / "train.jsonl"
    check_prompts(run_dir, recipe)
    if not train_path.exists():
        if is_main and recipe.data.source == "self":  # the target writes its own prompts (pipeline/synth.py)
            from .synth import build_self_prompt_sets
            build_self_prompt_sets(recipe, run_dir, model, tokenizer)
        elif is_main:
            build_prompt_sets(recipe.data, run_dir, tokenizer, recipe.seed)
        if is_main:
            shards.write_json_atomic(run_dir / "prompts" / PROMPTS_KEY, {"key": prompts_key(recipe)})
        kill_point("generate.prompts_written")
        accelerator.wait_for_everyone()
    rows = read_jsonl(train_path)
    g = recipe.generate
    batches = plan_batches(rows, tokenizer, recipe.data.chat, g.batch_size)
    n_shards = math.ceil(len(batches) / g.batches_per_shard)
    header = {"recipe_hash": recipe.hash(), "generate_hash": generate_hash(recipe), "target": recipe.target,
              "versions": _versions(), "top_k": g.top_k_logprobs, "n_shards_expected": n_shards,
              "engine": engine_name(g.engine), "complete": False}

    done = _keep_finished_shards(stage, header, n_shards, accelerator)
    have = done.keys() | _left_out(shards.read_manifest(stage))  # written, or left out by an earlier run's cut
    todo = [i for i in range(n_shards) if i % n_proc == p and shards.shard_name(i) not in have]
    written = _write_shards(stage, todo, batches, model, recipe, header, pad_id, eos_ids, is_main, started)
    print(f"[generate] process {p}/{n_proc} wrote shards {[shards.shard_name(i) for i in written]}", file=sys.stderr)
    accelerator.wait_for_everyone()
    if is_main:
        _mark_complete(stage, header, n_shards)
    accelerator.wait_for_everyone()
    return stage


def _keep_finished_shards(stage: Path, header: dict, n_shards: int, accelerator) -> dict:
    """The manifest keeps the shards still complete on disk (the main process rewrites it, naming the
    missing or corrupted ones); returns {shard name: entry} of those."""
    old = shards.read_manifest(stage)
    if old.get("generate_hash") not in (None, header["generate_hash"]):
        raise shards.ShardError(f"{stage} was generated with different data/generate settings "
                                f"(hash {old.get('generate_hash')} != {header['generate_hash']}); "
                                f"use a new run id, or delete {stage} (and {stage.parent / 'prompts'} where "
                                f"the data settings changed)")
    done = shards.complete_shards(stage)
    accelerator.wait_for_everyone()  # everyone has read the old state before the main process rewrites it
    if accelerator.is_main_process:
        with _manifest_lock(stage):
            shards.remove_temps(stage, ".shard-", ".tmp-")  # a killed run's half-written shards and manifests
            m = shards.read_manifest(stage)
            for name in sorted(set(m.get("shards", {})) - set(done)):
                log.warning("shard %s is missing or corrupted; regenerating it", stage / name)
                print(f"[generate] shard {stage / name} is missing or corrupted; regenerating it", file=sys.stderr)
            m.update(header)
            m["shards"] = {k: v for k, v in done.items() if int(k.split("-")[1]) < n_shards}
            shards.write_json_atomic(stage / shards.MANIFEST, m)
    accelerator.wait_for_everyone()
    return done


def _shard_batch_ids(i: int, g, n_batches: int) -> range:
    return range(i * g.batches_per_shard, min((i + 1) * g.batches_per_shard, n_batches))


def _write_shards(stage: Path, todo: list[int], batches, model, recipe, header: dict, pad_id, eos_ids,
                  is_main: bool, started: float) -> list[int]:
    """Generate this process's shards `todo`, each saved and recorded in the manifest when done; stop before
    a shard that would end past generate.max_minutes from `started` (time.monotonic()), recording the rest.
    Returns the shards written."""
    from tqdm.auto import tqdm

    g = recipe.generate
    if g.engine == "vllm":
        if g.max_minutes and todo:
            print(f"[generate] generate.max_minutes={g.max_minutes:g} does not apply to generate.engine=vllm: one "
                  f"engine call writes every shard (set generate.max_minutes=0 to silence this)", file=sys.stderr)
        _write_vllm_shards(stage, todo, batches, model, recipe, header, pad_id, eos_ids)
        return todo
    n_todo_batches = sum(len(_shard_batch_ids(i, g, len(batches))) for i in todo)
    bar = tqdm(total=n_todo_batches, desc="generate", unit="batch", disable=not is_main)
    decoder = make_decoder(model, g.engine) if todo else None
    teacher = compute_copy(model) if todo and decoder is None else None
    feats = decoder is not None and keeps_features(recipe)
    t_first, written = time.monotonic(), []
    for i in todo:
        shard_rows = []
        for b in _shard_batch_ids(i, g, len(batches)):
            shard_rows += generate_batch(model, batches[b], pad_id=pad_id, eos_ids=eos_ids,
                                         max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                         top_k=g.top_k_logprobs, seed=batch_seed(recipe.seed, b), decoder=decoder,
                                         teacher=teacher, features=feats)
            bar.update(1)
            kill_point("generate.mid_shard")
        _save(stage, i, shard_rows, header)
        written.append(i)
        now = time.monotonic()
        per_shard = (now - t_first) / len(written)
        if g.max_minutes and len(written) < len(todo) and now + per_shard - started > 60 * g.max_minutes:
            _record_cut(stage, todo[len(written):], written, now - started, g.max_minutes)
            break
    bar.close()
    return written


def _left_out(manifest: dict) -> set[str]:
    """The shards generate.max_minutes left out, as a stage manifest's "budget" names them."""
    return set(manifest.get("budget", {}).get("skipped", []))


def _record_cut(stage: Path, skipped: list[int], written: list[int], seconds: float, max_minutes: float) -> None:
    """The manifest's "budget": the shards this process leaves out (merged with other processes' cuts)."""
    with _manifest_lock(stage):
        m = shards.read_manifest(stage)
        names = sorted(_left_out(m) | {shards.shard_name(i) for i in skipped})
        m["budget"] = {"max_minutes": max_minutes, "skipped": names, "seconds": round(seconds, 1)}
        shards.write_json_atomic(stage / shards.MANIFEST, m)
    print(f"[generate] generate.max_minutes={max_minutes:g}: stopped after {len(written)} shards in {seconds / 60:.1f} "
          f"min; {len(skipped)} shards left out (the next would end past the budget); training on those written",
          file=sys.stderr)


def _save(stage: Path, i: int, rows: list[dict], header: dict) -> None:
    """Shard i: the rows, and their target features when generate_batch kept them."""
    from datasets import Dataset

    feats = [r.pop("features") for r in rows] if rows and "features" in rows[0] else None
    entry = shards.save_shard(stage, i, Dataset.from_list(rows, features=_features()), features=feats)
    kill_point("generate.shard_saved")
    with _manifest_lock(stage):
        shards.record_shard(stage, i, entry, header)
    kill_point("generate.shard_recorded")


def vllm_rows(recipe, batches: list[tuple[int, list]], eos_ids: set[int], workdir: Path) -> list[dict]:
    """Shard rows for [(batch index, batch)] from one vLLM engine (pipeline/engines): its greedy (or seeded,
    per row) completions and its top-k log-probs (log-softmax of the raw logits over the full vocabulary)."""
    from .engines.vllm import run_vllm, vllm_job
    from .models import resolve_target

    g = recipe.generate
    items = [(rid, ids, batch_seed(recipe.seed, b) + j) for b, batch in batches for j, (rid, ids) in enumerate(batch)]
    job = vllm_job(resolve_target(recipe.target), [ids for _, ids, _ in items], g.max_new_tokens,
                   batch_sizes=(len(items),), dtype=recipe.dtype, logprobs=g.top_k_logprobs, seed=recipe.seed,
                   seeds=[s for _, _, s in items] if g.temperature > 0 else None, temperature=g.temperature,
                   eos_token_ids=eos_ids, max_num_seqs=g.batch_size)
    run = run_vllm(job, "generate", workdir=workdir)["runs"][0]
    return [{"id": rid, "prompt_ids": ids, "completion_ids": out, "topk_ids": ti, "topk_logprobs": tl}
            for (rid, ids, _), out, ti, tl in zip(items, run["outputs"], run["topk_ids"], run["topk_logprobs"])]


def agreement(rows: list[dict], ref: list[dict]) -> dict:
    """How far one engine's completions agree with another's on the same prompts: identical rows, and the
    mean share of each row's tokens before the first difference."""
    same = sum(a["completion_ids"] == b["completion_ids"] for a, b in zip(rows, ref))
    shares = []
    for a, b in zip(rows, ref):
        x, y = a["completion_ids"], b["completion_ids"]
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        shares.append(n / max(len(x), len(y), 1))
    return {"rows": len(shares), "identical": same, "prefix_agreement": sum(shares) / len(shares) if shares else 0.0}


def _write_vllm_shards(stage: Path, todo: list[int], batches, model, recipe, header: dict, pad_id, eos_ids) -> None:
    """generate.engine=vllm: this process's shards from one vLLM engine run (its startup takes minutes, so one
    run, not one per shard; an interrupted run regenerates the shards not yet saved). Greedy runs also
    record how vLLM's rows agree with our decoder's on the first batch (the manifest's "engine_check")."""
    if not todo:
        return
    g = recipe.generate
    picked = [(b, batches[b]) for i in todo for b in _shard_batch_ids(i, g, len(batches))]
    rows = vllm_rows(recipe, picked, eos_ids, stage / "vllm")
    decoder = make_decoder(model) if g.temperature == 0 else None
    if decoder is not None:
        b, first = picked[0]
        ours = generate_batch(model, first, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=g.max_new_tokens,
                              temperature=0.0, top_k=1, seed=batch_seed(recipe.seed, b), decoder=decoder)
        header["engine_check"] = {"against": "draftsmith-decoder", **agreement(rows[:len(first)], ours)}
        print(f"[generate] vLLM vs our decoder on {len(first)} prompts: {header['engine_check']}", file=sys.stderr)
    at = 0
    for i in todo:
        n = sum(len(batches[b]) for b in _shard_batch_ids(i, g, len(batches)))
        _save(stage, i, rows[at:at + n], header)
        at += n


def _mark_complete(stage: Path, header: dict, n_shards: int) -> None:
    """Main process, after every process finished: every shard present, or a ShardError naming the missing."""
    with _manifest_lock(stage):
        ok = shards.complete_shards(stage)
        ok |= dict.fromkeys(_left_out(shards.read_manifest(stage)))
        missing = [shards.shard_name(i) for i in range(n_shards) if shards.shard_name(i) not in ok]
        if missing:
            raise shards.ShardError(f"{stage}: shards {', '.join(missing)} are missing after generation; "
                                    f"rerun the generate stage (same run id) to resume")
        m = shards.read_manifest(stage)
        m.update(header)
        m["complete"] = True
        kill_point("generate.before_complete")
        shards.write_json_atomic(stage / shards.MANIFEST, m)


def main(argv=None) -> int:
    from accelerate import Accelerator

    from eval.loading import LoadError

    from .config import load_recipe
    from .data import DataError
    from .models import ModelError
    from .options import RecipeError
    from .processes import leave_process_group, not_joined

    ap = argparse.ArgumentParser(prog="python -m pipeline.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", required=True, help="recipe YAML")
    ap.add_argument("--run-dir", required=True, help="run directory (prompts/ is built there when missing)")
    ap.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        accelerator = Accelerator(cpu=recipe.device == "cpu")
        if why := not_joined(accelerator):
            raise RecipeError(why)
        stage = run_generate(recipe, args.run_dir, accelerator=accelerator)
    except (RecipeError, DataError, ModelError, LoadError, shards.ShardError) as e:
        print(f"draftsmith generate: {e}", file=sys.stderr)
        return 2
    if accelerator.is_main_process:
        print(f"[generate] {stage} complete")
    leave_process_group(accelerator)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------------------------- incremental (retrain)

_FINGERPRINTS: dict[tuple, str] = {}


def target_fingerprint(spec: str) -> str:
    """The target's files (names and bytes: config, tokenizer, weights) as a hash, so new weights at the same
    path or hub id are told apart from the old; cached per process by the files' sizes and times."""
    from .models import resolve_target

    p = Path(resolve_target(spec))
    if not p.is_dir():
        return stable_hash({"hub": spec})
    files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if stamp not in _FINGERPRINTS:
        import hashlib

        h = hashlib.sha256()
        for f in files:
            h.update(f.relative_to(p).as_posix().encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
        _FINGERPRINTS[stamp] = h.hexdigest()[:16]
    return _FINGERPRINTS[stamp]


def reuse_key(recipe) -> str:
    """What a generated row depends on besides its prompt: the target's files, dtype, seed, the generate
    section (not the engine) and the chat wrapping. Shards of an earlier run are reused only under the same key."""
    g = {k: v for k, v in drop_later_defaults(drop_budgets(recipe.to_dict()))["generate"].items() if k != "engine"}
    return stable_hash({"target": target_fingerprint(recipe.target), "dtype": recipe.dtype, "seed": recipe.seed,
                        "generate": g, "chat": recipe.data.chat, "max_prompt_tokens": recipe.data.max_prompt_tokens})


def _link_copy(src: Path, dst: Path) -> None:
    import os
    import shutil

    def link(a, b):
        try:
            os.link(a, b)  # shards are never written in place: a hard link is an immutable copy
        except OSError:
            shutil.copy2(a, b)
    shutil.copytree(src, dst, copy_function=link)


def run_generate_incremental(recipe, run_dir, base: dict | None, model, tokenizer) -> tuple[Path, dict]:
    """run_dir/generate for retrain: the shards of `base` ({"generate": an earlier complete generate dir,
    "reuse_key"}) reused when its reuse_key matches, plus shards generated only for the prompts of
    run_dir/prompts/all_train.jsonl not in them (under run_dir/new/). A changed target regenerates every
    prompt, and says so. Returns (the stage dir, {"reused_rows", "new_rows" (generated), "reused_from", "regenerated",
    and "left_out_rows" where generate.max_minutes cut the new prompts' generation})."""
    from datasets import load_from_disk

    run_dir = Path(run_dir)
    stage = run_dir / STAGE
    m = shards.read_manifest(stage)
    if m.get("complete") and m.get("incremental"):
        return stage, m["incremental"]
    if stage.exists():  # an interrupted assembly: redo it (copies are cheap, new rows resume under new/)
        import shutil
        shutil.rmtree(stage)
    key = reuse_key(recipe)
    rows = read_jsonl(run_dir / "prompts" / "all_train.jsonl")
    reused, have, regenerated = [], set(), False
    if base is not None and base.get("reuse_key") == key and shards.read_manifest(base["generate"]).get("complete"):
        reused = sorted(shards.complete_shards(base["generate"]).items())
        for name, _ in reused:
            have.update(load_from_disk(str(Path(base["generate"]) / name))["id"])
    elif base is not None:
        regenerated = True
        print(f"draftsmith: the target changed since {base['generate']} was generated (reuse key "
              f"{base.get('reuse_key')} != {key}: new weights or generate settings); its shards are not reused and "
              f"all {len(rows)} training prompts are generated again", file=sys.stderr)
    new_rows = [r for r in rows if r["id"] not in have]
    entries = {}
    for i, (name, e) in enumerate(reused):
        _link_copy(Path(base["generate"]) / name, stage / shards.shard_name(i))
        entries[shards.shard_name(i)] = e
    if new_rows:
        sub = run_dir / "new"
        (sub / "prompts").mkdir(parents=True, exist_ok=True)
        if not (sub / "prompts" / "train.jsonl").exists():
            from .atomic import write_text_atomic
            write_text_atomic(sub / "prompts" / "train.jsonl", "".join(json.dumps(r) + "\n" for r in new_rows))
        sub_stage = run_generate(recipe, sub, model=model, tokenizer=tokenizer)
        for j, (name, e) in enumerate(sorted(shards.read_manifest(sub_stage)["shards"].items())):
            _link_copy(sub_stage / name, stage / shards.shard_name(len(reused) + j))
            entries[shards.shard_name(len(reused) + j)] = e
    written = sum(e["rows"] for name, e in entries.items() if int(name.split("-")[1]) >= len(reused))
    info = {"reused_rows": len(have), "new_rows": written, "regenerated": regenerated,
            "reused_from": str(base["generate"]) if reused else None}
    if written < len(new_rows):  # generate.max_minutes cut the new prompts' generation
        info["left_out_rows"] = len(new_rows) - written
    stage.mkdir(parents=True, exist_ok=True)
    shards.write_json_atomic(stage / shards.MANIFEST, {
        "complete": True, "target": recipe.target, "top_k": recipe.generate.top_k_logprobs,
        "generate_hash": generate_hash(recipe), "reuse_key": key, "recipe_hash": recipe.hash(),
        "engine": engine_name(recipe.generate.engine), "incremental": info, "shards": entries})
    return stage, info
