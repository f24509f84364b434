"""The target's forward for the speculative decoder, with a preallocated, position-indexed KV cache.

The speculative decoder needs three things from the target's forward that HF's cache classes do
not give directly: (1) every row of a ragged batch writes keys/values at its *own* absolute
positions, (2) a rejected draft's slot is simply overwritten by the next round (no cropping), and
(3) it returns both logits and the features (final hidden state after the final norm, the input of
the LM head) that EAGLE heads read.

Two runners (`make_runner` picks; `eval.family.runner_path(model)` names the pick,
docs/reference/architectures.md): `LeanLlama`, here, reads the HF module's own weights for the families of
`eval.family.LEAN_FAMILIES` (Llama, Mistral, Qwen2, Qwen3, Phi-3: q/k/v/o + SwiGLU MLP + RMSNorm + the
model's own rotary module, plus each row's extras) and runs this project's CPU kernels (eval/cpu.py).
`HFFallback` (eval/hf_forward.py, the HF path) runs any other HF causal LM's own forward over a cache of
ours with masks we build (eval/masks.py).

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

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .cpu import cpu_gemv, module_linear, packed_linear, projection, small_gemm
from .family import LEAN_FAMILIES, layer_windows, lean_family, lean_supported
from .hf_forward import HFFallback
from .kernels import MAX_ROWS
from .layers import KVCache
from .masks import causal_mask, window_masks


def _fewest(limits: list) -> int | None:
    """The smallest of some row limits, None standing for no limit (so: None when all are None)."""
    known = [n for n in limits if n is not None]
    return min(known) if known else None


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
    row_groups = True  # rows() and keep(): forwards over some of the batch's rows (grouped prefill, finished rows dropped)
    aux_layers: tuple[int, ...] | None = None  # features = the residual streams entering these layers

    def __init__(self, model, fuse: bool = True):
        family = lean_family(model)
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
        # On CPU the attention is float32: PyTorch's CPU attention kernel is several times slower in bf16
        # than in fp32 at decode shapes, a cost that grows with the context (docs/reference/kernels.md). The
        # projections stay in the model's dtype; q/k/v are rounded to it exactly as before and only widened
        # for the attention. The cache is float32 too, except under this project's kernel (below). CUDA
        # keeps the model's dtype.
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
        ext = small_gemm() if fuse and self.device.type == "cpu" else None
        self.attend = ext.attend if ext is not None and self.head_dim % 16 == 0 and self.head_dim <= 256 else None
        self.move_slots = ext.move_slots if ext is not None else None  # move()'s copy, where the kernels run
        # Where that kernel attends, a bf16 model's cache is kept in bf16: k and v are the bf16 projections'
        # values, which the kernel widens exactly, so attention sees the numbers of a float32 cache while a step
        # reads half the bytes (at batch 16 a float32 cache streamed half the weights' bytes again: kernels.md).
        kernel_bf16 = self.attend is not None and self.dtype == torch.bfloat16
        self.cache_dtype = torch.bfloat16 if kernel_bf16 else torch.float32 if self.device.type == "cpu" else self.dtype
        # Every forward of <= MAX_ROWS tokens rounds each row as a one-token step would (kernel matmuls
        # for every projection and the LM head, kernel attention): greedy speculative output then equals
        # plain output bit for bit in bf16 too, when a round verifies at most MAX_ROWS tokens.
        self.row_invariant = self.attend is not None and all(
            pair is not None and all(f.row_invariant for f in pair) for pair in self.fused + self.out) \
            and self.lm_head.row_invariant
        # ... for forwards of at most this many rows (batch x tokens) in all; None: any number
        layer_rows = [f.invariant_rows for pair in self.fused + self.out if pair is not None for f in pair]
        self.layer_rows = _fewest(layer_rows)  # the most rows ext.layer's matmuls take (_forward_fused)
        self.invariant_rows = _fewest(layer_rows + [self.lm_head.invariant_rows]) if self.row_invariant else 0
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
        self._between = None  # the two buffers ext.layer's outputs take turns in (_forward_fused)

    def reset(self, batch: int, max_len: int) -> None:
        # Reuse the allocation when the shape fits; stale slots are never attended (mask: slot <= pos).
        # One tensor per K and V for all layers ([L, B, nkv, S_max, hd]; each layer's cache is a slice),
        # so move() is two ops, not two per layer (a pair per layer cost a visible part of a tree round).
        K = self.K
        if K is not None and K.shape[1] == batch and K.shape[3] >= max_len and K.dtype == self.cache_dtype:
            return
        L = len(self.model.model.layers)
        self.K = torch.zeros(L, batch, self.n_kv, max_len, self.head_dim, dtype=self.cache_dtype, device=self.device)
        self.V = torch.zeros_like(self.K)
        self.caches = [KVCache.over(k, v) for k, v in zip(self.K, self.V)]

    @contextmanager
    def rows(self, idx: torch.Tensor, length: int):
        """Forwards inside write a cache of their own, len(idx) rows by `length` slots; on exit its slots
        0..length-1 go to rows idx of the batch's cache. The prefill runs in groups of prompts of like
        length this way, each padded to its own longest instead of the batch's."""
        K, caches = self.K, self.caches
        tk = torch.zeros(K.shape[0], len(idx), K.shape[2], length, K.shape[4], dtype=K.dtype, device=K.device)
        tv = torch.zeros_like(tk)  # [L, g, nkv, length, hd]
        self.caches = [KVCache.over(k, v) for k, v in zip(tk, tv)]
        try:
            yield
        finally:
            self.caches = caches
        self.K[:, :, :, :length].index_copy_(1, idx, tk)
        self.V[:, :, :, :length].index_copy_(1, idx, tv)

    def keep(self, idx: list[int], used: int) -> None:
        """Keep only the cache rows idx (ascending), moved in place to the front with their slots below
        `used` (the later ones are never attended): later forwards compute those len(idx) rows alone."""
        for i, b in enumerate(idx):  # ascending: a row is read before any later row lands on it
            if b != i:
                self.K[:, i, :, :used] = self.K[:, b, :, :used]
                self.V[:, i, :, :used] = self.V[:, b, :, :used]
        self.K, self.V = self.K[:, :len(idx)], self.V[:, :len(idx)]  # [L, g, nkv, S_max, hd] views
        self.caches = [KVCache.over(k, v) for k, v in zip(self.K, self.V)]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from cache slots src [B, P] to slots dst [B, P] (all reads before
        any write): after a tree round, the accepted path's nodes move to consecutive positions."""
        if self.move_slots is not None:
            return self.move_slots(self.K, self.V, src, dst)
        rows = torch.arange(src.shape[0], device=src.device)[:, None]  # [B, 1]
        for t in (self.K, self.V):  # [L, B, nkv, S_max, hd]
            if t.shape[1] == 1:  # one row: index_select/index_copy_, cheaper than indexing
                t0 = t[:, 0]  # [L, nkv, S_max, hd]
                t0.index_copy_(2, dst[0], t0.index_select(2, src[0]))
                continue
            t[:, rows, :, dst] = t[:, rows, :, src]  # index_put_, not gather/scatter_ (docs/reference/verify-cost.md)

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
        # passes its own mask (committed slots + the node's ancestors). A row left alone once the others
        # finished (the decoder's _drop_finished) is stepped with s_len past its position: slots that hold
        # another row's later tokens or stale K/V.
        if mask is None and (T > 1 or B > 1 or self.windows is not None or not _fills(pos, s_len)):
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
            a = self.attend(q.float().contiguous(), ck, cv, vis, self.scale)  # [B, nh, T, hd], fp32
        else:  # fp32 on CPU, whatever the cache holds (a bf16 cache widened: the same values)
            adt = torch.float32 if self.device.type == "cpu" else ck.dtype
            a = F.scaled_dot_product_attention(q.to(adt), ck[:, :, :s_len].to(adt), cv[:, :, :s_len].to(adt),
                                               attn_mask=mask, scale=self.scale, enable_gqa=self.n_heads != self.n_kv)
        return a.to(dtype).transpose(1, 2).reshape(B, T, -1)

    def _head(self, feats, logit_idx, taps=None):
        """feats [B, T, H] -> (logits [B, T, V], or [B, 1, V] at column logit_idx [B] of each row; the
        features: feats, or with aux_layers set the tapped residual streams `taps` concatenated [B, T, n*H])."""
        out = feats if self.aux_layers is None else torch.cat([taps[i] for i in self.aux_layers], -1)
        if logit_idx is not None:
            feats_sel = feats[torch.arange(feats.shape[0], device=feats.device), logit_idx][:, None]  # [B, 1, H]
            return self.lm_head(feats_sel), out
        return self.lm_head(feats), out

    def _between_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat bf16 buffers of at least n elements, kept across forwards (grown when one needs more)."""
        if self._between is None or self._between[0].numel() < n:
            self._between = tuple(torch.empty(n, dtype=torch.bfloat16, device=self.device) for _ in range(2))
        return self._between

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
        if direct and self.layers is not None and (self.layer_rows is None or B * T <= self.layer_rows):
            # Each layer in one call (ext.layer: the same kernels in the same order), without the Python
            # time the loop below spends between them.
            # Every layer's output but the last (returned as the features) in one of two buffers kept across
            # forwards: a tensor freed per layer slowed glibc's malloc in a fragmented heap (verify-cost.md).
            outs = [b[:x.numel()].view(x.shape) for b in self._between_buffers(x.numel())]
            last = len(self.layers) - 1
            for i, (cache, (w, n_out)) in enumerate(zip(self.caches, self.layers)):
                if aux is not None and i in aux:
                    taps[i] = x.clone()
                out = None if i == last else outs[i % 2]
                h = ew.layer(x, h, w, n_out, cos, sin, cache.k, cache.v, slots, vis, self.n_heads, self.scale,
                             *nw[2 * i + 1], *nw[2 * i + 2], out)
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


def _fills(pos: torch.Tensor, s_len: int) -> bool:
    """Whether one query at pos [1, 1] attends to exactly slots 0..pos (s_len == pos + 1). Read on the host where
    that is free (CPU); on a GPU it would sync, so there the answer is no and the mask is built."""
    return pos.device.type == "cpu" and int(pos[0, 0]) + 1 == s_len


def make_runner(model, lean: bool = True, fuse: bool = True):
    """The lean forward where the architecture allows it, else the HF fallback. fuse=False for a model whose
    layers are the target's (eval.drafts.SelfSpecDraft): fused copies would duplicate their weights."""
    if lean and lean_supported(model):
        return LeanLlama(model, fuse)
    return HFFallback(model)
