"""The HF path of the target's forward (`HFFallback`): any HF causal LM's own forward over a position-indexed
cache of ours (`_SlotLayer`) with masks we build, behind the runner interface of eval/target.py."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .cpu import cpu_gemv
from .family import cache_kwarg, layer_windows
from .layers import KVCache
from .masks import causal_mask, window_masks


class _SlotLayer(CacheLayerMixin):
    """One layer's keys/values [B, nkv, S_max, hd] for HF's attention modules, which call `update` like
    on any HF cache: written at the runner's slots of this forward, the first s_len slots returned. HF's
    StaticLayer writes at one cumulative offset for the whole batch, which ragged rows and tree nodes
    are not, hence this layer."""

    is_sliding = False  # windows are in the masks the runner passes, not in what the cache keeps

    def __init__(self, runner: "HFFallback"):
        super().__init__()
        self.runner = runner  # .slots [B, T], .s_len, .max_len of the current forward

    def lazy_initialization(self, key_states, value_states):
        B, n_kv, _, hd = key_states.shape
        S = self.runner.max_len
        self.keys = key_states.new_zeros(B, n_kv, S, hd)
        self.values = value_states.new_zeros(B, value_states.shape[1], S, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        KVCache.over(self.keys, self.values).write(self.runner.slots, key_states, value_states)
        s = self.runner.s_len
        return self.keys[:, :, :s], self.values[:, :, :s]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.runner.s_len, 0

    def get_seq_length(self) -> int:
        return self.runner.s_len

    def get_max_length(self) -> int:
        return self.runner.max_len


class HFFallback:
    """The HF path: any HF causal LM's own forward, with ragged batches and token trees, like LeanLlama.
    Its attention modules write into a preallocated position-indexed cache (`_SlotLayer`) at the slots
    this runner picks, with explicit `position_ids` and a 4-D attention mask it builds (a chain: slot
    visible iff slot <= pos; a tree: the tree's mask), so the model's own mask builders are skipped.
    Sliding-window layers get the mask with slots older than the window hidden by position (one mask,
    or HF's `{layer type: mask}` mapping where the model mixes full and sliding layers, e.g. Gemma 2/3).
    ATen's matmuls and the model's attention (SDPA, or eager with an additive mask): slower than the lean
    forward's kernels, and not row-invariant."""

    path = "hf"
    trees = True  # slots/mask/move(): a token tree's nodes verified in one forward
    row_invariant = False  # ATen's matmuls: a row's numbers may depend on the others in the forward
    invariant_rows = 0
    row_groups = False  # no rows()/keep(): the prefill pads every prompt to the batch's longest, finished rows run on
    aux_layers: tuple[int, ...] | None = None  # features = hidden_states[i] for these layers, concatenated

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.impl = cfg._attn_implementation
        if self.impl not in ("sdpa", "eager"):
            raise ValueError(f"{type(model).__name__}: the HF path passes its own 4-D masks, which need "
                             f"attn_implementation 'sdpa' or 'eager', not {self.impl!r}: load it with one of those")
        self.body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.head = model.get_output_embeddings()
        p = self.head.weight
        self.dtype, self.device = p.dtype, p.device
        n_layers = cfg.num_hidden_layers
        self.windows = layer_windows(cfg, n_layers)
        # HF's {layer type: mask} where the layers' windows differ (the model reads it per layer), else one mask
        self.types = list(cfg.layer_types[:n_layers]) if self.windows is not None \
            and len(set(self.windows)) > 1 else None
        self.cache = None
        self.slots, self.s_len, self.max_len, self.batch = None, 0, 0, 0

    def reset(self, batch: int, max_len: int) -> None:
        # Reuse the allocation when the shape fits; stale slots are never attended (the masks hide them).
        if self.cache is not None and self.batch == batch and self.max_len >= max_len:
            return
        from transformers import Cache

        self.batch, self.max_len = batch, max_len
        self.cache = Cache(layers=[_SlotLayer(self) for _ in range(self.model.config.num_hidden_layers)])

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from cache slots src [B, P] to slots dst [B, P] (all reads first)."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]  # [B, 1]
        for layer in self.cache.layers:
            for t in (layer.keys, layer.values):  # [B, nkv, S_max, hd]
                t[rows, :, dst] = t[rows, :, src]  # the right side is a copy: every read before any write

    def __call__(self, tokens, pos, s_len, logit_idx=None, slots=None, mask=None):
        with cpu_gemv(tokens.numel(), self.device):
            return self._forward(tokens, pos, s_len, logit_idx, slots, mask)

    def _masks(self, mask: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor):
        """mask [B, 1, T, S] bool -> what the model's forward takes as attention_mask: one 4-D mask, or
        {layer type: mask}; bool for SDPA, additive (0 / dtype min) for eager attention."""
        if self.windows is not None:
            wm = window_masks(mask, pos, slots, self.windows)
            if self.types is None:
                mask = wm[self.windows[0]]
            else:
                mask = {t: wm[w] for t, w in zip(self.types, self.windows)}
        if self.impl == "eager":
            fmt = lambda m: torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(  # noqa: E731
                ~m, torch.finfo(self.dtype).min)
            return {t: fmt(m) for t, m in mask.items()} if isinstance(mask, dict) else fmt(mask)
        return mask

    def _forward(self, tokens, pos, s_len, logit_idx, slots, mask):
        self.slots = pos if slots is None else slots  # [B, T] read by each layer's update
        self.s_len = s_len
        if mask is None:
            mask = causal_mask(pos, s_len)  # [B, 1, T, S]
        aux = self.aux_layers
        kw = {cache_kwarg(type(self.body).forward): self.cache} | ({"output_hidden_states": True} if aux is not None else {})
        out = self.body(input_ids=tokens, position_ids=pos, attention_mask=self._masks(mask, pos, self.slots),
                        use_cache=True, **kw)
        feats = out.last_hidden_state  # [B, T, H] after the final norm
        ret = feats if aux is None else torch.cat([out.hidden_states[i] for i in aux], -1)  # [B, T, n*H]
        if logit_idx is not None:
            feats = feats[torch.arange(tokens.shape[0], device=feats.device), logit_idx][:, None]  # [B, 1, H]
        return _final_logits(self.model.config, self.head(feats)), ret


def _final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the model's CausalLM forward does to the LM head's output, by config key: Granite's
    `logits_scaling` (divides), Cohere's `logit_scale` (multiplies), Gemma 2/3's final softcapping."""
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap
