"""`draftsmith export`: a trained draft directory written in the formats serving engines load.

    export_draft(src, fmt, out, verifier=None, k=None, force=False) -> out

FORMATS maps each format to the draft kinds it holds:
  speculators  eagle3    vLLM's native format: `vllm serve <out>` alone (verifier and K in config.json)
  eagle3       eagle3    the EAGLE-3 checkpoint layout (LlamaForCausalLMEagle3, midlayer.*) that SGLang
                         (--speculative-algorithm EAGLE3) and vLLM (method "eagle3") load
  medusa       medusa    vLLM's MedusaModel; independent heads over the full vocabulary only (recurrent
                         heads read tokens, which no engine's Medusa does; vLLM 0.32 cannot load
                         truncated LM heads)
  hf           draft_lm  an ordinary HF causal LM with the tokenizer (HF assistant_model, vLLM draft_model)
The final-feature EAGLE head, self_spec and int8 have no engine format. The draft must have been trained
for the verifier (vocabulary, hidden size, layers checked against its config.json). The output is written
to a temporary directory and renamed, so a refusal or a crash leaves `out` as it was; it holds the files
plus MANIFEST (format, source, verifier, K, sha256 of every file, and the serve commands).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from eval import draft_dir

MANIFEST = "draftsmith_export.json"
FORMATS = {"speculators": ("eagle3",), "eagle3": ("eagle3",), "medusa": ("medusa",), "hf": ("draft_lm",)}
# evaluate.serve: the format each engine loads a kind in (a kind absent here cannot be served there)
SERVE_FORMATS = {"vllm": {"eagle3": "speculators", "medusa": "medusa"}, "sglang": {"eagle3": "eagle3"},
                 "hf": {"draft_lm": "hf"}}
DEFAULT_K = 2  # evaluate.k's default: the speculative tokens per round when --k is not given
HEAD_FILE = "head.safetensors"  # eval/heads/io.py's file (eagle3, medusa)
# ours alone (no engine reads them), and exports and temporaries written inside a draft (best/export-<format>/)
_NOT_EXPORTED = (draft_dir.FILE, "trainer_state.pt", "datastore.npy", "export-*", ".*")


class ExportError(ValueError):
    """A draft cannot be exported as asked; the message names the problem and the fix."""


@dataclass
class Verifier:
    """The target model the export will be served with."""

    name_or_path: str  # what the serve commands and the speculators config name
    config: dict  # its config.json
    path: Path | None  # a local HF directory (None for a hub id)


# ------------------------------------------------------------------------------- checks

def engine_format(meta: dict, engine: str) -> str | None:
    """The format `engine` loads a draft of this metadata in, None when it cannot serve it."""
    fmt = SERVE_FORMATS.get(engine, {}).get(meta.get("kind"))
    return None if fmt is None or kind_problem(meta, fmt) else fmt


def kind_problem(meta: dict, fmt: str) -> str | None:
    kind = meta.get("kind")
    mc = meta.get("medusa_config") or {}
    if kind == "medusa" and mc.get("recurrent"):
        return ("recurrent Medusa heads read the drafted tokens, which no engine's Medusa does: no engine "
                "format holds them; train independent heads (train.medusa.recurrent=false)")
    if kind == "medusa" and fmt == "medusa" and mc["draft_vocab_size"] < mc["vocab_size"]:
        return (f"Medusa heads over a truncated draft vocabulary ({mc['draft_vocab_size']} of {mc['vocab_size']} "
                f"ids) do not load in vLLM 0.32: its LM-head loader asserts the full vocabulary, token_map or not "
                f"(vocab_parallel_embedding.py weight_loader); train them with train.draft_vocab_size=0")
    if kind not in FORMATS[fmt]:
        holders = [f for f, kinds in FORMATS.items() if kind in kinds]
        fix = (f"use --format {' or '.join(holders)}" if holders else
               "no engine format holds this kind; train train.method=eagle3 (vLLM, SGLang), medusa with "
               "train.medusa.recurrent=false (vLLM) or draft_lm (HF, vLLM)")
        return f"--format {fmt} holds {' or '.join(FORMATS[fmt])} drafts, not {kind!r}: {fix}"
    return None


def check_kind(meta: dict, fmt: str, src: Path) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    problem = kind_problem(meta, fmt)
    if problem:
        raise ExportError(f"{src}: {problem}")


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} exists and is not empty; give a new directory or pass --force to replace it")


def resolve_verifier(verifier: str | None, meta: dict, src: Path) -> Verifier:
    """--verifier, else the target the draft records (the embedded default resolves to its local HF dir)."""
    from .models import resolve_target

    spec = verifier or meta.get("target")
    if not spec:
        raise ExportError(f"{src} records no target; pass --verifier <the target's HF directory or hub id>")
    path = resolve_target(spec)
    local = Path(path)
    if local.is_dir():
        return Verifier(str(local.resolve()), json.loads((local / "config.json").read_text()), local)
    from transformers import PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(path)
    except OSError as e:
        raise ExportError(f"verifier {spec!r}: cannot read its config.json ({str(e).splitlines()[0]}); "
                          f"give a local HF directory") from None
    return Verifier(path, config, None)


def _draft_shape(meta: dict, src: Path) -> dict:
    """What the draft was built around, in the verifier config's key names."""
    shape = {k: v for k, v in (meta.get("target_config") or {}).items()
             if k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")}
    if meta["kind"] == "eagle3":
        hc = meta["head_config"]
        shape |= {"vocab_size": hc["vocab_size"], "hidden_size": hc.get("target_hidden_size") or hc["hidden_size"]}
    elif meta["kind"] == "medusa":
        mc = meta["medusa_config"]
        shape |= {"vocab_size": mc["vocab_size"], "hidden_size": mc["hidden_size"]}
    elif meta["kind"] == "draft_lm":
        shape |= {"vocab_size": json.loads((src / "config.json").read_text())["vocab_size"]}
    return shape


def check_verifier(meta: dict, src: Path, v: Verifier) -> None:
    """The draft was trained for this verifier: every recorded shape equals the verifier's."""
    for key, want in _draft_shape(meta, src).items():
        have = v.config.get(key)
        if have != want:
            raise ExportError(f"{src} was trained for a target with {key}={want!r}, but verifier "
                              f"{v.name_or_path} has {key}={have!r}; pass the --verifier it was trained for"
                              + (f" ({meta['target']})" if meta.get("target") else ""))
    if meta["kind"] == "eagle3":
        n = v.config.get("num_hidden_layers")
        bad = [i for i in meta["head_config"]["aux_layers"] if n is not None and not 0 <= i <= n]
        if bad:
            raise ExportError(f"{src}: aux_layers {bad} are not layers of verifier {v.name_or_path} "
                              f"({n} layers); pass the --verifier it was trained for")


def check_files(src: Path, meta: dict) -> None:
    need = {"eagle3": [HEAD_FILE], "medusa": [HEAD_FILE], "draft_lm": ["config.json"]}[meta["kind"]]
    if meta["kind"] == "draft_lm" and not any(src.glob("*.safetensors")) and not (src / "pytorch_model.bin").exists():
        need.append("model.safetensors")
    for name in need:
        if not (src / name).is_file():
            raise ExportError(f"{src} has no {name}: not a complete {meta['kind']} draft; export a checkpoint "
                              f"directory written by `draftsmith train` (or best/)")


# ------------------------------------------------------------------------------- serving

def serve_command(fmt: str, out: str | Path, verifier: str, k: int) -> dict[str, str]:
    """{engine: the command that serves the export in `out` with `verifier` at K speculative tokens}."""
    out = str(out)

    def vllm(method: str) -> str:
        spec = json.dumps({"method": method, "model": out, "num_speculative_tokens": k})
        return f"vllm serve {verifier} --speculative-config '{spec}'"

    if fmt == "speculators":  # the verifier and K are in config.json
        return {"vllm": f"vllm serve {out}"}
    if fmt == "eagle3":
        return {"vllm": vllm("eagle3"),
                "sglang": (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
                           f"--speculative-draft-model-path {out} --speculative-num-steps {k} "
                           f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")}
    if fmt == "medusa":
        return {"vllm": vllm("medusa")}
    return {"hf": (f"AutoModelForCausalLM.from_pretrained('{verifier}').generate(**inputs, assistant_model="
                   f"AutoModelForCausalLM.from_pretrained('{out}'), num_assistant_tokens={k})"),
            "vllm": vllm("draft_model")}


# ------------------------------------------------------------------------------- writers

def _load(src: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(src / HEAD_FILE))


def _save(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def llama_layer_config(hc: dict, v: Verifier) -> dict:
    """The EAGLE-3 head's decoder layer as a LlamaConfig dict (the fields vLLM's LlamaDecoderLayer reads)."""
    rope = {"rope_type": "default", "rope_theta": hc["rope_theta"]}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hc["hidden_size"],
            "num_attention_heads": hc["num_attention_heads"], "num_key_value_heads": hc["num_key_value_heads"],
            "head_dim": hc["head_dim"], "intermediate_size": hc["intermediate_size"], "hidden_act": "silu",
            "rms_norm_eps": hc["rms_norm_eps"], "rope_theta": hc["rope_theta"], "rope_parameters": rope,
            "max_position_embeddings": hc["max_position_embeddings"], "vocab_size": hc["vocab_size"],
            "num_hidden_layers": 1, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "bos_token_id": v.config.get("bos_token_id"),
            "eos_token_id": v.config.get("eos_token_id"), "pad_token_id": v.config.get("pad_token_id")}


def write_speculators(src: Path, meta: dict, tmp: Path, v: Verifier, k: int) -> None:
    # Written for vllm/transformers_utils/configs/speculators/{base,algos}.py (update_eagle3) and
    # speculators/models/eagle3/config.py (Eagle3SpeculatorConfig); weights for llama_eagle3.py's load_weights.
    hc = meta["head_config"]
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": llama_layer_config(hc, v),
        "draft_vocab_size": hc["draft_vocab_size"], "target_hidden_size": hc["target_hidden_size"],
        # vLLM defaults a missing key to true; the contract's default is false: always write it
        "norm_before_residual": bool(hc["norm_before_residual"]),
        "eagle_aux_hidden_state_layer_ids": list(hc["aux_layers"]),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": v.name_or_path, "architectures": v.config.get("architectures") or []},
        },
        "speculators_version": "0.9.0",
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _save(_eagle3_state(src, hc), tmp / "model.safetensors")  # the contract's names are the speculators names


def _eagle3_state(src: Path, hc: dict) -> dict:
    """The head's weights; without d2t/t2d over the full vocabulary, where vLLM's Eagle3LlamaForCausalLM
    has no vocabulary map to load them into (and refuses the checkpoint if they are there)."""
    state = _load(src)
    if hc["draft_vocab_size"] == hc["vocab_size"]:
        state.pop("d2t", None), state.pop("t2d", None)
    return state


def write_eagle3(src: Path, meta: dict, tmp: Path, v: Verifier, k: int) -> None:
    # Written for vllm/transformers_utils/configs/eagle.py (EAGLEConfig, method "eagle3") with
    # model_executor/models/llama_eagle3.py, and SGLang's models/llama_eagle3.py (LlamaForCausalLMEagle3).
    hc = meta["head_config"]
    aux = list(hc["aux_layers"])
    config = llama_layer_config(hc, v) | {
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": hc["draft_vocab_size"],
        "target_hidden_size": hc["target_hidden_size"], "norm_before_residual": bool(hc["norm_before_residual"]),
        # vLLM reads the top-level ids first (id i = the stream entering layer i); SGLang reads only
        # eagle_config's and captures the stream entering layer id + 1, so its ids are one less.
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux], "use_aux_hidden_state": True},
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {(f"midlayer.{n[len('layers.0.'):]}" if n.startswith("layers.0.") else n): t
             for n, t in _eagle3_state(src, hc).items()}
    _save(state, tmp / "model.safetensors")


def write_medusa(src: Path, meta: dict, tmp: Path, v: Verifier, k: int) -> None:
    # Written for vllm/transformers_utils/configs/medusa.py (MedusaConfig) and
    # vllm/model_executor/models/medusa.py (Medusa.load_weights).
    import torch

    mc = meta["medusa_config"]
    if k > mc["num_heads"]:
        raise ExportError(f"K={k} needs {k} Medusa heads, the draft has {mc['num_heads']}; pass --k {mc['num_heads']} "
                          f"or fewer")
    state = _load(src)
    d2t = state["d2t"].long()  # [V] absolute target ids (eval/heads/medusa.py); full vocabulary (kind_problem)
    out = {}
    for i in range(mc["num_heads"]):
        for j in range(mc["num_layers"]):  # ResBlock x + SiLU(W x + b) == vLLM's ResidualBlock layer
            out[f"blocks.{i}.layers.{j}.weight"] = state[f"blocks.{i}.{j}.linear.weight"]
            out[f"blocks.{i}.layers.{j}.bias"] = state[f"blocks.{i}.{j}.linear.bias"]
        W = state[f"lm_heads.{i}.weight"]  # [V, H]: our row r scores target id d2t[r], vLLM's row t id t
        out[f"lm_heads.{i}.weight"] = torch.zeros_like(W).index_copy_(0, d2t, W)
    # Only "num_heads" and "num_hidden_layers" may contain "num": MedusaConfig.from_pretrained renames
    # any key holding "num" and "heads"/"layers" to them.
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": mc["hidden_size"],
              "vocab_size": mc["vocab_size"], "truncated_vocab_size": mc["vocab_size"], "num_heads": mc["num_heads"],
              "num_hidden_layers": mc["num_layers"], "medusa_fc_bias": True}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _save(out, tmp / "model.safetensors")


