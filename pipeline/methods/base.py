"""What every draft method implements for the train loop (pipeline/train.py), and the pieces that
several methods share. Method modules import this, never each other."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from eval import draft_dir

from ..losses import divergence


class DraftMethod:
    """One draft method. The loop owns the optimizer, schedule, data order and checkpoints; it asks
    the method what data it needs, for the trainable module, its parameters, its loss on a batch,
    how to save it as a draft directory (eval/draft_dir.py) and, for token-level drafts, how to
    sample continuations (data=onpolicy/mix)."""

    name: str = ""  # also the draft kind it saves (eval/draft_dir.py), which says how the decoder serves it
    # that kind, declared with the method (a plugin's: register_method registers it); None: the built-in kind
    # of its name, declared in eval/draft_dir.py, since eval/ serves drafts without importing pipeline/
    kind: draft_dir.DraftKind | None = None
    config: type | None = None  # the dataclass of its recipe section, train.<name>; None: no keys
    help: str = ""  # what it is, in train.method's `draftsmith recipe-help` line
    variants: dict = {}  # `draftsmith compare`'s variants of it: name -> train overrides; {}: not compared
    needs_features: bool = False  # trains on the target's cached features, not on target forwards
    token_level: bool = False  # a draft LM that samples its own continuations (data=onpolicy/mix)
    trains: bool = True  # False: nothing to train, the checkpoint only names the kind
    reuses_target_layers: bool = False  # train.<name>.num_layers counts target layers (compare caps it for small ones)
    # How its section enters the recipe hash and train_key (config.flat_train): flat, in the layout from before
    # the sections, under flat_names where they differ, for every method (the methods that predate the sections);
    # else as "<name>.<key>" only when it runs, without `unhashed` (keys that choose how, not what, it learns).
    flat: bool = False
    flat_names: dict = {}
    unhashed: tuple = ()

    @property
    def layer_by_layer(self) -> bool:
        """Runs the target's own layers in the lean forward (only the families it covers): its kind declares it."""
        return draft_dir.get_kind(self.name).layer_by_layer

    def build(self, tc, target, tokenizer, rows: list[dict], resume: Path | None) -> nn.Module:
        """The trainable module, forward(batch) -> (loss, metrics); fresh, or with the weights of
        the checkpoint `resume`. `tc` is the recipe's train section, `rows` the training rows."""
        raise NotImplementedError

    def trainable_parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """What the optimizer updates (never a target weight)."""
        raise NotImplementedError

    def loss(self, module: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        """(loss, metrics) on a collated batch (pipeline.train_data.collate): the module's forward,
        so that an accelerate-wrapped module syncs its gradients."""
        return module(batch)

    def feature_cache(self, tc, target, n_tokens: int) -> tuple[int, ...] | None:
        """The target layers whose entering residual streams the loop caches for this method, over
        `n_tokens` training tokens (pipeline/features.py, concatenated per token into the batch's "feat");
        None: no such cache (needs_features' final-norm features, or none; a method may compute its
        features itself)."""
        return None

    def vocab_size(self, module: nn.Module, target) -> int:
        """Rows of the draft's vocabulary (the train manifest's draft_vocab_size)."""
        raise NotImplementedError

    def save(self, module: nn.Module | None, directory: Path, extra: dict, step: int) -> None:
        """Write the draft directory: the weights and the metadata {"kind": name, **extra, "step": step}."""
        raise NotImplementedError

    def sample(self, module: nn.Module, target, prompts: list[list[int]], firsts: list[int], n: int,
               seed: int) -> list[list[int]]:
        """Token-level methods: `n` tokens sampled at temperature 1 (seeded by `seed`) after each
        prompt + its first completion token."""
        raise NotImplementedError(f"{self.name} drafts cannot sample their own continuations")


def next_token_distillation(tc, batch: dict, hidden: torch.Tensor, head=None, d2t: torch.Tensor | None = None):
    """The token-level drafts' loss (draft_lm, self_spec): the output at position p predicts token p + 1,
    whose teacher is row p + 1 of the batch's top-k, present where `has_t` (completion positions).
    hidden [B, L, X] is the draft's output at every position; `head` maps the kept rows [N, X] to draft
    logits [N, Vd] (after the mask, so prompt positions never reach a large LM head; None: hidden holds
    the logits); d2t maps draft rows to target ids. -> (divergence, {"div", "acc_0"})."""
    x = hidden[:, :-1]  # [B, L-1, X]: position p -> token p+1
    B, T = x.shape[:2]
    m = batch["has_t"][:, 1:].reshape(-1)  # [B*T] teacher exists for token p+1
    if not bool(m.any()):  # no completion token in this batch: nothing to distil
        return x.sum() * 0, {"div": 0.0, "acc_0": 0.0}
    rows = x.reshape(B * T, -1)[m]  # [N, X]
    logits = rows if head is None else head(rows)  # [N, Vd]
    tk_ids = batch["tk_ids"][:, 1:].reshape(B * T, -1)[m]  # [N, k] target ids
    tk_lp = batch["tk_lp"][:, 1:].reshape(B * T, -1)[m]
    div = divergence(tc.divergence, logits, topk_ids=tk_ids, topk_logprobs=tk_lp, d2t=d2t, beta=tc.jsd_beta,
                     temperature=tc.temperature)
    with torch.no_grad():
        top = logits.argmax(-1)
        if d2t is not None:
            top = d2t[top]
        acc = (top == tk_ids[:, 0]).float().mean()
    return div, {"div": float(div.detach()), "acc_0": float(acc)}


def draft_vocab(rows, V: int, size: int) -> torch.Tensor:
    """EAGLE Step 1 (truncated vocabulary, as in EAGLE-3): the `size` most frequent target ids over the
    generated prompts + completions, ties broken by id; returned sorted (d2t). size 0 or >= V: all ids."""
    if size <= 0 or size >= V:
        return torch.arange(V)
    counts = np.zeros(V, dtype=np.int64)
    for r in rows:
        np.add.at(counts, np.asarray(r["ids"], dtype=np.int64), 1)
    order = sorted(range(V), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order))


