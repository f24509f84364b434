"""The export formats, one object each: its writer, the engine's speculative config,
the serve commands and how verify-export loads it in vLLM. `draftsmith export` (pipeline/export.py), the
recipe's export.formats check (config.py), evaluate.serve, verify-export, the owner report and vLLM bench
read FORMATS; nothing else lists formats. Which draft kinds a format holds is declared by each kind
(eval/draft_dir.py DraftKind.exports), so a new method exports to an existing format without an edit here.

  speculators  eagle3    vLLM's native format: `vllm serve <out>` alone (verifier and K in config.json)
  speculators-dflash  dflash  vLLM's native DFlash format (speculators 0.9): `vllm serve <out>` alone
  eagle3       eagle3    the EAGLE-3 checkpoint layout (LlamaForCausalLMEagle3, midlayer.*) that SGLang
                         (--speculative-algorithm EAGLE3) and vLLM (method "eagle3") load
  medusa       medusa    vLLM's MedusaModel; independent heads, with an LM head each over the full
                         vocabulary or one shared LM head over a truncated one (original_lm_head +
                         token_map); recurrent heads read tokens, which no engine's Medusa does
  hf           draft_lm  an ordinary HF causal LM with the tokenizer (HF assistant_model, vLLM draft_model)
  vllm-proposer  any     the draft's datastore (the target's own outputs) with draftsmith's lookup proposer
                         (pipeline/engines/draftsmith_vllm/), which vLLM loads as method "custom_class" with
                         the export on PYTHONPATH; no weights

Leaf module: the standard library and eval.draft_dir at import time (config.py imports it); torch,
safetensors and transformers only inside the writers.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from eval import draft_dir

from .engines import draftsmith_vllm
from .engines.draftsmith_vllm import lookup

ENGINES = ("vllm", "sglang", "hf")  # evaluate.serve's engines (besides our own decoder)
HEAD_FILE = "head.safetensors"  # eval/heads/io.py's file (eagle3, medusa)
# ours alone (no engine reads them), and exports and temporaries written inside a draft (best/export-<format>/)
NOT_EXPORTED = (draft_dir.FILE, "trainer_state.pt", "datastore.npy", "export-*", ".*")


class ExportError(ValueError):
    """A draft cannot be exported as asked; the message names the problem and the fix."""


@dataclass
class Verifier:
    """The target model the export will be served with."""

    name_or_path: str  # what the serve commands and the speculators config name
    config: dict  # its config.json
    path: Path | None  # a local HF directory (None for a hub id)


# ------------------------------------------------------------------------------- engine commands

def vllm_speculative_config(method: str, k: int | None = None, model: str | Path | None = None, **extra) -> dict:
    """vLLM's speculative config (`--speculative-config`, LLM(speculative_config=...)): the field names of
    vllm/config/speculative.py's SpeculativeConfig (method, model, num_speculative_tokens, prompt_lookup_*)."""
    spec = {"method": method}
    if model is not None:
        spec["model"] = str(model)
    if k is not None:
        spec["num_speculative_tokens"] = k
    return spec | extra


def vllm_serve(model: str | Path, spec: dict | None = None, loader: dict | None = None) -> str:
    """`vllm serve`, with the speculative config and the model loader's extra config when given."""
    return (f"vllm serve {model}" + (f" --speculative-config {shlex.quote(json.dumps(spec))}" if spec else "")
            + (f" --model-loader-extra-config {shlex.quote(json.dumps(loader))}" if loader else ""))