def write_hf(src: Path, meta: dict, tmp: Path, v: Verifier, k: int) -> None:
    # Written for transformers' AutoModelForCausalLM / AutoTokenizer (HF assistant_model, vLLM draft_model).
    from transformers import AutoTokenizer

    from eval.loading import tokenizers_match

    tmp.rmdir()
    # The checkpoint's weights are already merged (pipeline/methods/draft_lm.py saves merge_and_unload's
    # model); the PEFT adapter is copied beside them in adapter/.
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(*_NOT_EXPORTED))
    verifier_tok = AutoTokenizer.from_pretrained(v.path or v.name_or_path)
    if (tmp / "tokenizer_config.json").exists():
        draft_tok = AutoTokenizer.from_pretrained(tmp)
        if not tokenizers_match(draft_tok, verifier_tok):
            raise ExportError(f"{src}: its tokenizer differs from verifier {v.name_or_path}'s (vocab {len(draft_tok)} "
                              f"vs {len(verifier_tok)}); a draft must share the verifier's tokenizer: pass the "
                              f"--verifier it was trained for")
    else:
        verifier_tok.save_pretrained(tmp)


WRITERS = {"speculators": write_speculators, "eagle3": write_eagle3, "medusa": write_medusa, "hf": write_hf}


# ------------------------------------------------------------------------------- export

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(fmt: str, src: Path, meta: dict, tmp: Path, out: Path, v: Verifier, k: int) -> dict:
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    m = {"format": fmt, "kind": meta["kind"], "source": str(src.resolve()), "step": meta.get("step"),
         "train_key": meta.get("train_key"), "verifier": v.name_or_path, "k": k,
         "files": {str(p.relative_to(tmp)): _sha256(p) for p in files},
         "serve": serve_command(fmt, out.resolve(), v.name_or_path, k)}
    if meta.get("proposer") == "hybrid":
        m["note"] = "promoted as a hybrid with n-gram lookups in our decoder; an engine serves the draft alone"
    return m


def export_draft(src: str | Path, fmt: str, out: str | Path, verifier: str | None = None, k: int | None = None,
                 force: bool = False) -> Path:
    """Write the draft directory `src` as `fmt` into `out` (see the module doc); returns `out`.
    ExportError (or DraftDirError) with one line naming the fix when it cannot, `out` untouched."""
    src, out = Path(src), Path(out)
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    meta = draft_dir.read_meta(src)
    check_kind(meta, fmt, src)
    check_files(src, meta)
    check_out(out, force)
    if k is not None and k < 1:
        raise ExportError(f"--k {k}: the speculative tokens per round must be >= 1")
    k = DEFAULT_K if k is None else k
    v = resolve_verifier(verifier, meta, src)
    check_verifier(meta, src, v)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        WRITERS[fmt](src, meta, tmp, v, k)
        m = manifest(fmt, src, meta, tmp, out, v, k)
        (tmp / MANIFEST).write_text(json.dumps(m, indent=2))
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(tmp: Path, out: Path) -> None:
    """tmp becomes out; an existing out (empty, or replaced with --force) is removed only after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
