"""Drafts that need no second trained model: the target's own first layers (self-speculative) and an
int8 copy of the target (a baseline).

Self-speculative decoding drafts with a cheaper pass through the target itself: Draft & Verify
(Zhang et al., 2023, "Draft & Verify: Lossless Large Language Model Acceleration via
Self-Speculative Decoding") skips intermediate layers; LayerSkip (Elhoushi et al., 2024, "LayerSkip:
Enabling Early Exit Inference and Self-Speculative Decoding") exits after the first N layers into the
shared final norm and LM head. `SelfSpecDraft` is the early-exit form with the target frozen: the
first N layers, the final norm and the LM head are the target's own Parameters (no copy), and the
only trained part is a small residual adapter between layer N and the final norm, so the draft costs
the adapter's few weights on top of the target (plus its own KV cache for N layers).

Both drafts expose the module layout `eval.target.LeanLlama` runs (`.model.embed_tokens/.layers/
.rotary_emb/.norm`, `.lm_head`, `.config`), so `eval.proposers.DraftLMProposer` decodes them with
its own position-indexed KV cache, ragged batches included.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import draft_dir
from . import family
from .family import cache_kwarg, describe
from .int8 import Int8Linear
from .layers import RMSNorm

ADAPTER_FILE = "adapter.safetensors"


class DraftError(ValueError):
    """A draft cannot be built for this target; the message says why and which methods can."""


def runs_layer_by_layer(model) -> bool:
    """Whether draftsmith's lean forward runs `model`'s layers itself (what self_spec and int8 reuse)
    rather than handing the whole forward to HF."""
    return family.runner_path(model) == "lean"


def any_family_kinds() -> str:
    """The draft kinds that apply to every family (they read the target's features or copy its layers
    whole; draft_dir.DraftKind.layer_by_layer), as "a, b or c"."""
    names = [k.name for k in draft_dir.kinds() if not k.layer_by_layer]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def check_layer_by_layer(what: str, model) -> None:
    """Refuse `what` (a method that runs the target's own layers) on a target the lean forward does not
    run, in one line naming the architecture and the methods that can."""
    if not runs_layer_by_layer(model):
        raise DraftError(f"{what} needs a target draftsmith runs layer by layer ({', '.join(family.LEAN_FAMILIES)}); "
                         f"this target is {describe(model)}: use {any_family_kinds()}")


# ------------------------------------------------------------------------------------ self-spec

class ResidualAdapter(nn.Module):
    """x + up(silu(down(norm(x)))), rank r; `up` starts at zero, so a fresh draft is "exit after
    layer N" (LayerSkip's early exit). The pre-norm keeps the adapter's input on one scale whatever
    the residual stream's outliers at layer N. Its weights may be kept in another dtype than the
    stream (fp32 master weights over bf16 layers): input is cast in, output cast back."""

    def __init__(self, hidden: int, rank: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        w = self.down.weight
        return x + self.up(F.silu(self.down(self.norm(x.to(w.dtype))))).to(x.dtype)


class _AdapterThenNorm(nn.Module):
    """What LeanLlama calls as `model.norm`: the adapter, then the target's own final norm."""

    def __init__(self, adapter: nn.Module, norm: nn.Module):
        super().__init__()
        self.adapter, self.norm = adapter, norm

    def forward(self, x):
        return self.norm(self.adapter(x))


class _DraftHead(nn.Linear):
    """The truncated LM head: rows `d2t` of the target's, trainable, in its own dtype."""

    def forward(self, x):
        return F.linear(x.to(self.weight.dtype), self.weight)


class SelfSpecDraft(nn.Module):
    """The target's first `num_layers` layers + a residual adapter + the target's final norm and LM head.

    Shared with the target (the same Parameter objects, no copies): token embedding, layers[:N], rotary
    module, final norm and, with the full vocabulary, the LM head. Trainable: the adapter and, with a
    truncated vocabulary (`draft_ids`, sorted target ids), the draft's own LM head, whose rows start as
    a copy of the target's rows `draft_ids`, the only weight copied. `d2t` [Vd] maps draft rows to
    target ids (None: full vocabulary).

    Training: `forward(input_ids, attention_mask) -> logits [B, L, Vd]` runs the shared layers under
    no_grad (no graph through frozen weights), the adapter with gradients, the shared norm and LM head
    with detached weights (so gradients reach the adapter but nothing is accumulated into the
    target's .grad). `trainable_parameters()` lists what an optimizer should update.
    Decoding: DraftLMProposer(draft, V, d2t=draft.d2t, fuse=False) runs it with LeanLlama, copying none of
    the shared layers' weights (eval/proposers/draft_lm.py load_self_spec loads it so).

    `train()`/`eval()` switch, and `.to()`/`.float()` convert, the adapter and draft head only: the
    shared modules stay as the target has them (never call the target's conversions through the draft).
    """

    def __init__(self, target, num_layers: int, adapter_rank: int = 64, draft_ids: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        check_layer_by_layer("train.method=self_spec", target)
        cfg = target.config
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"num_layers={num_layers} must be in 1..{cfg.num_hidden_layers} (the target's layers)")
        body = target.model
        self.config = copy.deepcopy(cfg)
        self.config.num_hidden_layers = num_layers
        if getattr(self.config, "layer_types", None):
            self.config.layer_types = self.config.layer_types[:num_layers]
        self.num_layers, self.adapter_rank = num_layers, adapter_rank
        dev = body.embed_tokens.weight.device
        self.adapter = ResidualAdapter(cfg.hidden_size, adapter_rank, float(cfg.rms_norm_eps)).to(dev, dtype)
        # The LeanLlama layout. A plain nn.Module container holds the target's own modules.
        self.model = nn.Module()
        self.model.embed_tokens = body.embed_tokens
        self.model.layers = nn.ModuleList(body.layers[:num_layers])
        self.model.rotary_emb = body.rotary_emb
        self.model.norm = _AdapterThenNorm(self.adapter, body.norm)
        if draft_ids is None:
            self.lm_head = target.lm_head
            self.register_buffer("d2t", None)
        else:
            d2t = torch.as_tensor(draft_ids, dtype=torch.long).to(dev)
            if d2t.ndim != 1 or len(d2t) == 0 or int(d2t.max()) >= cfg.vocab_size or int(d2t.min()) < 0:
                raise ValueError(f"draft_ids must be a non-empty 1-D list of target ids < {cfg.vocab_size}")
            self.lm_head = _DraftHead(cfg.hidden_size, len(d2t), bias=False, device=dev, dtype=dtype)
            with torch.no_grad():
                self.lm_head.weight.copy_(target.lm_head.weight[d2t])
            self.register_buffer("d2t", d2t)
        self.train(False)

    # -------------------------------------------------------------------------------- training
    @property
    def truncated(self) -> bool:
        return self.d2t is not None

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The adapter, and the truncated LM head when there is one; never a shared weight."""
        params = list(self.adapter.parameters())
        return params + (list(self.lm_head.parameters()) if self.truncated else [])

    def train(self, mode: bool = True):
        self.training = mode
        self.adapter.train(mode)
        if self.truncated:
            self.lm_head.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        # .to() / .float() / .cuda() reach only the draft's own parts. The shared modules are the
        # target's: converting them through the draft (a trainer's `model.float()`) would change the
        # target itself.
        self.adapter._apply(fn, recurse)
        if self.truncated:
            self.lm_head._apply(fn, recurse)
            self._buffers["d2t"] = fn(self.d2t)
        return self

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, L] -> [B, L, H]: the residual stream after the shared layer N, through the HF layers
        themselves (no graph: frozen). attention_mask [B, L] (1 = token), optional: padding on the
        right only follows valid tokens, so the causal mask alone gives the same valid positions."""
        from transformers.masking_utils import create_causal_mask

        m = self.model
        B, L = input_ids.shape
        with torch.no_grad():
            x = m.embed_tokens(input_ids)  # [B, L, H]
            pos = torch.arange(L, device=x.device)[None].expand(B, L)  # [B, L]
            mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask,
                                      position_ids=pos, **{cache_kwarg(create_causal_mask): None})
            cos_sin = m.rotary_emb(x, pos)
            for layer in m.layers:
                x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        return x

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, L] -> [B, L, H]: adapter (with gradients) then the target's final norm (its weight
        detached): the input of the LM head, as LeanLlama computes it at decode time."""
        h = self.adapter(self.hidden(input_ids, attention_mask))
        norm = self.model.norm.norm  # the target's
        return torch.func.functional_call(norm, {"weight": norm.weight.detach()}, (h,))

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] (draft vocabulary; map rows to target ids with d2t)."""
        if self.truncated:
            return self.lm_head(feats)
        return F.linear(feats, self.lm_head.weight.detach())  # the target's head, frozen

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, L] -> logits [B, L, Vd]; logits at p predict the token at p + 1."""
        return self.logits(self.features(input_ids, attention_mask))

    # ------------------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        """The adapter (+ truncated LM head and d2t) only: the shared weights are the target's."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {f"adapter.{k}": v for k, v in self.adapter.state_dict().items()}
        if self.truncated:
            state["lm_head.weight"], state["d2t"] = self.lm_head.weight, self.d2t
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(d / ADAPTER_FILE))
        meta = {"kind": "self_spec", "num_layers": self.num_layers, "adapter_rank": self.adapter_rank,
                "hidden_size": self.config.hidden_size, "vocab_size": self.config.vocab_size,
                "draft_vocab_size": len(self.d2t) if self.truncated else self.config.vocab_size, **(extra or {})}
        draft_dir.write_meta(d, meta)

    @classmethod
    def load(cls, directory: str | Path, target, dtype=None, device=None) -> "SelfSpecDraft":
        """Rebuild around `target` (which must be the target it was trained on); the adapter and head
        in `dtype` (default: as saved) on `device` (default: the target's)."""
        from safetensors.torch import load_file

        d = Path(directory)
        meta = draft_dir.read_meta(d)
        if meta.get("kind") != "self_spec":
            raise ValueError(f"{d} holds a {meta.get('kind')!r} draft, not a self_spec adapter")
        cfg = target.config
        for key in ("hidden_size", "vocab_size"):
            if key in meta and meta[key] != getattr(cfg, key):
                raise ValueError(f"{d} was trained on a target with {key}={meta[key]}, this one has "
                                 f"{getattr(cfg, key)}: a self_spec draft only runs on its own target")
        state = load_file(str(d / ADAPTER_FILE))
        dtype = dtype or state["adapter.down.weight"].dtype
        draft = cls(target, meta["num_layers"], meta["adapter_rank"], state.get("d2t"), dtype=dtype)
        draft.adapter.load_state_dict({k[len("adapter."):]: v for k, v in state.items() if k.startswith("adapter.")})
        if draft.truncated:
            with torch.no_grad():
                draft.lm_head.weight.copy_(state["lm_head.weight"])
        return draft if device is None else draft.to(device)  # moves the draft's own parts only