def sglang_serve(algorithm: str, verifier: str, out: str | Path, k: int) -> str:
    # a chain of K drafted tokens: top-1 per step, K steps, K + 1 tokens verified (the bonus one included)
    return (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {out} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")


def hf_assistant_serve(verifier: str, out: str | Path, k: int) -> str:
    return (f"AutoModelForCausalLM.from_pretrained('{verifier}').generate(**inputs, assistant_model="
            f"AutoModelForCausalLM.from_pretrained('{out}'), num_assistant_tokens={k})")


# ------------------------------------------------------------------------------- the format object

@dataclass(frozen=True)
class ExportFormat:
    name: str
    served_by: tuple[str, ...]  # the engines that serve a draft of its kind in this format (evaluate.serve)
    vllm_method: str  # vLLM's speculative_config "method" for it
    writer: Callable  # (src, meta, tmp, verifier, k): the files into tmp
    recognizes: Callable[[dict], bool] | None = None  # an export's config.json is of this format (None: by speculators_type)
    k_in_config: Callable[[dict], int | None] = lambda config: None  # K as config.json records it
    self_contained: bool = False  # config.json names the verifier and K: `vllm serve <out>` alone
    sglang_algorithm: str | None = None  # SGLang's --speculative-algorithm, where SGLang loads it
    hf_assistant: bool = False  # HF generate's assistant_model loads it
    datastore: bool = False  # it holds the draft's datastore.npy, of a draft of any kind, not the draft itself
    spec_model: str | None = None  # the speculative config's "model" when it is not the export directory
    python_path: bool = False  # it ships a module vLLM imports: the export directory goes on PYTHONPATH
    # (export dir) -> our decoder's Proposer serving the export itself, for verify-export; None: the source draft
    decoder_proposer: Callable | None = None
    # What an export in this format does beyond its files (a shipped proposer's rule): a measurement of an
    # export (evaluate.engine_rank's cache) is read back only under the same revision; None: the files alone
    revision: str | None = None
    speculators_type: str | None = None  # its config.json's speculators_model_type, for the speculators formats
    # (export dir) -> vLLM's model_loader_extra_config that loading it needs ({}: none); see medusa_loader
    loader: Callable[[Path], dict] = lambda out: {}

    def __post_init__(self):
        if self.recognizes is None:
            if self.speculators_type is None:
                raise ValueError(f"export format {self.name!r}: give `recognizes` or `speculators_type`")
            t = self.speculators_type
            object.__setattr__(self, "recognizes", lambda config: config.get("speculators_model_type") == t)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The draft kinds it holds: those that name it in their `exports` (eval/draft_dir.py)."""
        return tuple(k.name for k in draft_dir.kinds() if self.name in k.exports)

    def vllm_spec(self, out: str | Path, k: int, k_by_batch: list | None = None) -> dict:
        """k_by_batch: vLLM's `num_speculative_tokens_per_batch_size` (K capped at `k` by vLLM)."""
        extra = {"num_speculative_tokens_per_batch_size": k_by_batch} if k_by_batch else {}
        return vllm_speculative_config(self.vllm_method, k, self.spec_model or out, **extra)

    def vllm_loader(self, out: str | Path) -> dict:
        """vLLM's model_loader_extra_config for the export in `out` (engine-wide: `--model-loader-extra-config`)."""
        return self.loader(Path(out))

    def vllm_python_path(self, out: str | Path) -> list[str]:
        """What the vLLM process must have on its Python path to load the export in `out`."""
        return [str(out)] if self.python_path else []

    def serve(self, out: str | Path, verifier: str, k: int, k_by_batch: list | None = None,
              files: str | Path | None = None) -> dict[str, str]:
        """{engine: the command that serves the export in `out` with `verifier` at K speculative tokens}; with
        k_by_batch, vLLM's K follows that batch-size table (its speculative config names the verifier, so a
        self-contained export is served through it too)."""
        alone = self.self_contained and not k_by_batch
        loader = self.vllm_loader(files or out)  # files: where the export's files are now (a writer's temp dir)
        cmds = {"vllm": vllm_serve(out, loader=loader) if alone
                else vllm_serve(verifier, self.vllm_spec(out, k, k_by_batch), loader)}
        if self.python_path:
            cmds["vllm"] = f"PYTHONPATH={shlex.quote(str(out))} " + cmds["vllm"]
        if self.sglang_algorithm:
            cmds["sglang"] = sglang_serve(self.sglang_algorithm, verifier, out, k)
        if self.hf_assistant:
            cmds["hf"] = hf_assistant_serve(verifier, out, k)
        return cmds

    def vllm_load(self, out: str | Path, target: str | Path, k: int) -> tuple[str, dict | None]:
        """How verify-export runs the export in `out` (its directory): (vLLM's model, its speculative_config).
        A self-contained export whose config.json names this local target at this K loads alone, as
        `vllm serve <out>` does; any other is the target's draft."""
        if self.self_contained:
            config = json.loads((Path(out) / "config.json").read_text())
            verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
            if verifier and Path(verifier).is_dir() and Path(verifier).resolve() == Path(target).resolve() \
                    and self.k_in_config(config) == k:
                return str(out), None
        return str(target), self.vllm_spec(out, k)


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


def speculators_header(algorithm: str, k: int, v: Verifier, **proposal) -> dict:
    """The keys every speculators config carries (speculators/config.py SpeculatorsConfig): its algorithm, a greedy
    proposal of K tokens (plus `proposal`'s fields), and the verifier vLLM serves it with."""
    return {
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  **proposal}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": v.name_or_path, "architectures": v.config.get("architectures") or []},
        },
        "speculators_version": "0.9.0",
    }


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
    } | speculators_header("eagle3", k, v)
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


