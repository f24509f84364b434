"""A small causal LM as the draft: an HF model, or a draft in LeanLlama's layout (eval/drafts.py:
the self-speculative and int8 drafts)."""

from __future__ import annotations

import torch

from ..target import make_runner
from ..drafts import SelfSpecDraft, int8_draft
from .base import target_device, Proposer, draw, verified_input


class DraftLMProposer(Proposer):
    """A small causal LM with the target's tokenizer, with its own position-indexed KV cache: an HF
    model, or a draft in LeanLlama's layout (eval.drafts: SelfSpecDraft, Int8Draft).

    d2t [Vd] (a truncated draft vocabulary, draft row -> target id): the model's logits are over
    those Vd rows. Greedy drafting maps the argmax row through d2t (no [B, V] tensor); sampling
    spreads the rows over the target vocabulary (`vocab_size` then required) with -inf elsewhere,
    so q is a distribution over the target's ids, zero outside d2t."""

    name = "draft_lm"
    fed_drafts = True  # drafts 1..k-1 of the round are in the draft's cache (False: feed accept()'s tokens all)

    def __init__(self, model, vocab_size: int | None = None, lean: bool = True, d2t: torch.Tensor | None = None,
                 fuse: bool = True):
        """fuse=False: the model's layers are the target's (a self_spec draft), so the lean forward copies none."""
        self.model = model.eval()
        self.runner = make_runner(model, lean, fuse)
        self.vocab_size = vocab_size  # the target's; draft logits beyond it (padding rows) are dropped
        if d2t is not None and vocab_size is None:
            raise ValueError("DraftLMProposer with a truncated vocabulary (d2t) needs the target's vocab_size")
        self.d2t = None if d2t is None else d2t.long().to(self.runner.device)  # [Vd]

    def _logits(self, tokens, pos, s_len, idx):
        logits, _ = self.runner(tokens, pos, s_len, idx)  # [B, 1, Vd]
        if self.d2t is not None:
            return logits[:, 0]  # [B, Vd]: draft rows, mapped in _draw_draft
        return logits[:, 0, : self.vocab_size]  # [B, V]

    def _draw_draft(self, logits):
        """[B, Vd or V] draft logits -> (tokens [B] target ids, q [B, V] or None)."""
        return draw(logits, self.sampling, self.d2t, self.vocab_size)

    def drafted_elsewhere(self):
        self.fed_drafts = False  # the accepted path may be a lookup's: accept() feeds it all

    def begin(self, prompts, first, max_len, sampling, features=None):
        B, dev = len(prompts), first.device
        self.sampling = sampling
        self.runner.reset(B, max_len)
        L = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        T = int(L.max()) + 1
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            toks[b, : len(p)] = torch.tensor(p, device=dev)
        toks[torch.arange(B, device=dev), L] = first  # [B, T]: prompt + first token, right-padded
        pos = torch.arange(T, device=dev).expand(B, T)
        self.next_logits = self._logits(toks, pos, T, L)  # [B, V] predicts the token after `first`
        self.pos = L  # [B] position of the current token
        self.max_pos = T - 1  # host int: the largest current-token position over rows

    def propose(self, k):
        drafts, qs = [], []
        logits = self.next_logits
        self.fed_drafts = True  # accept() may rely on drafts 1..k-1 being in the cache
        for i in range(k):
            tok, q = self._draw_draft(logits)  # [B], [B, V]
            drafts.append(tok)
            qs.append(q)
            if i + 1 < k:  # feed draft i at position pos + 1 + i to get the next one
                p = (self.pos + 1 + i)[:, None]  # [B, 1]
                logits = self._logits(tok[:, None], p, self.max_pos + 2 + i, None)
        q = None if self.sampling.greedy else torch.stack(qs, 1)
        return torch.stack(drafts, 1) if drafts else torch.empty(self.pos.shape[0], 0, dtype=torch.long), q

    def accept(self, tokens, start, n_acc, bonus, features=None):
        if not self.fed_drafts:  # the drafts came from elsewhere (hybrid): feed them all
            return self._feed_all(tokens, start, n_acc, bonus)
        # Feed [token before the new current one, new current one] at [n'-1, n']: the first slot is
        # the last accepted draft, which is missing from the draft's cache only when all k were
        # accepted (the last draft is never fed while drafting); rewriting it otherwise is harmless.
        B = tokens.shape[0]
        rows = torch.arange(B, device=tokens.device)
        a = n_acc.clamp(min=0)
        prev = tokens[rows, a]  # [B]
        new_pos = start + n_acc + 1  # [B]
        pos = torch.stack([new_pos - 1, new_pos], 1)  # [B, 2]
        self.max_pos = int(new_pos.max())  # host sync: attended cache length
        toks = torch.stack([prev, bonus], 1)  # [B, 2]
        last = torch.ones(B, dtype=torch.long, device=tokens.device)
        self.next_logits = self._logits(toks, pos, self.max_pos + 1, last)  # [B, V]
        self.pos = new_pos

    def _feed_all(self, tokens, start, n_acc, bonus):
        """Feed the verified tokens [current, accepted drafts..., bonus] at positions start.. (columns
        past each row's bonus are junk in slots that later writes overwrite before they are read)."""
        toks, pos, idx = verified_input(tokens, start, n_acc, bonus)  # [B, T + 1], [B, T + 1], [B]
        self.max_pos = int((start + idx).max())  # host sync: attended cache length
        self.next_logits = self._logits(toks, pos, int(pos.max()) + 1, idx)  # [B, V]
        self.pos = start + n_acc + 1
        self.fed_drafts = True


def load(directory, meta, target, dtype) -> DraftLMProposer:
    """The draft kind "draft_lm"'s loader (eval/draft_dir.py): an ordinary HF checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(target_device(target))
    return DraftLMProposer(model, target.config.vocab_size)


def serve_self_spec(draft: SelfSpecDraft, target) -> DraftLMProposer:
    """A self_spec draft: its truncated vocabulary's rows map to target ids by d2t, and its layers are the
    target's, so the lean forward's fused runner is not built for it."""
    return DraftLMProposer(draft, target.config.vocab_size, d2t=draft.d2t, fuse=False)


def load_self_spec(directory, meta, target, dtype) -> DraftLMProposer:
    """The draft kind "self_spec"'s loader: the adapter alone is stored, rebuilt around `target` (its own target)."""
    return serve_self_spec(SelfSpecDraft.load(directory, target, dtype=dtype, device=target_device(target)), target)


def load_int8(directory, meta, target, dtype) -> DraftLMProposer:
    """The draft kind "int8"'s loader: nothing is stored, the int8 copy is built from the target now."""
    return DraftLMProposer(int8_draft(target), target.config.vocab_size)
