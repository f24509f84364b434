"""train.method=draft_lm with train.data=onpolicy trains through TRL's GKDTrainer (pipeline/gkd.py): our draft
directories come out, evaluate's decoder loads them, the loss falls where it must, and the divergence maps onto
GKD's beta exactly (or is refused)."""

import json

import pytest
import torch

from eval.decoder import SpeculativeDecoder
from eval.proposers import load_proposer
from pipeline.gkd import gkd_beta
from pipeline.losses import divergence
from pipeline.shards import record_shard, save_shard
from pipeline.train import read_log, run_train

from helpers import train_recipe, word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, SHIFT, FIRST_WORD = 20, 7, 4  # word ids 4..63 (below 4: pad, bos, eos, unk)


def _next(t: int) -> int:
    """The teacher's deterministic rule: word t -> the word SHIFT further on, cyclically."""
    return FIRST_WORD + (t - FIRST_WORD + SHIFT) % (64 - FIRST_WORD)


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(scope="module")
def teacher(tok):
    """A Llama whose layers add nothing (o_proj, down_proj zero) over orthonormal embeddings, with an LM head
    that scores word `_next(t)` 16 and every other token 0 after word t: a near-deterministic teacher."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    V = len(tok)
    cfg = LlamaConfig(vocab_size=V, hidden_size=V, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        emb = torch.linalg.qr(torch.randn(V, V))[0]  # [V, V] orthonormal rows
        m.model.embed_tokens.weight.copy_(emb)
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(V, V)
        for t in range(FIRST_WORD, V):
            head[_next(t)] = 2.0 * emb[t]  # the final norm scales a unit row to sqrt(V) = 8: logit 16
        m.lm_head.weight.copy_(head)
    return m


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, teacher):
    """A generate stage: 16 random word prompts, each with the teacher's greedy completion and top-k."""
    from datasets import Dataset

    d = tmp_path_factory.mktemp("run")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):
        prompt = torch.randint(FIRST_WORD, 64, (5,), generator=g).tolist()
        ids = list(prompt)
        tk_ids, tk_lp = [], []
        with torch.no_grad():
            for _ in range(10):
                lp = torch.log_softmax(teacher(torch.tensor([ids])).logits[0, -1], -1)
                v, ix = lp.topk(4)
                tk_ids.append(ix.tolist()), tk_lp.append(v.tolist())
                ids.append(int(ix[0]))
        rows.append({"id": str(i), "prompt_ids": prompt, "completion_ids": ids[5:], "topk_ids": tk_ids,
                     "topk_logprobs": tk_lp})
    e = save_shard(d / "generate", 0, Dataset.from_list(rows))
    record_shard(d / "generate", 0, e, header={"complete": True, "target": "tiny", "top_k": 4})
    return d


