"""What draftsmith reads from a target of any HF causal-LM family, through transformers' generic
accessors rather than one family's module names (Llama's `model.layers`, GPT-2's `transformer.h`,
GPT-NeoX's `gpt_neox.layers`): the decoder body, its layer list and final norm, the text config's
shape, and the features the heads train on (final-norm `last_hidden_state`, `hidden_states[i]`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn


def text_config(model):
    """The config of the language model (a multimodal config's text part; the config itself otherwise)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def decoder(model) -> nn.Module:
    """The decoder body without the LM head (LlamaModel, GPT2Model, GPTNeoXModel, ...)."""
    return model.get_decoder()


def describe(model) -> str:
    """'gpt2 (GPT2LMHeadModel)': the family and class, for messages."""
    return f"{text_config(model).model_type} ({type(model).__name__})"


def layer_list(model) -> tuple[str, nn.ModuleList]:
    """(state-dict prefix, the decoder's ModuleList of layers): ("model.layers", ...) for Llama,
    ("transformer.h", ...) for GPT-2, ("gpt_neox.layers", ...) for GPT-NeoX. The one ModuleList of
    the decoder as long as the config's layer count."""
    body, n = decoder(model), text_config(model).num_hidden_layers
    body_name = next(name for name, m in model.named_modules() if m is body)
    found = [(name, m) for name, m in body.named_children() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(found) != 1:
        raise ValueError(f"{describe(model)}: cannot tell its layer list ({len(found)} candidates of {n} layers)")
    name, layers = found[0]
    return (f"{body_name}.{name}" if body_name else name), layers


def final_norm(model) -> nn.Module | None:
    """The decoder's final norm: its last direct child whose class is a norm (Llama's `norm`, GPT-2's
    `ln_f`, GPT-NeoX's `final_layer_norm`); None when there is none."""
    norms = [m for _, m in decoder(model).named_children() if type(m).__name__.endswith("Norm")]
    return norms[-1] if norms else None


def rms_norm_gain(model) -> tuple[torch.Tensor | None, str]:
    """(g [H] fp32, "") where the target's final norm computes x / rms(x) * g (Llama's RMSNorm, and
    Gemma's, whose weight w stands for g = 1 + w), else (None, why)."""
    norm = final_norm(model)
    if norm is None:
        return None, f"{describe(model)} has no final norm module"
    g = norm_gain(norm, text_config(model).hidden_size)
    if g is None:
        return None, f"the final norm of {describe(model)} is a {type(norm).__name__}, not an RMSNorm"
    return g, ""


@torch.no_grad()
def norm_gain(norm: nn.Module, width: int) -> torch.Tensor | None:
    """g [width] fp32 where `norm` computes x / rms(x) * g, else None. Read off the module by probing it: ones
    give g (up to the eps), and a random vector checks the RMSNorm form (a LayerNorm centres and adds a bias)."""
    p = next(norm.parameters(), None)
    dev, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
    g = norm(torch.ones(1, width, device=dev, dtype=dtype)).float()[0]  # [width]
    x = torch.randn(1, width, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
    want = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)) * g
    if not torch.allclose(norm(x).float(), want, rtol=2e-2, atol=2e-2 * float(g.abs().max()) + 1e-6):
        return None
    return g.cpu()


def final_features(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, L] -> [B, L, H]: the decoder's last_hidden_state (after the final norm, the input of the LM
    head): what EAGLE and Medusa heads read, on every family."""
    return decoder(model)(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def aux_hidden_states(model, ids: torch.Tensor, attention_mask: torch.Tensor | None, layers) -> torch.Tensor:
    """The residual streams entering `layers` (hidden_states[i]) for ids [B, L], concatenated
    [B, L, n*H]: the features an EAGLE-3 head trains on, on every family."""
    out = decoder(model)(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i] for i in layers], -1)


def aux_bytes_per_token(model, n_layers: int = 3) -> int:
    """What `n_layers` aux features of one token cost in the model's dtype: n_layers * H * the dtype's size
    (SmolLM2-135M, bf16: 3 * 576 * 2 = 3456 bytes)."""
    p = model.get_input_embeddings().weight
    return n_layers * model.config.hidden_size * p.element_size()


# ------------------------------------------------------------------------------- the lean forward's families

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


def lean_family(model) -> LeanFamily | None:
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
    return lean_family(model) is not None


def runner_path(model) -> str:
    """"lean" or "hf": the forward `make_runner(model)` runs (docs/reference/architectures.md)."""
    return "lean" if lean_supported(model) else "hf"


@functools.cache
def cache_kwarg(fn) -> str:
    """The keyword `fn` (a model class's forward, create_causal_mask) takes its KV cache by:
    transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40);
    earlier 5.x know only the old one. Cached per function: callers are in the decoding loop."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
