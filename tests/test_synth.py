"""data.source: self (pipeline/synth.py): requests the target writes from its chat template's user turn."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.cli import main
from pipeline.data import DataError, read_jsonl
from pipeline.synth import SynthError, SynthOptions, _degenerate, _key, holds_json, sample_requests, user_turn

from helpers import TINY_BUDGET, save_word_llama, word_tokenizer

# A template in the shape chat models use (role markers around each turn), over the word tokenizer's vocabulary.
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<s> w0 {% endif %}")


def _chat_tok():
    tok = word_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_the_user_turn_is_read_off_the_real_template(real_tokenizer):
    before, close = user_turn(real_tokenizer, None)
    assert before.endswith("<|im_start|>user\n") and "<|im_start|>system" in before
    assert close == "<|im_end|>"
    before, _ = user_turn(real_tokenizer, "Answer in JSON.")
    assert before == "<|im_start|>system\nAnswer in JSON.<|im_end|>\n<|im_start|>user\n"


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line():
    tok = word_tokenizer()
    tok.chat_template = None
    with pytest.raises(SynthError, match="no chat template.*give data.source"):
        user_turn(tok, None)


def test_filters():
    assert _degenerate("go go go go go go go go go go go go now")
    assert not _degenerate("How do I sort a list of dictionaries by a key in Python without a lambda?")
    assert _key("  Hello\n  World ") == _key("hello world")
    assert holds_json('{"a": 1}') and holds_json('Here it is:\n```json\n[1, 2, {"b": null}]\n```')
    assert holds_json('Sure. {"name": "x", "n": 3} Anything else?')
    assert not holds_json("{name: x}") and not holds_json("no json here") and not holds_json('{"a": 1')


def _word_target(seed=0):
    from transformers import AutoModelForCausalLM

    tok = _chat_tok()
    torch.manual_seed(seed)
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg).eval(), tok


def test_requests_are_seeded_distinct_and_exclude_what_they_are_told():
    model, tok = _word_target()
    opts = SynthOptions(min_chars=4, max_new_tokens=40, batch_size=8)
    a, ca = sample_requests(model, tok, opts, 6, seed=0)
    b, _ = sample_requests(model, tok, opts, 6, seed=0)
    assert a == b and len(a) == 6 and len({_key(t) for t in a}) == 6  # same seed, same requests; distinct
    c, _ = sample_requests(model, tok, opts, 6, seed=1, exclude={_key(t) for t in a})
    assert not {_key(t) for t in a} & {_key(t) for t in c}
    assert ca["sampled"] >= 6 and ca["sampled"] == 6 + sum(v for k, v in ca.items() if k != "sampled")
    # seeds steer: every request begins with one of them
    s, _ = sample_requests(model, tok, SynthOptions(min_chars=4, max_new_tokens=40, batch_size=8,
                                                    seeds=["w5 w6", "w7"]), 4, seed=0)
    assert all(t.startswith(("w5 w6", "w7")) for t in s)


def test_self_source_drives_a_tiny_distill(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    target = save_word_llama(tmp_path / "target", _chat_tok())
    args = ["distill", "--recipe", "recipes/code.yaml", f"target={target}", "dtype=float32",
            f"runs_dir={tmp_path / 'runs'}", "wandb.mode=disabled", *TINY_BUDGET, "train.draft_vocab_size=0",
            "data.source=self", "data.synth.prompts=12", "data.synth.heldout=3", "data.synth.min_chars=4",
            "data.synth.max_new_tokens=64", "data.synth.batch_size=16", "data.synth.check_json=true",
            "data.synth.system=w9 w10"]
    assert main(args) == 0
    run = (tmp_path / "runs" / "code" / "latest").resolve()
    train = read_jsonl(run / "prompts" / "train.jsonl") + read_jsonl(run / "prompts" / "val.jsonl")
    held = read_jsonl(run / "prompts" / "heldout.jsonl")
    made = {r["messages"][-1]["content"] for r in read_jsonl(run / "prompts" / "self-train.jsonl")}
    assert len(made) == 12 and len(held) == 3
    # the training set is the synthesised requests, less any that contain a held-out one (build_prompt_sets)
    assert 0 < len(train) <= 12 and {r["messages"][-1]["content"] for r in train} <= made
    assert all(r["messages"][0] == {"role": "system", "content": "w9 w10"} for r in train + held)
    assert not {r["messages"][-1]["content"] for r in train} & {r["messages"][-1]["content"] for r in held}
    data = json.loads((run / "data.json").read_text())
    assert data["source"] == "self" and data["n_train_requests"] == 12 and data["n_heldout_requests"] == 3
    rows = sum(s["rows"] for s in json.loads((run / "generate" / "manifest.json").read_text())["shards"].values())
    assert data["json_checked"] == rows and data["json_parse_rate"] == 0.0  # random words hold no JSON
    m = json.loads((run / "metrics.json").read_text())
    assert m["n_prompts"] == 2  # evaluate.n_prompts of the synthesised held-out requests


def test_self_source_with_no_requests_kept_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    target = save_word_llama(tmp_path / "target", _chat_tok())
    args = ["distill", "--recipe", "recipes/code.yaml", f"target={target}", "dtype=float32",
            f"runs_dir={tmp_path / 'runs'}", "wandb.mode=disabled", *TINY_BUDGET, "train.draft_vocab_size=0",
            "data.source=self", "data.synth.prompts=4", "data.synth.min_chars=100000", "data.synth.batch_size=4"]
    assert main(args) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("draftsmith")]
    assert len(err) == 1 and "data.source=self kept 0 training" in err[0] and "data.synth.min_chars" in err[0]


def test_synth_options_are_checked():
    from pipeline.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="data.synth.top_p"):
        load_recipe(domain="code", overrides=["data.synth.top_p=0"])
    with pytest.raises(RecipeError, match="data.synth.seeds"):
        load_recipe(domain="code", overrides=["data.synth.seeds=['']"])
    assert "synth" not in load_recipe(domain="code").to_dict()["data"]  # keyed only where it applies


def test_data_error_is_the_users_error():
    assert issubclass(SynthError, ValueError) and issubclass(DataError, ValueError)