# ----------------------------------------------------------------------------------------- int8

class _Int8Attention(nn.Module):
    def __init__(self, att, dtype):
        super().__init__()
        if hasattr(att, "q_norm"):  # Qwen3: per-head q/k norms, shared like the layer norms
            self.q_norm, self.k_norm = att.q_norm, att.k_norm
        self.o_proj = Int8Linear.quantize(att.o_proj.weight, att.o_proj.bias, dtype)
        if hasattr(att, "scaling"):
            self.scaling = att.scaling
        if hasattr(att, "qkv_proj"):  # Phi-3: already fused [q | k | v], which the lean forward reads as it is
            self.qkv_proj = Int8Linear.quantize(att.qkv_proj.weight, att.qkv_proj.bias, dtype)
            return
        q, k, v = att.q_proj, att.k_proj, att.v_proj
        self.qkv_proj = Int8Linear.cat([Int8Linear.quantize(p.weight, p.bias, dtype, pack=False) for p in (q, k, v)])
        nq, nk = q.out_features, k.out_features
        # q/k/v as views of the fused rows: the HF layout (LeanLlama checks it) without a second copy
        self.q_proj = self.qkv_proj.rows(0, nq)
        self.k_proj = self.qkv_proj.rows(nq, nq + nk)
        self.v_proj = self.qkv_proj.rows(nq + nk, nq + 2 * nk)


