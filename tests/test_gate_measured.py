"""The gate on real timing (issue 32): retrain.judge measures a challenger, a champion, the n-gram baseline and
plain decoding in one interleaved run on a tiny target, and retrain.decide (pipeline/gate.py) decides on what
was measured, nothing replaced. A draft whose proposals are wrong (a random draft LM: every round pays its
forwards and gains nothing) is really slower; lookups in a datastore of the target's own greedy outputs are
really faster, and the target's text never repeats, so the n-gram baseline gains nothing. The target is wide
enough (hidden 512) that its forward, not the decoder's bookkeeping, is the cost of a token, as with real
targets; the margins are then several-fold, far outside timing noise, over the n-gram baseline too."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from eval import draft_dir
from eval.datastore import Datastore
from eval.decoder import SpeculativeDecoder
from pipeline import retrain
from pipeline.config import load_recipe
from pipeline.evaluate import heldout_ids
from pipeline.data import write_jsonl

PROMPTS = [f"def {n}(items, k={i}):\n    \"\"\"Return the {n} of items.\"\"\"\n" for i, n in enumerate(
    ["add", "scale", "clip", "merge", "split", "count", "find", "rotate"])]


def _successor_target(model):
    """The target's greedy text steps through one random cycle of the whole vocabulary (token v is followed by
    next[v]), so it never repeats itself and prompt lookups (the n-gram baseline) find nothing, while every
    layer's matmuls still run: attention and MLP outputs are zero, the residual stream is the embedding, and
    the LM head's row next[v] is token v's embedding (a random embedding's product with itself dwarfs its
    product with any other)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        order = torch.randperm(emb.shape[0])
        model.lm_head.weight[order.roll(-1)] = emb[order]
    return model


@pytest.fixture(scope="module")
def setting(real_tokenizer, tmp_path_factory):
    """(recipe, run dir with the held-out prompts, target, tokenizer, wrong draft dir, datastore draft dir)."""
    root = tmp_path_factory.mktemp("gate-measured")
    tok = real_tokenizer
    torch.manual_seed(0)
    wide = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                       tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    target_dir = root / "target"
    _successor_target(LlamaForCausalLM(wide)).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    recipe = load_recipe("recipes/code.yaml", [f"target={target_dir}", "dtype=float32", "evaluate.n_prompts=8",
                                               "evaluate.max_new_tokens=32", "evaluate.k=8",
                                               "evaluate.fp32_prompts=1", "retrain.min_tokens=100"])
    run = root / "run"
    (run / "prompts").mkdir(parents=True)
    write_jsonl(run / "prompts" / "heldout.jsonl", [{"prompt": p} for p in PROMPTS])
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    torch.manual_seed(7)  # a draft LM of random weights: its proposals are wrong
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    wrong = root / "wrong"
    LlamaForCausalLM(cfg).save_pretrained(wrong)
    tok.save_pretrained(wrong)
    draft_dir.write_meta(wrong, {"kind": "draft_lm"})
    # the same directory with a datastore of the target's own greedy outputs on these prompts
    store = root / "store"
    shutil.copytree(wrong, store)
    ids = heldout_ids(recipe, run, tok)
    out = SpeculativeDecoder(target, None).generate(ids, max_new_tokens=32).sequences
    Datastore([list(p) + list(o) for p, o in zip(ids, out)]).save(store)
    return recipe, run, target, tok, wrong, store


def _judge(setting, challenger: str, champion: str, name: str) -> tuple:
    recipe, run, target, tok, *_ = setting
    d = run.parent / name
    shutil.copytree(run, d)
    judged = retrain.judge(recipe, d, target, tok, challenger, {"id": name, "draft_dir": champion})
    decision = retrain.decide(recipe, judged)
    print(f"{name}: {decision.summary()}")  # the measured figures, in the log of a failing run too
    return judged, decision


def test_a_really_slower_challenger_is_kept(setting):
    *_, wrong, store = setting
    judged, d = _judge(setting, str(wrong), f"datastore:{store}", "slower")
    assert judged["challenger"]["speedup"] < 1.0 < judged["champion"]["speedup"], d.summary()
    assert not d.promote and d.outcome == "keep", d.summary()
    failed = {c.name for c in d.failed}
    assert {"speedup_over_plain", "gain_over_champion"} <= failed, d.summary()
    assert d.figures["evidence"]["n_prompts"] == 8 and d.figures["bootstrap"]["upper"] < 1.0


def test_a_really_faster_challenger_is_promoted(setting):
    *_, wrong, store = setting
    judged, d = _judge(setting, f"datastore:{store}", str(wrong), "faster")
    assert judged["challenger"]["stats"]["tau"] > 3.0, judged["challenger"]["stats"]["tau"]
    assert d.promote and d.outcome == "promote", d.summary()
    assert d.figures["bootstrap"]["lower"] > 1.5 and d.figures["bootstrap_plain"]["lower"] > 1.0
    # the four took turns on the same prompts with the same plain runs
    assert judged["challenger"]["plain_stats"] == judged["champion"]["plain_stats"] == judged["ngram"]["plain_stats"]
