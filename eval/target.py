"""A lean forward for a causal LM with a preallocated, position-indexed KV cache.

The speculative decoder needs three things from the target's forward that HF's cache classes do
not give directly: (1) every row of a ragged batch writes keys/values at its *own* absolute
positions, (2) a rejected draft's slot is simply overwritten by the next round (no cropping), and
(3) it returns both logits and the features (final hidden state after the final norm, the input of
the LM head) that EAGLE heads read.

`LeanLlama` reads the HF module's own weights for Llama-family decoders (Llama, Mistral
without sliding window, Qwen2: q/k/v/o + SwiGLU MLP + RMSNorm + the model's own rotary module).
Anything else goes through `HFFallback`: the HF forward with a DynamicCache cropped after each round
(batch 1 only; ragged batches need per-row positions that DynamicCache does not have).

Both expose the same interface:
    runner.reset(batch, max_len)                       # allocate/zero the cache
    logits, feats = runner(tokens [B,T], pos [B,T], s_len, logit_idx=None)
s_len (host int) is the number of cache slots attended (max position written + 1); `logit_idx`
[B] picks one position per row for the LM head (prefill), else logits for all T positions.
With `runner.aux_layers = (i, j, ...)` set (an EAGLE-3 draft's layers), the features returned are
instead the residual streams entering those layers, concatenated [B, T, n*H] (vLLM's layer ids, HF's
hidden_states[i]); None (the default) keeps the final-norm features.

`LeanLlama` also verifies token trees (eval.tree): `runner(tokens, pos, s_len, slots=, mask=)` writes
K/V at cache `slots` [B,T] (tree nodes sharing a position need their own slots) under an explicit
attention `mask` [B,1,T,S], and `runner.move(src, dst)` copies the accepted path's K/V into place.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from .layers import KVCache
from .kernels import MAX_ROWS, small_gemm


@functools.cache
def cache_kwarg(fn) -> str:
    """The keyword `fn` (a model class's forward, create_causal_mask) takes its KV cache by:
    transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40);
    earlier 5.x know only the old one. Cached per function: callers are in the decoding loop."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _is_llama_like(model) -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return False
    cfg = model.config
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    l0 = layers[0]
    att, mlp = getattr(l0, "self_attn", None), getattr(l0, "mlp", None)
    need_att = all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    need_mlp = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
    act = getattr(cfg, "hidden_act", "silu")
    return need_att and need_mlp and not hasattr(att, "q_norm") and act == "silu" \
        and hasattr(l0, "input_layernorm") and hasattr(l0, "post_attention_layernorm")