def qwen3_layer_config(hc: dict, v: Verifier) -> dict:
    """The DFlash draft's decoder layers as a Qwen3Config dict (speculators' transformer_layer_config): the EAGLE-3
    layer's fields, with its layer count, full attention and no sliding window (it attends to the whole context)."""
    n = hc["num_layers"]
    llama = {key: val for key, val in llama_layer_config(hc, v).items() if key != "mlp_bias"}  # Qwen3 has none
    return llama | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": n,
                    "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * n}


def write_speculators_dflash(src: Path, meta: dict, tmp: Path, v: Verifier, k: int) -> None:
    # Written for speculators/models/dflash/config.py (DFlashSpeculatorConfig, 0.9) and vLLM 0.32's
    # transformers_utils/configs/speculators/algos.py (update_dflash) with models/qwen3_dflash.py's load_weights.
    hc = meta["head_config"]
    if not 1 <= k <= hc["block_size"] - 1:
        raise ExportError(f"K={k}: a DFlash block of {hc['block_size']} drafts 1 to {hc['block_size'] - 1} tokens; "
                          f"pass --k {hc['block_size'] - 1} or fewer")
    config = {
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": qwen3_layer_config(hc, v),
        "draft_vocab_size": hc["draft_vocab_size"], "target_hidden_size": hc["target_hidden_size"],
        "block_size": hc["block_size"], "aux_hidden_state_layer_ids": list(hc["aux_layers"]),
        "mask_token_id": hc["mask_token_id"],
        # vLLM serves every layer causal unless this is true (dflash_config.causal = not it)
        "sliding_window_non_causal": not hc["causal"], "sample_from_anchor": False,
    } | speculators_header("dflash", k, v, accept_tolerance=0.0)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = _load(src)
    state.pop("embed_tokens.weight")  # speculators 0.9 never saves it: vLLM takes the verifier's
    if hc["draft_vocab_size"] == hc["vocab_size"]:  # no vocabulary map over the full vocabulary
        state.pop("d2t", None), state.pop("t2d", None)
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
    d2t = state["d2t"].long()  # [Vd] absolute target ids (eval/heads/medusa.py)
    out = {}
    for i in range(mc["num_heads"]):
        for j in range(mc["num_layers"]):  # ResBlock x + SiLU(W x + b) == vLLM's ResidualBlock layer
            out[f"blocks.{i}.layers.{j}.weight"] = state[f"blocks.{i}.{j}.linear.weight"]
            out[f"blocks.{i}.layers.{j}.bias"] = state[f"blocks.{i}.{j}.linear.bias"]
        if not mc.get("shared_lm_head"):  # full vocabulary (kind_problem): vLLM's row t scores id t, ours d2t[t]
            W = state[f"lm_heads.{i}.weight"]  # [V, H]
            out[f"lm_heads.{i}.weight"] = torch.zeros_like(W).index_copy_(0, d2t, W)
    vd = mc["vocab_size"]
    if mc.get("shared_lm_head"):  # vLLM's original_lm_head: one [Vd, H] head, row r scoring id token_map[r] = d2t[r]
        out["lm_heads.0.weight"], vd = state["lm_heads.0.weight"], mc["draft_vocab_size"]
        if vd < mc["vocab_size"]:
            out["token_map"] = d2t
    # Only "num_heads" and "num_hidden_layers" may contain "num": MedusaConfig.from_pretrained renames
    # any key holding "num" and "heads"/"layers" to them.
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": mc["hidden_size"],
              "vocab_size": mc["vocab_size"], "truncated_vocab_size": vd, "num_heads": mc["num_heads"],
              "num_hidden_layers": mc["num_layers"], "medusa_fc_bias": True,
              "original_lm_head": bool(mc.get("shared_lm_head"))}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _save(out, tmp / "model.safetensors")


