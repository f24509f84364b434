"""A `.gguf` file as the target: converted once into an HF checkpoint under the cache directory, named by
the file's hash, and loaded like any other target. The GGUF is written here with the `gguf` package from a
tiny random Llama (llama.cpp's tensor names, its Q/K row order, a byte-level BPE tokenizer)."""

import numpy as np
import pytest
import torch

from eval.loading import LoadError, convert_gguf


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (interleaved RoPE pairs); transformers undoes it on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_level_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    return [spell[b] for b in range(256)] + ["ab", "<|endoftext|>"]


def write_llama_gguf(path, seed=0):
    """A 2-layer Llama (fp32) written as GGUF; returns the HF model it holds."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = _byte_level_tokens()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=len(tokens) - 1, eos_token_id=len(tokens) - 1)
    model = LlamaForCausalLM(cfg).eval()
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_token_types([1] * (len(tokens) - 1) + [3])  # 1 normal, 3 control
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(2):
        for g, h in names.items():
            t = sd[f"model.layers.{i}.{h}.weight"]
            t = _permute(t, 4) if g == "attn_q" else _permute(t, 2) if g == "attn_k" else t
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def test_a_gguf_target_converts_once_by_hash_and_loads(tmp_path, monkeypatch):
    from pipeline.models import load_target

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny-llama.gguf"
    ref = write_llama_gguf(src)
    model, tok = load_target(str(src), dtype="float32", device="cpu")
    conv = list((tmp_path / "cache" / "gguf").glob("*-tiny-llama"))
    assert len(conv) == 1 and (conv[0] / "config.json").exists() and (conv[0] / "model.safetensors").exists()
    assert not list((tmp_path / "cache" / "gguf").glob(".convert-*"))  # the temporary directory was renamed
    ids = torch.tensor([tok("ab a b").input_ids])
    assert ids.shape[1] >= 2 and int(ids.max()) < ref.config.vocab_size
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    # bf16 weights (the conversion's dtype) read back in fp32: the same model to bf16's precision
    assert torch.allclose(got, want, atol=0.05, rtol=0.05) and torch.equal(got.argmax(-1), want.argmax(-1))
    stamp = (conv[0] / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(src) == conv[0] and (conv[0] / "model.safetensors").stat().st_mtime_ns == stamp  # reused
    from pipeline.config import EMBEDDED_TARGET
    from pipeline.models import served_path

    # a report's serve commands name the directories engines load, not the recipe's GGUF or embedded: spec
    assert served_path(str(src)) == str(conv[0])
    assert served_path(EMBEDDED_TARGET) == str(tmp_path / "cache" / "smollm2-135m-instruct-bf16")
    assert served_path(str(tmp_path / "hf-dir")) == str(tmp_path / "hf-dir")
    write_llama_gguf(src, seed=1)  # another file at the same path: its hash names another conversion
    assert convert_gguf(src) != conv[0]


def test_a_missing_or_unreadable_gguf_is_one_line(tmp_path, monkeypatch):
    from pipeline.cli import main

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(LoadError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(LoadError, match="cannot load GGUF"):
        convert_gguf(bad)
    assert main(["generate", "--recipe", "recipes/code.yaml", f"target={bad}", f"runs_dir={tmp_path / 'runs'}",
                 "wandb.mode=disabled"]) == 2


def test_the_array_reader_reads_what_gguf_reads_and_the_patch_is_undone(tmp_path):
    """convert_gguf's faster reads (eval.loading._fast_gguf_reads): the same fields, values and tensors as
    gguf-py's own reader, one tensor-name map per (arch, blocks), and gguf's names restored afterwards."""
    import gguf

    from eval.loading import _fast_gguf_reads

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path)
    plain, name_map = gguf.GGUFReader(path), gguf.get_tensor_name_map
    with _fast_gguf_reads():
        fast = gguf.GGUFReader(path)
        assert type(fast.data) is np.ndarray and type(plain.data) is np.memmap
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is not type(fast) and gguf.get_tensor_name_map is name_map
    assert list(fast.fields) == list(plain.fields)
    for name, f in plain.fields.items():
        g = fast.fields[name]
        assert f.types == g.types and f.data == g.data and all(np.array_equal(a, b) for a, b in zip(f.parts, g.parts))
    assert [t.name for t in fast.tensors] == [t.name for t in plain.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.tensors, fast.tensors))