def lean_supported(model) -> bool:
    """Whether `make_runner` gives `model` the lean forward (ragged batches, trees) rather than the
    batch-1 HF fallback."""
    return _is_llama_like(model)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] on the last dim. HF's rotate_half is [-x2, x1]; the sign lives in `sin`
    (see LeanLlama.__call__), which saves a negation per tensor per layer."""
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)


# Matmuls on CPU, where a decode step is weight-bandwidth bound and so this is most of a token's time.
# PyTorch's default bf16 matmul (oneDNN) re-lays the weights out on every call. Two faster routes give
# the same numbers: the native GEMV (fp32 accumulation) at one or two rows, which slows down sharply
# with more, and oneDNN with the weights packed once (`_reorder_linear_weight`) for verify and prefill
# forwards. This project's kernel (eval/kernels.py) beats both at 1-16 rows, so where it builds it
# takes every forward of <= 16 rows. Bandwidths and timings: docs/reference/kernels.md.
GEMV_MAX_ROWS = 2
PACK_HINT_ROWS = 16  # the row count oneDNN picks its packed layout for (docs/reference/kernels.md)


@contextmanager
def cpu_gemv(rows: int, device: torch.device):
    """For this block, send unpacked matmuls of at most GEMV_MAX_ROWS rows on CPU to the native GEMV
    (oneDNN off), and larger ones to oneDNN (on); the previous setting is restored on exit, so blocks
    nest (a draft LM's multi-token resync inside a one-row propose). torch.backends.mkldnn.flags()
    does the same but re-sets unrelated flags at many times the cost, so the raw switch is used."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        yield
        return
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(rows > GEMV_MAX_ROWS)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] the index of the first maximum, like argmax(-1). CPU bf16 logits go to
    this project's kernel (eval/kernels.py `argmax_rows`, the same indices), where ATen's argmax and
    max over a large vocabulary are slow (docs/reference/kernels.md); max(-1) elsewhere. Both return
    the first maximal index on ties."""
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.numel():
        ext = small_gemm()
        if ext is not None and hasattr(ext, "argmax_rows"):
            return ext.argmax_rows(logits.contiguous())
    return logits.max(-1).indices


def can_pack(weight: torch.Tensor) -> bool:
    """Whether packed_linear packs `weight` for oneDNN (CPU bf16, where this PyTorch build can)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., in] -> [..., out]: F.linear, with copies of the weight packed on CPU bf16 (see the note
    above): up to kernels.MAX_ROWS rows go to this project's kernel (eval/kernels.py) where it builds,
    else one or two rows to the native GEMV on the plain weight; more rows to oneDNN's packed copy.
    Like the fused copies, packed weights are taken now; rebuild the runner if the weights change."""
    if not can_pack(weight):
        return partial(F.linear, weight=weight, bias=bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS)
    ext = small_gemm() if weight.shape[1] % 2 == 0 else None
    if ext is not None:
        n_out, kpacked, kbias = weight.shape[0], ext.pack(weight), _NONE
        if bias is not None:
            kbias = torch.zeros(kpacked.shape[0] * 16)  # fp32, padded like the packed rows
            kbias[:n_out] = bias.float()

    def f(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]  # host ints only, here and below
        if ext is not None and rows <= MAX_ROWS:
            y = ext.linear(x.reshape(rows, -1).contiguous(), kpacked, kbias, n_out)
            return y.view(*x.shape[:-1], n_out)
        # The native GEMV where cpu_gemv turned oneDNN off for a forward of few rows; else (more rows,
        # or a prefill's one-row LM head inside a many-row forward) the packed weight.
        if rows <= GEMV_MAX_ROWS and not torch._C._get_mkldnn_enabled():
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
    f.row_invariant = ext is not None  # up to MAX_ROWS rows: a row's sums do not depend on the others
    f.kernel = (kpacked, kbias, n_out) if ext is not None else None  # for ext.layer (LeanLlama._forward_fused)
    return f


_NONE = torch.empty(0)


def _module_linear(mod):
    """A projection module as a callable: packed when it is a plain nn.Linear, else the module itself
    (e.g. eval.drafts' int8 or truncated-vocabulary layers)."""
    if type(mod) is torch.nn.Linear:
        return packed_linear(mod.weight, mod.bias)
    return mod


class LeanLlama:
    """Llama-family forward over the HF module's own weights, writing K/V at absolute positions.

    fuse=True (the default) runs q|k|v and gate|up as one matmul each: the model's own fused modules
    where it has them (`qkv_proj`, `gate_up_proj`), else concatenated copies of the weights.
    fuse=False calls the model's own q/k/v/gate/up modules: no copy, for drafts that share their
    layers with the target (eval.drafts.SelfSpecDraft); five projection calls per layer instead of two."""

    trees = True  # slots/mask/move(): a token tree's nodes verified in one forward
    aux_layers: tuple[int, ...] | None = None  # features = the residual streams entering these layers

    def __init__(self, model, fuse: bool = True):
        if not _is_llama_like(model):
            raise TypeError(f"{type(model).__name__} is not a Llama-family decoder")
        self.model = model
        cfg = model.config
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
        self.out = [(l.self_attn.o_proj, l.mlp.down_proj) for l in model.model.layers]  # per layer: (o(a), down(h))
        self.lm_head = model.lm_head
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers if fuse else []):
                att, mlp = layer.self_attn, layer.mlp
                self.out[i] = (_module_linear(att.o_proj), _module_linear(mlp.down_proj))
                if hasattr(att, "qkv_proj") and hasattr(mlp, "gate_up_proj"):
                    self.fused[i] = (att.qkv_proj, mlp.gate_up_proj)
                    continue
                qkv = [att.q_proj, att.k_proj, att.v_proj]
                w_qkv = torch.cat([l.weight for l in qkv])
                b_qkv = torch.cat([l.bias for l in qkv]) if att.q_proj.bias is not None else None
                w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                b_gu = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]) if mlp.gate_proj.bias is not None else None
                self.fused[i] = (packed_linear(w_qkv, b_qkv), packed_linear(w_gu, b_gu))
            if fuse:
                self.lm_head = _module_linear(model.lm_head)
        ext = small_gemm() if fuse and self.device.type == "cpu" and self.cache_dtype == torch.float32 else None
        self.attend = ext.attend if ext is not None and self.head_dim % 16 == 0 and self.head_dim <= 256 else None
        # Every forward of <= MAX_ROWS tokens rounds each row as a one-token step would (kernel matmuls
        # for every projection and the LM head, kernel attention): greedy speculative output then equals
        # plain output bit for bit in bf16 too, when a round verifies at most MAX_ROWS tokens.
        self.row_invariant = self.attend is not None and all(
            getattr(f, "row_invariant", False) for pair in self.fused + self.out for f in pair) \
            and getattr(self.lm_head, "row_invariant", False)
        self.q_dim = self.n_heads * self.head_dim
        self.kv_dim = self.n_kv * self.head_dim
        # The layer's elementwise steps fused (eval/kernels.py: residual add + RMSNorm, RoPE, SiLU * up),
        # for bf16 with our own fused projections: ~20 ATen ops per layer become 4.
        norms = [n for l in model.model.layers for n in (l.input_layernorm, l.post_attention_layernorm)] + [model.model.norm]
        self.ew = ext if ext is not None and self.dtype == torch.bfloat16 and all(f is not None for f in self.fused) \
            and hasattr(ext, "add_rmsnorm") and cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0 \
            and all(hasattr(n, "variance_epsilon") and n.weight.dtype == torch.bfloat16 for n in norms) else None
        if self.ew is not None:
            # per layer: (input norm's weight, eps), (post-attention norm's), then the final norm's
            self.norm_w = [(n.weight.detach(), float(n.variance_epsilon)) for n in norms]
        # ext.layer's arguments per layer ([packed, bias] x 4, out widths), where every projection is the kernel's
        self.layers = None
        kernels = [[getattr(f, "kernel", None) for f in (fused[0], out[0], fused[1], out[1])]  # qkv, o, gate|up, down
                   for fused, out in zip(self.fused, self.out)] \
            if self.ew is not None and hasattr(self.ew, "layer") else []
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
        if mask is None and (T > 1 or B > 1):
            cols = torch.arange(s_len, device=x.device)
            mask = (cols[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
        # This project's attention kernel (eval/kernels.py) on CPU, where it builds: each row attends
        # over its visible slots in slot order with fixed-order sums, so a verify or tree forward gives
        # every row the numbers of a one-token step at its position (with the row-invariant matmuls:
        # bf16 speculative decoding equals bf16 plain decoding). SDPA elsewhere.
        vis = None
        if self.attend is not None and T <= MAX_ROWS:
            vis = (mask[:, 0] if mask is not None else torch.ones(B, T, s_len, dtype=torch.bool)).contiguous()  # [B, T, S]
        if self.ew is not None:
            return self._forward_fused(x, cos, sin, slots, mask, vis, s_len, logit_idx)
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
            # RoPE on q and k together: one rotation per layer instead of two.
            qk = qk.view(B, T, nqk, self.head_dim)  # [B, T, nh + nkv, hd]
            qk = qk * cos + _swap_halves(qk) * sin
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
        direct = vis is not None and hasattr(ew, "attend_qkv")
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


class HFFallback:
    """Any HF causal LM with a `.model` body and an LM head, batch 1: DynamicCache cropped to the
    position being written before each forward."""

    trees = False  # no slots/mask/move(): chains only
    row_invariant = False  # ATen's matmuls: a row's numbers may depend on the others in the forward
    aux_layers: tuple[int, ...] | None = None  # features = hidden_states[i] for these layers, concatenated

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model
        self._cache_cls = DynamicCache
        self.cache = None
        p = model.get_output_embeddings().weight
        self.dtype, self.device = p.dtype, p.device

    def reset(self, batch: int, max_len: int) -> None:
        if batch != 1:
            raise NotImplementedError(
                f"{type(self.model).__name__}: ragged batches need the lean Llama-family forward; use batch 1")
        self.cache = self._cache_cls(config=self.model.config)

    def __call__(self, tokens, pos, s_len, logit_idx=None):
        with cpu_gemv(tokens.numel(), self.device):
            return self._forward(tokens, pos, s_len, logit_idx)

    def _forward(self, tokens, pos, s_len, logit_idx):
        start = int(pos[0, 0])  # host sync; the fallback is the slow path anyway
        extra = self.cache.get_seq_length() - start
        if extra > 0:
            self.cache.crop(-extra)  # drop rejected drafts' slots (transformers 5: negative = tokens to remove)
        body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        aux = self.aux_layers
        kw = {cache_kwarg(type(body).forward): self.cache} | ({"output_hidden_states": True} if aux is not None else {})
        out = body(input_ids=tokens, position_ids=pos, use_cache=True, **kw)
        feats = out.last_hidden_state
        ret = feats if aux is None else torch.cat([out.hidden_states[i] for i in aux], -1)  # [B, T, n*H]
        head = self.model.get_output_embeddings()
        if logit_idx is not None:
            return head(feats[torch.arange(tokens.shape[0]), logit_idx][:, None]), ret
        return head(feats), ret


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
    if lean and _is_llama_like(model):
        return LeanLlama(model, getattr(model, "lean_fuse", True) if fuse is None else fuse)
    return HFFallback(model)