def medusa_loader(out: Path) -> dict:
    """`out`: a medusa export, or the draft directory one would be written from (the owner report's command)."""
    # vLLM 0.32's Medusa.load_weights loads a token_map but leaves it out of the names it returns, so the loader's
    # check that every parameter came from the file refuses every truncated export (docs/reference/engines.md,
    # "Medusa heads vLLM serves"); the check is off for those, the weights load the same.
    if (out / "config.json").exists():
        config = json.loads((out / "config.json").read_text())
        truncated = config.get("truncated_vocab_size", config["vocab_size"]) < config["vocab_size"]
    else:
        mc = draft_dir.read_meta(out).get("medusa_config") or {}
        truncated = bool(mc.get("shared_lm_head")) and mc["draft_vocab_size"] < mc["vocab_size"]
    return {"enable_weights_track": False} if truncated else {}


def write_hf(src: Path, meta: dict, tmp: Path, v: Verifier, k: int) -> None:
    # Written for transformers' AutoModelForCausalLM / AutoTokenizer (HF assistant_model, vLLM draft_model).
    from transformers import AutoTokenizer

    from eval.loading import tokenizers_match

    tmp.rmdir()
    # The checkpoint's weights are already merged (pipeline/methods/draft_lm.py saves merge_and_unload's
    # model); the PEFT adapter is copied beside them in adapter/.
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(*NOT_EXPORTED))
    verifier_tok = AutoTokenizer.from_pretrained(v.path or v.name_or_path)
    if (tmp / "tokenizer_config.json").exists():
        draft_tok = AutoTokenizer.from_pretrained(tmp)
        if not tokenizers_match(draft_tok, verifier_tok):
            raise ExportError(f"{src}: its tokenizer differs from verifier {v.name_or_path}'s (vocab {len(draft_tok)} "
                              f"vs {len(verifier_tok)}); a draft must share the verifier's tokenizer: pass the "
                              f"--verifier it was trained for")
    else:
        verifier_tok.save_pretrained(tmp)