@pytest.fixture(scope="module")
def student(tmp_path_factory, tok):
    """A random 1-layer Llama over the same words (untied head): the draft starts far from the teacher."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    d = tmp_path_factory.mktemp("student")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _recipe(student, **train):
    return train_recipe(**{"method": "draft_lm", "data": "onpolicy", "steps": STEPS, "save_every": 10,
                           "batch_size": 4, "lr": 3e-2, "warmup_steps": 2, "divergence": "fkl",
                           "draft_lm": {"init_from": str(student)}, **train})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, gen_dir, teacher, tok, student):
    import shutil

    d = tmp_path_factory.mktemp("gkd")
    shutil.copytree(gen_dir / "generate", d / "generate")
    return run_train(_recipe(student), d, target=teacher, tokenizer=tok)


def test_gkd_trains_our_checkpoints_and_the_loss_falls(trained):
    m = json.loads((trained / "manifest.json").read_text())
    assert m["trainer"] == "trl.GKDTrainer" and m["onpolicy_steps"] == STEPS and m["steps"] == STEPS
    assert m["checkpoints"] == ["checkpoint-000010", "checkpoint-000020"]
    meta = json.loads((trained / "checkpoint-000020" / "draftsmith_draft.json").read_text())
    assert meta["kind"] == "draft_lm" and meta["step"] == STEPS and meta["data"] == "onpolicy"
    log = read_log(trained)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    first, last = [r["loss"] for r in log[:3]], [r["loss"] for r in log[-3:]]
    # the draft learns the teacher's rule: the forward KL on its own samples falls below a quarter of its start
    assert max(last) < 0.25 * min(first), (first, last)


def test_gkd_checkpoint_decodes_exactly_in_our_decoder(trained, teacher, tok):
    ck = trained / "checkpoint-000020"
    prompts = [[5, 9, 30], [40, 41], [63, 4, 17, 22]]
    plain = SpeculativeDecoder(teacher, None).generate(prompts, max_new_tokens=12).sequences
    assert plain[0][:3] == [_next(30), _next(_next(30)), _next(_next(_next(30)))]  # the rule, greedily
    dec = SpeculativeDecoder(teacher, load_proposer(str(ck), teacher), k=4)
    out = dec.generate(prompts, max_new_tokens=12)
    assert out.sequences == plain  # greedy exactness (fp32)
    assert dec.last_stats["alpha"] > 0.5  # the trained draft proposes the rule


def test_finished_run_is_not_retrained_and_a_cut_run_resumes(trained, teacher, tok, student):
    ck10, ck20 = trained / "checkpoint-000010", trained / "checkpoint-000020"
    stamp = (ck20 / "model.safetensors").stat().st_mtime_ns
    run_train(_recipe(student), trained.parent, target=teacher, tokenizer=tok)
    assert (ck20 / "model.safetensors").stat().st_mtime_ns == stamp  # finished: nothing retrained
    # cut after step 10: the resume keeps checkpoint 10 and trains steps 11..20 only
    import shutil

    shutil.rmtree(ck20)
    (trained / "manifest.json").unlink()
    stamp10 = (ck10 / "model.safetensors").stat().st_mtime_ns
    run_train(_recipe(student), trained.parent, target=teacher, tokenizer=tok)
    assert (ck10 / "model.safetensors").stat().st_mtime_ns == stamp10 and (ck20 / "trainer_state.pt").exists()
    assert [r["step"] for r in read_log(trained)] == list(range(1, STEPS + 1))
    assert torch.load(ck20 / "trainer_state.pt", weights_only=False)["step"] == STEPS


def test_bf16_recipe_trains_under_autocast(tmp_path, gen_dir, teacher, tok, student):
    """dtype=bfloat16 trains under our autocast: GKDConfig(bf16=True) would remake accelerate's state, which
    run_train made first, and fail."""
    import shutil

    shutil.copytree(gen_dir / "generate", tmp_path / "generate")
    recipe = _recipe(student, steps=2, save_every=2)
    recipe.dtype = "bfloat16"
    train_dir = run_train(recipe, tmp_path, target=teacher, tokenizer=tok)
    assert [p.name for p in train_dir.glob("checkpoint-*")] == ["checkpoint-000002"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_log(train_dir))


@pytest.mark.parametrize("name,beta", [("fkl", 0.0), ("rkl", 1.0), ("jsd", 0.3)])
def test_divergence_maps_onto_gkd_beta_exactly(name, beta):
    from trl.experimental.gkd import GKDTrainer

    tc = train_recipe(method="draft_lm", data="onpolicy", divergence=name, jsd_beta=0.3).train
    assert gkd_beta(tc) == beta
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 11, generator=g), torch.randn(6, 11, generator=g) * 2  # [N, V] student, teacher logits
    ours = divergence(name, s, teacher_logits=t, beta=0.3)
    theirs = GKDTrainer.generalized_jsd_loss(s, t, beta=beta)  # batchmean over the N rows
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_a_divergence_gkd_cannot_express_is_refused(tmp_path, gen_dir, teacher, tok, student):
    from pipeline.config import RecipeError

    with pytest.raises(RecipeError) as e:  # at recipe load, before any stage runs
        _recipe(student, divergence="tv")
    msg = str(e.value)
    assert "\n" not in msg and "tv" in msg and "GKDTrainer" in msg and "onpolicy_fraction=1" in msg
    assert not (gen_dir / "train" / "manifest.json").exists()
