"""The target's forward for the speculative decoder, with a preallocated, position-indexed KV cache.

The speculative decoder needs three things from the target's forward that HF's cache classes do
not give directly: (1) every row of a ragged batch writes keys/values at its *own* absolute
positions, (2) a rejected draft's slot is simply overwritten by the next round (no cropping), and
(3) it returns both logits and the features (final hidden state after the final norm, the input of
the LM head) that EAGLE heads read.

Two runners (`make_runner` picks; `runner_path(model)` names the pick, docs/reference/architectures.md):
`LeanLlama` reads the HF module's own weights for the families of `LEAN_FAMILIES` (Llama, Mistral,
Qwen2, Qwen3, Phi-3: q/k/v/o + SwiGLU MLP + RMSNorm + the model's own rotary module, plus each row's
extras) and runs this project's CPU kernels. `HFFallback` (the HF path) runs any other HF causal LM's
own forward over a cache of ours (`_SlotLayer`) with masks we build.

Both expose the same interface:
    runner.reset(batch, max_len)                       # allocate/zero the cache
    logits, feats = runner(tokens [B,T], pos [B,T], s_len, logit_idx=None, slots=None, mask=None)
    runner.move(src [B,P], dst [B,P])                  # copy K/V between cache slots
s_len (host int) is the number of cache slots attended (max position written + 1); `logit_idx`
[B] picks one position per row for the LM head (prefill), else logits for all T positions.
With `runner.aux_layers = (i, j, ...)` set (an EAGLE-3 draft's layers), the features returned are
instead the residual streams entering those layers, concatenated [B, T, n*H] (vLLM's layer ids, HF's
hidden_states[i]); None (the default) keeps the final-norm features.

Token trees (eval.tree): `runner(tokens, pos, s_len, slots=, mask=)` writes K/V at cache `slots` [B,T]
(tree nodes sharing a position need their own slots) under an explicit attention `mask` [B,1,T,S], and
`runner.move(src, dst)` copies the accepted path's K/V into place. Sliding-window layers see, on top of
that mask, only slots within their window by position (`window_masks`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from transformers.cache_utils import CacheLayerMixin

from .cpu import cpu_gemv, module_linear, packed_linear, projection, small_gemm
from .kernels import MAX_ROWS
from .layers import KVCache


@functools.cache
def cache_kwarg(fn) -> str:
    """The keyword `fn` (a model class's forward, create_causal_mask) takes its KV cache by:
    transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40);
    earlier 5.x know only the old one. Cached per function: callers are in the decoding loop."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


@dataclass(frozen=True)
class LeanFamily:
    """What the lean forward needs beyond Llama's layout for one `config.model_type` (LEAN_FAMILIES).
    Attention/MLP biases need no row: the projections' own `.bias` is read wherever it is set (Qwen2)."""
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (`q_norm`, `k_norm`) before RoPE
    fused: bool = False  # Phi-3: `qkv_proj` rows [q | k | v] and `gate_up_proj` rows [gate | up] (no q/k/v modules)


# model_type -> its row. Sliding windows (Mistral, Phi-3, Qwen2/3 with use_sliding_window) need no flag:
# every family's windows come from the config (`layer_windows`) and go into the attention mask. Partial
# rotary (Phi-3's partial_rotary_factor) is read from the width of the model's own rotary module's cos.
# Anything else (Gemma 2/3: (1+w) norms, scaled embeddings, GELU, softcapping; GPT-2; GPT-NeoX) runs on
# the HF path (HFFallback), which decodes every family the same way, without this project's kernels.
LEAN_FAMILIES: dict[str, LeanFamily] = {
    "llama": LeanFamily(),
    "mistral": LeanFamily(),
    "qwen2": LeanFamily(),
    "qwen3": LeanFamily(qk_norm=True),
    "phi3": LeanFamily(fused=True),
}


def layer_windows(config, n_layers: int) -> list[int | None] | None:
    """Each layer's sliding window (a key at position p is seen from position q iff p > q - W), as the
    model's own mask builders read the config: `layer_types` where the config has them (Qwen2/3, Gemma),
    else `sliding_window` on every layer (Mistral, Phi-3). None when no layer has a window."""
    w = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise TypeError(f"{config.model_type}: layer types {sorted(unknown)} have no mask here "
                            "(only full_attention and sliding_attention)")
        wins = [w if t == "sliding_attention" else None for t in types[:n_layers]]
    else:
        wins = [w] * n_layers
    return wins if any(x is not None for x in wins) else None