def draft_ids(tc, target, rows) -> torch.Tensor | None:
    """The truncated draft vocabulary of train.draft_vocab_size (d2t), or None for the full one."""
    V = target.config.vocab_size
    d2t = draft_vocab(rows, V, tc.draft_vocab_size)
    return None if len(d2t) == V else d2t


def aux_feature_cache(name: str, o, layers: list[int], target, n_tokens: int) -> tuple[int, ...] | None:
    """DraftMethod.feature_cache for a method over the target's aux layers (eagle3, dflash), whose section `o`
    has `features` and `max_cache_gb`: the layers to cache, or None (online) when asked or when the cache of
    `n_tokens` tokens would pass max_cache_gb (features=auto)."""
    from eval.family import aux_bytes_per_token

    per_token = aux_bytes_per_token(target, len(layers))
    gb = n_tokens * per_token / 1e9
    mode = o.features if o.features != "auto" else "cache" if gb <= o.max_cache_gb else "online"
    print(f"{name} aux features (layers {layers}): {per_token} bytes/token x {n_tokens} tokens = {gb:.2f} GB; "
          f"features={o.features} -> {mode}")
    return tuple(layers) if mode == "cache" else None


def batch_aux(batch: dict, target, layers) -> torch.Tensor:
    """The target's aux features of a batch [B, L, n*H] in float32: the cached ones ("feat"), or a forward now
    (outside the loop's autocast, in the target's dtype, as the cache computes them)."""
    from eval.family import aux_hidden_states

    if "feat" in batch:
        return batch["feat"].float()
    ids = batch["ids"]
    with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
        return aux_hidden_states(target, ids, batch["valid"].long(), layers).float()


def frozen_embedding(target) -> nn.Embedding:
    """A frozen copy of the target's token embedding, for heads that read tokens (EAGLE, recurrent Medusa)."""
    return nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().clone(), freeze=True)


@contextmanager
def evaluating(module: nn.Module):
    """The module in eval mode for the block (sampling), then back in the mode it had."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
