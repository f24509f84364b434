"""What draftsmith reads from a target of any HF causal-LM family, through transformers' generic
accessors rather than one family's module names (Llama's `model.layers`, GPT-2's `transformer.h`,
GPT-NeoX's `gpt_neox.layers`): the decoder body, its layer list and final norm, the text config's
shape, and the features the heads train on (final-norm `last_hidden_state`, `hidden_states[i]`).
"""

from __future__ import annotations

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


@torch.no_grad()
def rms_norm_gain(model) -> tuple[torch.Tensor | None, str]:
    """(g [H] fp32, "") where the target's final norm computes x / rms(x) * g (Llama's RMSNorm, and
    Gemma's, whose weight w stands for g = 1 + w), else (None, why). Read off the module by probing it:
    ones give g (up to the eps), and a random vector checks the RMSNorm form (a LayerNorm centres and adds a bias)."""
    norm = final_norm(model)
    if norm is None:
        return None, f"{describe(model)} has no final norm module"
    H = text_config(model).hidden_size
    p = next(norm.parameters(), None)
    dev, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
    g = norm(torch.ones(1, H, device=dev, dtype=dtype)).float()[0]  # [H]
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
    want = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)) * g
    if not torch.allclose(norm(x).float(), want, rtol=2e-2, atol=2e-2 * float(g.abs().max()) + 1e-6):
        return None, f"the final norm of {describe(model)} is a {type(norm).__name__}, not an RMSNorm"
    return g.cpu(), ""


def final_features(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, L] -> [B, L, H]: the decoder's last_hidden_state (after the final norm, the input of the LM
    head): what EAGLE and Medusa heads read, on every family."""
    return decoder(model)(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def aux_hidden_states(model, ids: torch.Tensor, attention_mask: torch.Tensor | None, layers) -> torch.Tensor:
    """The residual streams entering `layers` (hidden_states[i]) for ids [B, L], concatenated
    [B, L, n*H]: the features an EAGLE-3 head trains on, on every family."""
    out = decoder(model)(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i] for i in layers], -1)