def _lean_family(model) -> LeanFamily | None:
    """The model's LEAN_FAMILIES row where its modules have the layout that row reads, else None."""
    row = LEAN_FAMILIES.get(getattr(model.config, "model_type", None))
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if row is None or layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return None
    l0 = layers[0]
    att, mlp = getattr(l0, "self_attn", None), getattr(l0, "mlp", None)
    fused = hasattr(att, "qkv_proj") and hasattr(mlp, "gate_up_proj")
    need_att = fused or all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj"))
    need_mlp = fused or all(hasattr(mlp, n) for n in ("gate_proj", "up_proj"))
    ok = need_att and need_mlp and hasattr(att, "o_proj") and hasattr(mlp, "down_proj") \
        and (fused or not row.fused) and hasattr(att, "q_norm") == row.qk_norm \
        and getattr(model.config, "hidden_act", "silu") == "silu" \
        and hasattr(l0, "input_layernorm") and hasattr(l0, "post_attention_layernorm")
    return row if ok else None


def lean_supported(model) -> bool:
    """Whether `make_runner` gives `model` the lean forward (LeanLlama: this project's kernels) rather
    than the HF path (HFFallback). Both take ragged batches and token trees."""
    return _lean_family(model) is not None


def runner_path(model) -> str:
    """"lean" or "hf": the forward `make_runner(model)` runs (docs/reference/architectures.md)."""
    return "lean" if lean_supported(model) else "hf"


def window_masks(mask: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, windows) -> dict:
    """mask [B, 1, T, S] (which slots each query sees), pos/slots [B, T] of this forward -> {W: mask with
    the slots older than W positions hidden} for each window W in `windows` (None: `mask` itself).
    A slot written now holds its token's position; every other visible slot is a committed one, whose
    position is its index (the cache is position-indexed), so trees get their nodes' true distances."""
    B, S = mask.shape[0], mask.shape[-1]
    cols = torch.arange(S, device=mask.device)
    held = cols.expand(B, S).clone().scatter_(1, slots, pos)  # [B, S] position in each slot
    return {w: mask if w is None else mask & (held[:, None, None, :] > pos[:, None, :, None] - w)
            for w in set(windows)}


