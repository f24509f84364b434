"""Tiny random models of every architecture family draftsmith takes as a target, built from their
transformers configs (no download, seconds). Issue 23's family list: Llama, Qwen2, Qwen3, Mistral (sliding
window), Gemma 2, Gemma 3, Phi-3, GPT-2 and GPT-NeoX (non-Llama layouts: learned positions, LayerNorm,
parallel residual, partial RoPE).

`tiny_family(name, vocab)` -> an fp32 model in eval mode; `save_family(path, name, tok)` saves one over a
tokenizer's vocabulary as an HF checkpoint directory (the pipeline's target).
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt2", "gpt_neox")
SLIDING_WINDOW = 8  # small enough that the tests' prompts + new tokens cross it


def _config(name: str, vocab: int, layers: int, hidden: int, special: dict):
    import transformers as tf

    heads, kv, inter = 4, 2, 2 * hidden
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512,
                  initializer_range=0.1, **special)
    if name == "llama":
        return tf.LlamaConfig(**common)
    if name == "qwen2":
        return tf.Qwen2Config(**common)
    if name == "qwen3":
        return tf.Qwen3Config(head_dim=hidden // heads, **common)
    if name == "mistral":
        return tf.MistralConfig(sliding_window=SLIDING_WINDOW, **common)
    if name == "gemma2":
        return tf.Gemma2Config(head_dim=hidden // heads, sliding_window=SLIDING_WINDOW, **common)
    if name == "gemma3":
        return tf.Gemma3TextConfig(head_dim=hidden // heads, sliding_window=SLIDING_WINDOW,
                                   sliding_window_pattern=2, **common)
    if name == "phi3":  # its config's default pad id (32000) lies outside a tiny vocabulary
        return tf.Phi3Config(**{"pad_token_id": 0, **common})
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=512,
                             initializer_range=0.1, **special)
    if name == "gpt_neox":
        return tf.GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                num_hidden_layers=layers, num_attention_heads=heads, rotary_pct=0.5,
                                max_position_embeddings=512, initializer_range=0.1, **special)
    raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")


def tiny_family(name: str, vocab: int, seed: int = 0, layers: int = 2, hidden: int = 32, **special):
    """A random fp32 model of family `name` over `vocab` tokens (special: pad/bos/eos ids, tie_word_embeddings)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(name, vocab, layers, hidden, special)
    return AutoModelForCausalLM.from_config(cfg).eval()


def save_family(path, name: str, tok, seed: int = 0, layers: int = 2, hidden: int = 32):
    """A tiny `name` model over `tok`'s vocabulary, saved with the tokenizer as an HF directory."""
    special = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                   pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    tiny_family(name, len(tok), seed, layers, hidden, **special).save_pretrained(path)
    tok.save_pretrained(path)
    return path
