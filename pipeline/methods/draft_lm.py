"""A small draft LM: the target's first `num_layers` layers + final norm + LM head as a model of the
target's own class (any family), or any local HF causal LM with the target's tokenizer (`init_from`), fully
fine-tuned or with LoRA (Hu et al., 2021, via peft). The checkpoint is an ordinary HF model (HF
`assistant_model` loads it), with LoRA also the PEFT adapter in `adapter/`. It keeps the target's
full vocabulary, so `assistant_model` can load it.

Alignment: the logits at position p predict the token at p + 1, whose teacher distribution is row
p + 1 of the batch's token-position top-k, present where `has_t` (completion positions).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from eval import draft_dir

from ..options import option, positive
from ..train_data import TrainError
from .base import DraftMethod, evaluating, next_token_distillation


@dataclass
class DraftLMOptions:
    num_layers: int = option(1, "First layers of the target the draft keeps (with init_from='target').")
    lora_rank: int = option(0, "0 = full fine-tuning; > 0 = LoRA of this rank (peft), saved both as a PEFT "
                               "adapter (adapter/) and merged into HF weights that assistant_model loads.")
    lora_alpha: int = option(32, "With LoRA: the LoRA scaling alpha.")
    init_from: str = option("target", "'target' (its first num_layers layers) or a local HF causal LM "
                                      "directory with the target's tokenizer.")

    def __post_init__(self):
        positive("train.draft_lm.num_layers", self.num_layers)
        positive("train.draft_lm.lora_rank", self.lora_rank, zero_ok=True)
        positive("train.draft_lm.lora_alpha", self.lora_alpha)


class DraftLMTrainer(nn.Module):
    """forward(batch) -> (loss, metrics {div, acc_0}); `tc` needs `divergence` and `jsd_beta`. The
    tokenizer, when given, is saved with the checkpoints."""

    def __init__(self, model, tc, tokenizer=None):
        super().__init__()
        self.model, self.tc, self.tokenizer = model, tc, tokenizer

    def forward(self, batch):
        logits = self.model(input_ids=batch["ids"], attention_mask=batch["valid"].long()).logits  # [B, L, V]
        return next_token_distillation(self.tc, batch, logits)


def build_draft_lm(target, num_layers: int):
    """The target's first `num_layers` layers + final norm + LM head, weights copied, as a model of the
    target's own class (any family: its config with fewer layers, and the state dict without the later
    layers, found under the decoder's layer list: `model.layers`, `transformer.h`, `gpt_neox.layers`...)."""
    from transformers import AutoModelForCausalLM

    from eval.family import describe, layer_list

    try:
        prefix, _ = layer_list(target)
    except ValueError as e:
        raise TrainError(f"train.draft_lm.init_from='target': {e}; give init_from=<a local HF model>") from None
    cfg = copy.deepcopy(target.config)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = min(num_layers, text.num_hidden_layers)
    text.num_hidden_layers = n
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:n]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    keep = [f"{prefix}.{i}." for i in range(n)]
    sd = {k: v for k, v in target.state_dict().items() if not k.startswith(prefix + ".") or k.startswith(tuple(keep))}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    head = model.get_output_embeddings()
    tied = {f"{name}.weight" for name, m in model.named_modules() if m is head}  # absent where tied to the embedding
    if unexpected or set(missing) - tied:
        raise TrainError(f"draft_lm: copying the first {n} layers of {describe(target)} failed: missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return model.float()


def base_model(opts: DraftLMOptions, target, tokenizer):
    """The starting model: the target's first layers, or `init_from` (which must share the tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.loading import tokenizers_match

    if opts.init_from == "target":
        return build_draft_lm(target, opts.num_layers)
    d = Path(opts.init_from)
    if not (d / "config.json").exists():
        raise TrainError(f"train.draft_lm.init_from={opts.init_from!r} is not a local HF model directory (no "
                         f"config.json); give 'target' or a directory saved with save_pretrained")
    if tokenizer is not None:
        draft_tok = AutoTokenizer.from_pretrained(d)
        if not tokenizers_match(tokenizer, draft_tok):
            raise TrainError(f"train.draft_lm.init_from {d} tokenizer differs from the target's (vocab {len(draft_tok)} "
                             f"vs {len(tokenizer)}); a draft must share the target's tokenizer")
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)


def lora_targets(model) -> list[str]:
    """The projections LoRA adapts: every attention and MLP linear the model has."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return sorted(names & {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def lora_model(opts: DraftLMOptions, target, tokenizer, resume: Path | None):
    """The base model under a LoRA adapter: a fresh one, or the checkpoint's adapter/."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base = base_model(opts, target, tokenizer)
    if resume is not None:
        return PeftModel.from_pretrained(base, str(resume / "adapter"), is_trainable=True)
    return get_peft_model(base, LoraConfig(r=opts.lora_rank, lora_alpha=opts.lora_alpha, lora_dropout=0.0,
                                           target_modules=lora_targets(base), task_type="CAUSAL_LM"))


class DraftLM(DraftMethod):
    name = "draft_lm"
    config = DraftLMOptions
    help = "a small LM: the target's first layers or `init_from`, full fine-tuning or LoRA"
    variants = {"lora": {"draft_lm": {"num_layers": 2, "lora_rank": 16, "lora_alpha": 32}, "lr": 1e-3},
                "draft_lm": {"draft_lm": {"num_layers": 2, "lora_rank": 0}, "lr": 3e-4}}
    flat = True
    reuses_target_layers = True
    token_level = True

    def build(self, tc, target, tokenizer, rows, resume):
        from transformers import AutoModelForCausalLM

        opts = tc.draft_lm
        if opts.lora_rank:
            model = lora_model(opts, target, tokenizer, resume)
        elif resume is not None:
            model = AutoModelForCausalLM.from_pretrained(resume, dtype=torch.float32)
        else:
            model = base_model(opts, target, tokenizer)
        model.train()
        return DraftLMTrainer(model, tc, tokenizer)

    def trainable_parameters(self, module):
        return [p for p in module.model.parameters() if p.requires_grad]

    def vocab_size(self, module, target):
        return target.config.vocab_size

    def save(self, module, directory, extra, step):
        lora_rank = module.tc.draft_lm.lora_rank
        if lora_rank:  # the PEFT adapter, and the merged weights HF assistant_model loads
            module.model.save_pretrained(Path(directory) / "adapter")
            copy.deepcopy(module.model).merge_and_unload().save_pretrained(directory)
        else:
            module.model.save_pretrained(directory)
        if module.tokenizer is not None:
            module.tokenizer.save_pretrained(directory)
        draft_dir.write_meta(directory, {"kind": "draft_lm", **extra, "lora_rank": lora_rank, "step": step})

    @torch.no_grad()
    def sample(self, module, target, prompts, firsts, n, seed):
        """HF generate, left-padded, seeded through torch's global RNG."""
        torch.manual_seed(seed)
        Pm = max(len(p) + 1 for p in prompts)
        ids = torch.zeros(len(prompts), Pm, dtype=torch.long)
        am = torch.zeros_like(ids)
        for b, (pr, f) in enumerate(zip(prompts, firsts)):
            ids[b, Pm - len(pr) - 1:], am[b, Pm - len(pr) - 1:] = torch.tensor(pr + [f]), 1
        with evaluating(module.model) as draft:
            dev = next(draft.parameters()).device
            out = draft.generate(input_ids=ids.to(dev), attention_mask=am.to(dev), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        return out[:, Pm:].cpu().tolist()