def write_vllm_proposer(src: Path, meta: dict, tmp: Path, v: Verifier, k: int) -> None:
    # Written for vllm/v1/spec_decode/custom_class_proposer.py (vLLM 0.32): the proposer package
    # (pipeline/engines/draftsmith_vllm/, imported by vLLM as draftsmith_vllm.proposer), the draft's datastore
    # (eval/datastore.py's layout, read by its lookup.py) and config.json with the lookup's settings.
    arr = np.load(src / lookup.DATASTORE, allow_pickle=False)
    if arr.ndim != 1 or arr.dtype.kind != "i":
        raise ExportError(f"{src / lookup.DATASTORE} holds a {arr.dtype} array of shape {arr.shape}, not a 1-D "
                          f"token-id array; rerun the train stage to write it again")
    vocab = v.config.get("vocab_size")
    if vocab is not None and arr.size and int(arr.max()) >= vocab:
        raise ExportError(f"{src}: its datastore holds token id {int(arr.max())}, but verifier {v.name_or_path} has "
                          f"vocab_size={vocab}; pass the --verifier it was trained for")
    np.save(tmp / lookup.DATASTORE, arr.astype(np.int32), allow_pickle=False)
    pkg = tmp / PROPOSER_PACKAGE
    pkg.mkdir()
    for f in sorted(Path(draftsmith_vllm.__file__).parent.glob("*.py")):
        shutil.copy2(f, pkg / f.name)
    config = {"architectures": [PROPOSER_ARCH], "model_type": "draftsmith_datastore_proposer",
              "vocab_size": vocab, "datastore_tokens": int((arr != lookup.SEP).sum()),
              lookup.CONFIG_KEY: {"class": PROPOSER_CLASS, "rule": lookup.RULE, **lookup.DEFAULTS}}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))


def _lookup_proposer(out):
    from .datastore_proposer import LookupProposer

    return LookupProposer.from_export(out)


# ------------------------------------------------------------------------------- the formats

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
PROPOSER_PACKAGE = "draftsmith_vllm"  # pipeline/engines/draftsmith_vllm/, copied into a vllm-proposer export
PROPOSER_CLASS = f"{PROPOSER_PACKAGE}.proposer.DatastoreProposer"
PROPOSER_ARCH = "DraftsmithDatastoreProposer"


def _archs(config: dict) -> list[str]:
    return config.get("architectures") or []


def _speculators_k(config: dict) -> int | None:
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return methods[0].get("speculative_tokens")


# In detection order: the first whose `recognizes` holds names an export's format (verify-export).
FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    ExportFormat("speculators", ("vllm",), "eagle3", write_speculators, k_in_config=_speculators_k, self_contained=True,
                 speculators_type="eagle3"),
    ExportFormat("speculators-dflash", ("vllm",), "dflash", write_speculators_dflash, k_in_config=_speculators_k,
                 self_contained=True, speculators_type="dflash"),
    ExportFormat("eagle3", ("sglang",), "eagle3", write_eagle3,
                 lambda c: any(a in EAGLE3_ARCHS for a in _archs(c)), sglang_algorithm="EAGLE3"),
    ExportFormat("medusa", ("vllm",), "medusa", write_medusa,
                 lambda c: c.get("model_type") == "medusa" or "MedusaModel" in _archs(c),
                 lambda c: c.get("num_heads"), loader=medusa_loader),
    ExportFormat("hf", ("hf",), "draft_model", write_hf,
                 lambda c: any(a.endswith("ForCausalLM") for a in _archs(c)), hf_assistant=True),
    # served_by=(): it serves the datastore, not the draft, so evaluate.serve never picks it for a kind
    ExportFormat("vllm-proposer", (), "custom_class", write_vllm_proposer,
                 lambda c: PROPOSER_ARCH in _archs(c), datastore=True, spec_model=PROPOSER_CLASS,
                 python_path=True, decoder_proposer=_lookup_proposer, revision=lookup.RULE),
)}

def serve_formats() -> dict[str, dict[str, str]]:
    """{engine: {draft kind: the format that engine serves it in}} (a kind absent cannot be served there), read
    when asked, so a kind registered after this import (a plugin's) is in it."""
    return {e: {kind: f.name for f in FORMATS.values() if e in f.served_by for kind in f.kinds} for e in ENGINES}


def check_exports(kind: draft_dir.DraftKind) -> None:
    """A kind may name only formats that exist (pipeline.methods.register_method checks each method's)."""
    unknown = [f for f in kind.exports if f not in FORMATS]
    if unknown:
        raise ValueError(f"draft kind {kind.name!r} exports to {unknown[0]!r}, which is not an export format "
                         f"({', '.join(FORMATS)})")