class _Int8MLP(nn.Module):
    def __init__(self, mlp, dtype):
        super().__init__()
        self.down_proj = Int8Linear.quantize(mlp.down_proj.weight, mlp.down_proj.bias, dtype)
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: already fused [gate | up]
            self.gate_up_proj = Int8Linear.quantize(mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, dtype)
            return
        g, u = mlp.gate_proj, mlp.up_proj
        self.gate_up_proj = Int8Linear.cat([Int8Linear.quantize(p.weight, p.bias, dtype, pack=False) for p in (g, u)])
        n = g.out_features
        self.gate_proj, self.up_proj = self.gate_up_proj.rows(0, n), self.gate_up_proj.rows(n, 2 * n)


class _Int8Layer(nn.Module):
    def __init__(self, layer, dtype):
        super().__init__()
        self.input_layernorm = layer.input_layernorm  # shared: norms are a few hundred numbers
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.self_attn = _Int8Attention(layer.self_attn, dtype)
        self.mlp = _Int8MLP(layer.mlp, dtype)


class Int8Draft(nn.Module):
    """Every linear layer of the target (LM head included) as a weight-only int8 copy, in LeanLlama's
    layout. Not quantized, and shared with the target rather than copied: the token embedding (a
    lookup reads one row per token, so int8 would save no time), the RMSNorm weights and the rotary
    module."""

    def __init__(self, target):
        super().__init__()
        check_layer_by_layer("train.method=int8", target)
        body = target.model
        dtype = body.embed_tokens.weight.dtype  # the activations' dtype, for the scales
        self.config = target.config
        self.model = nn.Module()
        self.model.embed_tokens = body.embed_tokens
        self.model.layers = nn.ModuleList(_Int8Layer(layer, dtype) for layer in body.layers)
        self.model.rotary_emb = body.rotary_emb
        self.model.norm = body.norm
        head = target.get_output_embeddings()
        self.lm_head = Int8Linear.quantize(head.weight, head.bias, dtype)

    def train(self, mode: bool = True):  # nothing to train; leave the shared modules' mode alone
        self.training = mode
        return self

    def _apply(self, fn, recurse=True):  # .to() etc. reach the int8 linears only, as in SelfSpecDraft
        for m in self.modules():
            if isinstance(m, Int8Linear):
                m._apply(fn, recurse)
        return self


def int8_draft(target) -> Int8Draft:
    """An int8 copy of `target` to use as a DraftLMProposer draft (nothing to train: a baseline).

    Weight-only int8 with per-row scales (eval/int8.py) rather than torch.ao's dynamic quantization:
    quantizing the activations too makes the copy agree with the target on far fewer tokens, which is
    no fair int8 draft. q|k|v and gate|up are fused, at no copy (q/k/v are views of the fused rows).
    Speed and agreement of the variants: docs/reference/kernels.md."""
    return Int8Draft(target).eval()