def causal_mask(pos: torch.Tensor, s_len: int) -> torch.Tensor:
    """pos [B, T] -> [B, 1, T, s_len]: query at position p sees slots 0..p of its own row (a chain)."""
    cols = torch.arange(s_len, device=pos.device)
    return (cols[None, None, :] <= pos[:, :, None])[:, None]


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] on the last dim. HF's rotate_half is [-x2, x1]; the sign lives in `sin`
    (see LeanLlama.__call__), which saves a negation per tensor per layer."""
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)


class LeanLlama:
    """Llama-family forward over the HF module's own weights, writing K/V at absolute positions.

    fuse=True (the default) runs q|k|v and gate|up as one matmul each: the model's own fused modules
    where it has them (`qkv_proj`, `gate_up_proj`), else concatenated copies of the weights.
    fuse=False calls the model's own q/k/v/gate/up modules: no copy, for drafts that share their
    layers with the target (eval.drafts.SelfSpecDraft); five projection calls per layer instead of two."""

    path = "lean"
    trees = True  # slots/mask/move(): a token tree's nodes verified in one forward
    aux_layers: tuple[int, ...] | None = None  # features = the residual streams entering these layers

    def __init__(self, model, fuse: bool = True):
        family = _lean_family(model)
        if family is None:
            raise TypeError(f"{type(model).__name__} is not a family the lean forward covers "
                            f"({', '.join(LEAN_FAMILIES)}): use make_runner, which gives it the HF path")
        self.model = model
        cfg = model.config
        self.qk_norm = family.qk_norm
        self.windows = layer_windows(cfg, len(model.model.layers))  # per layer, None: no sliding layer
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = getattr(model.model.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        # The cache follows the layers' dtype (the token embedding's): a draft may keep its own LM head
        # in another dtype than the layers it shares with the target.
        p = model.model.embed_tokens.weight
        self.dtype, self.device = p.dtype, p.device
        # On CPU the K/V cache and the attention are float32: PyTorch's CPU attention kernel is several
        # times slower in bf16 than in fp32 at decode shapes, a cost that grows with the context
        # (docs/reference/kernels.md). The projections stay in the model's dtype; q/k/v are rounded to it
        # exactly as before and only widened for the attention. CUDA keeps the model's dtype.
        self.cache_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.caches: list[KVCache] = []  # per layer, slices of K and V (reset())
        self.K = self.V = None  # [L, B, nkv, S_max, hd]
        # Fused projections (q|k|v and gate|up): one matmul instead of three/two per layer, which
        # matters on CPU at batch 1 where per-call overhead is a large part of a token's time. They
        # are copies taken now: a runner must be rebuilt if the model's weights change afterwards.
        # A model that already holds fused projections (`self_attn.qkv_proj`, `mlp.gate_up_proj`,
        # e.g. eval.drafts' int8 draft) is used as it is, without a copy.
        # With fuse=True every projection and the LM head is also packed for oneDNN on CPU bf16 (see
        # `packed_linear`); fuse=False copies nothing, so it packs nothing either.
        self.fused = [None] * len(model.model.layers)  # per layer: (qkv(h), gate_up(h)) callables, or None
        self.out = [(projection(l.self_attn.o_proj), projection(l.mlp.down_proj))  # per layer: (o(a), down(h))
                    for l in model.model.layers]
        self.lm_head = projection(model.lm_head)
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers if fuse else []):
                att, mlp = layer.self_attn, layer.mlp
                self.out[i] = (module_linear(att.o_proj), module_linear(mlp.down_proj))
                if hasattr(att, "qkv_proj") and hasattr(mlp, "gate_up_proj"):
                    self.fused[i] = (module_linear(att.qkv_proj), module_linear(mlp.gate_up_proj))
                    continue
                qkv = [att.q_proj, att.k_proj, att.v_proj]
                w_qkv = torch.cat([l.weight for l in qkv])
                b_qkv = torch.cat([l.bias for l in qkv]) if att.q_proj.bias is not None else None
                w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                b_gu = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]) if mlp.gate_proj.bias is not None else None
                self.fused[i] = (packed_linear(w_qkv, b_qkv), packed_linear(w_gu, b_gu))
            if fuse:
                self.lm_head = module_linear(model.lm_head)
            elif family.fused:  # no q/k/v modules to fall back on: the model's own fused ones, uncopied
                self.fused = [(projection(l.self_attn.qkv_proj), projection(l.mlp.gate_up_proj))
                              for l in model.model.layers]
            # Partial rotary (Phi-3's partial_rotary_factor): RoPE on the first `rot_dim` dims of each head.
            self.rot_dim = model.model.rotary_emb(p[:1, None], torch.zeros(1, 1, dtype=torch.long,
                                                                           device=self.device))[0].shape[-1]
        ext = small_gemm() if fuse and self.device.type == "cpu" and self.cache_dtype == torch.float32 else None
        self.attend = ext.attend if ext is not None and self.head_dim % 16 == 0 and self.head_dim <= 256 else None
        # Every forward of <= MAX_ROWS tokens rounds each row as a one-token step would (kernel matmuls
        # for every projection and the LM head, kernel attention): greedy speculative output then equals
        # plain output bit for bit in bf16 too, when a round verifies at most MAX_ROWS tokens.
        self.row_invariant = self.attend is not None and all(
            pair is not None and all(f.row_invariant for f in pair) for pair in self.fused + self.out) \
            and self.lm_head.row_invariant
        self.q_dim = self.n_heads * self.head_dim
        self.kv_dim = self.n_kv * self.head_dim
        # The layer's elementwise steps fused (eval/kernels.py: residual add + RMSNorm, RoPE, SiLU * up),
        # for bf16 with our own fused projections: ~20 ATen ops per layer become 4.
        norms = [n for l in model.model.layers for n in (l.input_layernorm, l.post_attention_layernorm)] + [model.model.norm]
        # Not for a table row's extra steps (q/k norms, partial rotary, per-layer sliding-window masks):
        # those run _forward, with the same matmul and attention kernels.
        plain = not self.qk_norm and self.rot_dim == self.head_dim and self.windows is None
        self.ew = ext if ext is not None and plain and self.dtype == torch.bfloat16 and all(f is not None for f in self.fused) \
            and cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0 \
            and all(hasattr(n, "variance_epsilon") and n.weight.dtype == torch.bfloat16 for n in norms) else None
        if self.ew is not None:
            # per layer: (input norm's weight, eps), (post-attention norm's), then the final norm's
            self.norm_w = [(n.weight.detach(), float(n.variance_epsilon)) for n in norms]
        # ext.layer's arguments per layer ([packed, bias] x 4, out widths), where every projection is the kernel's
        self.layers = None
        kernels = [[f.kernel for f in (fused[0], out[0], fused[1], out[1])]  # qkv, o, gate|up, down
                   for fused, out in zip(self.fused, self.out)] if self.ew is not None else []
        if kernels and all(k is not None for ks in kernels for k in ks):
            self.layers = [([t for kp, kb, _ in ks for t in (kp, kb)], [n for _, _, n in ks]) for ks in kernels]

    def reset(self, batch: int, max_len: int) -> None:
        # Reuse the allocation when the shape fits; stale slots are never attended (mask: slot <= pos).
        # One tensor per K and V for all layers ([L, B, nkv, S_max, hd]; each layer's cache is a slice),
        # so move() is two ops, not two per layer (a pair per layer cost a visible part of a tree round).
        K = self.K
        if K is not None and K.shape[1] == batch and K.shape[3] >= max_len:
            return
        L = len(self.model.model.layers)
        self.K = torch.zeros(L, batch, self.n_kv, max_len, self.head_dim, dtype=self.cache_dtype, device=self.device)
        self.V = torch.zeros_like(self.K)
        self.caches = [KVCache.over(k, v) for k, v in zip(self.K, self.V)]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from cache slots src [B, P] to slots dst [B, P] (all reads before
        any write): after a tree round, the accepted path's nodes move to consecutive positions."""
        for t in (self.K, self.V):  # [L, B, nkv, S_max, hd]
            if t.shape[1] == 1:  # one row: index_select/index_copy_, cheaper than the gather/scatter
                t0 = t[:, 0]  # [L, nkv, S_max, hd]
                t0.index_copy_(2, dst[0], t0.index_select(2, src[0]))
                continue
            idx_s = src[None, :, None, :, None].expand(t.shape[0], -1, t.shape[2], -1, t.shape[4])  # [L, B, nkv, P, hd]
            t.scatter_(3, dst[None, :, None, :, None].expand_as(idx_s), t.gather(3, idx_s))

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, s_len: int,
                 logit_idx: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None):
        with cpu_gemv(tokens.numel(), self.device):
            return self._forward(tokens, pos, s_len, logit_idx, slots, mask)

    def _forward(self, tokens, pos, s_len, logit_idx, slots, mask):
        m = self.model.model
        B, T = tokens.shape
        x = m.embed_tokens(tokens)  # [B, T, H]
        cos, sin = m.rotary_emb(x, pos)  # [B, T, hd]
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)  # rotate_half's sign, folded in once
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, hd]
        nqk = self.n_heads + self.n_kv
        slots = pos if slots is None else slots  # [B, T] cache slots written (a chain: its positions)
        # Query at position p sees slots 0..p of its own row; no mask when B == 1, T == 1 and every
        # attended slot is valid (s_len == pos + 1), which lets SDPA take its fast path. A tree round
        # passes its own mask (committed slots + the node's ancestors).
        if mask is None and (T > 1 or B > 1 or self.windows is not None):
            mask = causal_mask(pos, s_len)  # [B, 1, T, S]
        # This project's attention kernel (eval/kernels.py) on CPU, where it builds: each row attends
        # over its visible slots in slot order with fixed-order sums, so a verify or tree forward gives
        # every row the numbers of a one-token step at its position (with the row-invariant matmuls:
        # bf16 speculative decoding equals bf16 plain decoding). SDPA elsewhere.
        vis = None
        if self.attend is not None and T <= MAX_ROWS:
            vis = (mask[:, 0] if mask is not None else torch.ones(B, T, s_len, dtype=torch.bool)).contiguous()  # [B, T, S]
        if self.ew is not None:
            return self._forward_fused(x, cos, sin, slots, mask, vis, s_len, logit_idx)
        # Sliding-window layers (LEAN_FAMILIES' windows): one mask (and kernel `vis`) per distinct window.
        wm = None
        if self.windows is not None:
            wm = window_masks(mask, pos, slots, self.windows)
            wm = {w: (mk, mk[:, 0].contiguous() if vis is not None else None) for w, mk in wm.items()}
        aux = self.aux_layers
        taps = {}  # layer id -> the residual stream entering it [B, T, H]
        for i, (layer, cache, fused, (o_proj, down_proj)) in enumerate(zip(m.layers, self.caches, self.fused,
                                                                           self.out)):
            if aux is not None and i in aux:
                taps[i] = x
            att, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm(x)
            if fused is not None:
                qk, v = fused[0](h).split([self.q_dim + self.kv_dim, self.kv_dim], -1)
            else:
                qk, v = torch.cat([att.q_proj(h), att.k_proj(h)], -1), att.v_proj(h)
            qk = qk.view(B, T, nqk, self.head_dim)  # [B, T, nh + nkv, hd]
            if self.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
                qk = torch.cat([att.q_norm(qk[:, :, :self.n_heads]), att.k_norm(qk[:, :, self.n_heads:])], 2)
            # RoPE on q and k together: one rotation per layer instead of two.
            if self.rot_dim == self.head_dim:
                qk = qk * cos + _swap_halves(qk) * sin
            else:  # partial rotary: the dims past rot_dim pass through
                r = qk[..., :self.rot_dim]
                qk = torch.cat([r * cos + _swap_halves(r) * sin, qk[..., self.rot_dim:]], -1)
            if wm is not None:
                mask, vis = wm[self.windows[i]]
            q = qk[:, :, :self.n_heads].transpose(1, 2)  # [B, nh, T, hd]
            k = qk[:, :, self.n_heads:].transpose(1, 2)  # [B, nkv, T, hd]
            v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            x = x + o_proj(self._attention(cache, slots, q, k, v, vis, mask, s_len, x.dtype))
            h = layer.post_attention_layernorm(x)
            if fused is not None:
                gate, up = fused[1](h).chunk(2, -1)
            else:
                gate, up = mlp.gate_proj(h), mlp.up_proj(h)
            x = x + down_proj(F.silu(gate) * up)
        return self._head(m.norm(x), logit_idx, taps)  # feats [B, T, H]: after the final norm

    def _attention(self, cache, slots, q, k, v, vis, mask, s_len, dtype):
        """One layer's attention: write k, v [B, nkv, T, hd] at `slots`, attend with q [B, nh, T, hd]
        (the kernel where `vis` [B, T, S] is given, SDPA under `mask` otherwise) -> [B, T, nh * hd] in
        `dtype`, the input of o_proj."""
        B, _, T, _ = q.shape
        ck, cv = cache.write(slots, k, v)  # [B, nkv, S_max, hd], in cache_dtype
        if vis is not None:
            a = self.attend(q.to(ck.dtype).contiguous(), ck, cv, vis, self.scale)  # [B, nh, T, hd]
        else:
            a = F.scaled_dot_product_attention(q.to(ck.dtype), ck[:, :, :s_len], cv[:, :, :s_len], attn_mask=mask,
                                               scale=self.scale, enable_gqa=self.n_heads != self.n_kv)
        return a.to(dtype).transpose(1, 2).reshape(B, T, -1)

    def _head(self, feats, logit_idx, taps=None):
        """feats [B, T, H] -> (logits [B, T, V], or [B, 1, V] at column logit_idx [B] of each row; the
        features: feats, or with aux_layers set the tapped residual streams `taps` concatenated [B, T, n*H])."""
        out = feats if self.aux_layers is None else torch.cat([taps[i] for i in self.aux_layers], -1)
        if logit_idx is not None:
            feats_sel = feats[torch.arange(feats.shape[0], device=feats.device), logit_idx][:, None]  # [B, 1, H]
            return self.lm_head(feats_sel), out
        return self.lm_head(feats), out

    def _forward_fused(self, x, cos, sin, slots, mask, vis, s_len, logit_idx):
        """_forward's layers with the elementwise kernels (self.ew): the same roundings (eval/csrc), so
        the same numbers up to RMSNorm's summation order and SiLU's exp. x [B, T, H] bf16 (the
        embeddings, a fresh tensor: it becomes the residual stream, updated in place), cos/sin [B, T, hd]
        (sin signed)."""
        ew, nw = self.ew, self.norm_w
        B, T, _ = x.shape
        nqk = self.n_heads + self.n_kv
        cos, sin = cos.contiguous(), sin.contiguous()
        x = x.contiguous()
        h = ew.add_rmsnorm(x, None, *nw[0])  # [B, T, H]
        # Up to MAX_ROWS tokens (every decode step and verify), attention straight from the projections:
        # one kernel call writes k/v into the cache and attends, bf16 in and out (`attend_qkv`), where
        # the cache write, the casts and the transposes were ~12 ATen ops a layer.
        direct = vis is not None
        slots = slots.contiguous() if direct else slots
        aux = self.aux_layers
        taps = {}  # layer id -> a copy of the residual stream entering it (x is updated in place)
        if direct and self.layers is not None and B * T <= MAX_ROWS:
            # Each layer in one call (ext.layer: the same kernels in the same order), without the Python
            # time the loop below spends between them.
            for i, (cache, (w, n_out)) in enumerate(zip(self.caches, self.layers)):
                if aux is not None and i in aux:
                    taps[i] = x.clone()
                h = ew.layer(x, h, w, n_out, cos, sin, cache.k, cache.v, slots, vis, self.n_heads, self.scale,
                             *nw[2 * i + 1], *nw[2 * i + 2])
            return self._head(h, logit_idx, taps)
        for i, (cache, fused, (o_proj, down_proj)) in enumerate(zip(self.caches, self.fused, self.out)):
            if aux is not None and i in aux:
                taps[i] = x.clone()
            qkv = fused[0](h)  # [B, T, q + k + v]
            qk = ew.rope(qkv, nqk, cos, sin).view(B, T, nqk * self.head_dim)  # [B, T, (nh + nkv) hd]
            if direct:
                a = ew.attend_qkv(qk, qkv, self.q_dim + self.kv_dim, cache.k, cache.v, slots, vis, self.n_heads,
                                  self.scale)  # [B, T, nh hd]
            else:
                qk = qk.view(B, T, nqk, self.head_dim)
                q = qk[:, :, :self.n_heads].transpose(1, 2)  # [B, nh, T, hd]
                k = qk[:, :, self.n_heads:].transpose(1, 2)  # [B, nkv, T, hd]
                v = qkv[..., self.q_dim + self.kv_dim:].view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
                a = self._attention(cache, slots, q, k, v, vis, mask, s_len, x.dtype)
            h = ew.add_rmsnorm(x, o_proj(a), *nw[2 * i + 1])
            h = ew.add_rmsnorm(x, down_proj(ew.silu_mul(fused[1](h))), *nw[2 * i + 2])  # the next norm; the last: final
        return self._head(h, logit_idx, taps)  # h: after the final norm


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
        for layer in self.cache.layers:
            for t in (layer.keys, layer.values):  # [B, nkv, S_max, hd]
                idx_s = src[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])  # [B, nkv, P, hd]
                t.scatter_(2, dst[:, None, :, None].expand_as(idx_s), t.gather(2, idx_s))

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


def aux_hidden_states(model, ids: torch.Tensor, attention_mask: torch.Tensor | None, layers) -> torch.Tensor:
    """The residual streams entering `layers` of an HF causal LM (hidden_states[i]) for ids [B, L],
    concatenated [B, L, n*H]: the features an EAGLE-3 head trains on (the runners' aux_layers at serving)."""
    out = model.model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1)


def aux_bytes_per_token(model, n_layers: int = 3) -> int:
    """What `n_layers` aux features of one token cost in the model's dtype: n_layers * H * the dtype's size
    (SmolLM2-135M, bf16: 3 * 576 * 2 = 3456 bytes)."""
    p = model.get_input_embeddings().weight
    return n_layers * model.config.hidden_size * p.element_size()


def make_runner(model, lean: bool = True, fuse: bool | None = None):
    """The lean forward where the architecture allows it, else the HF fallback. fuse=None: fuse the
    projections unless the model says not to (`lean_fuse = False`: its weights are shared with the
    target, so fused copies would duplicate them)."""
    if lean and lean_supported(model):
        return LeanLlama(model, getattr(model, "lean_fuse", True) if fuse is None else fuse)
    return HFFallback(model)
