"""Generate stage on a tiny random Llama with a tiny byte-level BPE tokenizer (offline, seconds)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline import shards
from pipeline.config import DataConfig, GenerateConfig, Recipe
from pipeline.data import build_prompt_sets, encode_prompt
from pipeline.generate import generate_hash, prompts_key, run_generate

from helpers import free_port, launch_env

ROOT = Path(__file__).resolve().parent.parent

CODE = [f"def f{i}(x, y={i}):\n    \"\"\"Return x plus {i} times y.\"\"\"\n" + "    pass\n" * (i % 5)
        for i in range(40)]


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CODE, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tok


def tiny_model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = tok.eos_token_id
    m.generation_config.pad_token_id = tok.pad_token_id
    return m


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok)


def make_recipe(src: Path, **gen) -> Recipe:
    g = dict(max_new_tokens=12, batch_size=4, batches_per_shard=2, temperature=0.0, top_k_logprobs=5)
    g.update(gen)
    return Recipe(target="tiny", dtype="float32", device="cpu", seed=3,
                  data=DataConfig(source=str(src), heldout=str(src.with_name("heldout.jsonl")),
                                  max_prompts=0, val_fraction=0.0, max_prompt_tokens=256),
                  generate=GenerateConfig(**g))


def setup_run(tmp_path, tok, n=21, **gen):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": CODE[i]}) + "\n" for i in range(n)))
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"id": "h", "prompt": "def held(z):\n"}) + "\n")
    recipe = make_recipe(src, **gen)
    run = tmp_path / "run"
    build_prompt_sets(recipe.data, run, tok, recipe.seed)
    return recipe, run


def rows_by_id(stage):
    return {r["id"]: r for r in shards.load_shards(stage).to_list()}


def test_generate_columns_shapes_and_logprobs(tmp_path, tok, model):
    recipe, run = setup_run(tmp_path, tok)
    stage = run_generate(recipe, run, model=model, tokenizer=tok)
    m = shards.read_manifest(stage)
    assert m["complete"] is True and m["top_k"] == 5 and m["n_shards_expected"] == 3  # 21 prompts / 4 / 2
    assert m["recipe_hash"] == recipe.hash() and m["target"] == "tiny" and "torch" in m["versions"]
    ds = shards.load_shards(stage)
    assert set(ds.column_names) == {"id", "prompt_ids", "completion_ids", "topk_ids", "topk_logprobs"}
    assert len(ds) == 21
    for r in ds.to_list():
        n = len(r["completion_ids"])
        assert 1 <= n <= 12
        assert tok.eos_token_id not in r["completion_ids"][:-1]
        assert tok.pad_token_id not in r["completion_ids"]
        assert len(r["topk_ids"]) == len(r["topk_logprobs"]) == n
        assert all(len(x) == 5 for x in r["topk_ids"])
        lp = torch.tensor(r["topk_logprobs"])
        assert (lp <= 0).all() and (lp[:, :-1] >= lp[:, 1:]).all()
    # reference: unpadded teacher-forced forward, log_softmax over the full vocabulary
    for r in ds.to_list()[::5]:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0]
        P, n = len(r["prompt_ids"]), len(r["completion_ids"])
        ref = torch.log_softmax(logits[P - 1:P - 1 + n].float(), -1)
        vals, idx = ref.topk(5, -1)
        assert torch.allclose(torch.tensor(r["topk_logprobs"]), vals, atol=1e-4)
        assert (torch.tensor(r["topk_ids"])[:, 0] == idx[:, 0]).all()
        # greedy: each generated token is the target's argmax
        assert r["completion_ids"] == idx[:, 0].tolist()
        assert r["prompt_ids"] == encode_prompt({"prompt": CODE[int(r["id"][1:])]}, tok, False)


def test_generate_keeps_the_target_features_the_train_stage_reads(tmp_path, tok, model):
    """A method that trains on final-norm features (medusa, the recipe default): each shard holds every row's
    features at every position of prompt + completion, those of a teacher-forced forward over the row, and
    the train stage's rows get theirs cut to train.seq_len (features.generated_features). A method that
    trains on none (draft_lm) keeps none, and the train stage then computes them itself."""
    import dataclasses

    from pipeline.features import generated_features
    from pipeline.train_data import load_rows

    recipe, run = setup_run(tmp_path, tok)
    stage = run_generate(recipe, run, model=model, tokenizer=tok)
    feats, ds = shards.shard_features(stage), shards.load_shards(stage).to_list()
    assert len(feats) == len(ds) == 21
    for r, f in zip(ds, feats):
        with torch.no_grad():
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            ref = model(ids, output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(f, ref, atol=1e-5, rtol=1e-4)
    L = max(len(r["prompt_ids"]) for r in ds) + 1  # every row trains, the longer ones cut
    rows, _ = load_rows(run, "tiny", L)
    got = generated_features(stage, rows)
    assert len(rows) == 21 and any(len(feats[r["src"]]) > L for r in rows)
    for r, f in zip(rows, got):
        assert torch.equal(f, feats[r["src"]][:len(r["ids"])]) and ds[r["src"]]["prompt_ids"] == r["ids"][:r["P"]]

    (tmp_path / "lm").mkdir()
    recipe2, run2 = setup_run(tmp_path / "lm", tok)
    lm = dataclasses.replace(recipe2, train=dataclasses.replace(recipe2.train, method="draft_lm"))
    stage2 = run_generate(lm, run2, model=model, tokenizer=tok)
    assert shards.shard_features(stage2) is None
    assert generated_features(stage2, load_rows(run2, "tiny", L)[0]) is None


def test_resume_regenerates_only_damaged_shard(tmp_path, tok, model):
    recipe, run = setup_run(tmp_path, tok)
    stage = run_generate(recipe, run, model=model, tokenizer=tok)
    before = rows_by_id(stage)
    mtimes = {d.name: d.stat().st_mtime_ns for d in stage.glob("shard-*")}
    # corrupt one file of shard 1, delete shard 2 entirely
    victim = next(p for p in (stage / "shard-00001").rglob("*.arrow"))
    victim.write_bytes(victim.read_bytes()[:-10])
    import shutil
    shutil.rmtree(stage / "shard-00002")
    time.sleep(0.01)
    run_generate(recipe, run, model=model, tokenizer=tok)
    after = {d.name: d.stat().st_mtime_ns for d in stage.glob("shard-*")}
    assert after["shard-00000"] == mtimes["shard-00000"]
    assert after["shard-00001"] != mtimes["shard-00001"]
    assert "shard-00002" in after
    assert rows_by_id(stage) == before


def test_prompts_built_under_other_data_settings_are_refused(tmp_path, tok, model):
    """The prompt sets a run built are keyed by its seed/data settings: a later generate in that run dir
    under other data settings is refused in one line naming prompts/ (deleting generate/ alone, as the shards'
    refusal used to say, regenerated the old prompt sets under the new settings' hash)."""
    recipe, _ = setup_run(tmp_path, tok)
    run = tmp_path / "fresh-run"
    run_generate(recipe, run, model=model, tokenizer=tok)  # builds prompts/ itself, and keys it
    assert json.loads((run / "prompts" / "prompts.json").read_text())["key"] == prompts_key(recipe)
    other = make_recipe(Path(recipe.data.source))
    other.data.max_prompt_tokens = 64
    with pytest.raises(shards.ShardError, match="prompts was built with different seed/data settings"):
        run_generate(other, run, model=model, tokenizer=tok)
    run_generate(recipe, run, model=model, tokenizer=tok)  # the run's own settings: resumed as before


def test_interrupted_run_resumes(tmp_path, tok, model):
    recipe, run = setup_run(tmp_path, tok, temperature=0.8)
    stage = run_generate(recipe, run, model=model, tokenizer=tok)
    before = rows_by_id(stage)
    # simulate an interruption after shard 0: drop later shards from the manifest, mark incomplete
    m = shards.read_manifest(stage)
    m["complete"] = False
    m["shards"] = {"shard-00000": m["shards"]["shard-00000"]}
    shards.write_json_atomic(stage / "manifest.json", m)
    with pytest.raises(shards.ShardError, match="incomplete"):
        shards.load_shards(stage)
    t0 = (stage / "shard-00000").stat().st_mtime_ns
    run_generate(recipe, run, model=model, tokenizer=tok)
    assert (stage / "shard-00000").stat().st_mtime_ns == t0
    assert shards.read_manifest(stage)["complete"] is True
    assert rows_by_id(stage) == before  # sampled rows reproduce: per-batch seeds


def test_accelerate_two_processes_match_one(tmp_path, tok, model):
    recipe, run = setup_run(tmp_path, tok, temperature=0.7)
    target = tmp_path / "target"
    model.save_pretrained(target)
    tok.save_pretrained(target)
    import yaml
    d = recipe.to_dict()
    d["target"] = str(target)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(d))
    env = launch_env(ROOT)
    exe = Path(sys.executable).with_name("accelerate")
    # accelerate 1.15: `--cpu` always takes the single-process simple launcher; `--multi_gpu` goes through
    # torchrun, and ACCELERATE_USE_CPU=1 makes each process a CPU (gloo) worker.
    cmd = [str(exe), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m", "pipeline.generate",
           "--recipe", str(tmp_path / "recipe.yaml"), "--run-dir", str(run)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "process 1/2 wrote shards ['shard-00001']" in res.stderr
    two = rows_by_id(run / "generate")
    run1 = tmp_path / "run1"
    (run1 / "prompts").mkdir(parents=True)
    (run1 / "prompts" / "train.jsonl").write_text((run / "prompts" / "train.jsonl").read_text())
    from pipeline.config import load_recipe
    one = rows_by_id(run_generate(load_recipe(tmp_path / "recipe.yaml"), run1, model=model, tokenizer=tok))
    assert one.keys() == two.keys()
    for k in one:
        assert one[k]["completion_ids"] == two[k]["completion_ids"]
        assert one[k]["topk_ids"] == two[k]["topk_ids"]
        assert torch.allclose(torch.tensor(one[k]["topk_logprobs"]), torch.tensor(two[k]["topk_logprobs"]), atol=1e-5)


def test_decoder_engine_matches_hf_generate_in_fp32(tok, model):
    """The generate stage decodes with this project's decoder where the target is Llama-family; in fp32
    its rows (greedy tokens, EOS cut, top-k log-probs) equal those of HF `generate`, the engine for
    other architectures."""
    from pipeline.generate import generate_batch, make_decoder

    batch = [(f"p{i}", encode_prompt({"prompt": CODE[i]}, tok, False)) for i in (3, 7, 11, 30)]
    kw = dict(pad_id=tok.pad_token_id, eos_ids={tok.eos_token_id}, max_new_tokens=12, temperature=0.0,
              top_k=5, seed=0)
    dec = make_decoder(model)
    assert dec is not None  # a tiny Llama: the lean forward
    ours, hf = generate_batch(model, batch, decoder=dec, **kw), generate_batch(model, batch, **kw)
    for a, b in zip(ours, hf):
        assert a["completion_ids"] == b["completion_ids"] and a["topk_ids"] == b["topk_ids"]
        assert torch.allclose(torch.tensor(a["topk_logprobs"]), torch.tensor(b["topk_logprobs"]), atol=1e-5)
    assert min(len(r["completion_ids"]) for r in ours) < 12  # a row stopped at EOS: the cut is exercised


def test_a_time_budget_stops_between_shards_and_a_resume_keeps_the_cut(tmp_path, tok, model):
    """generate.max_minutes: once the next shard would end past the budget the stage stops, trains on the
    shards written (the manifest complete, the rest named in "budget"), and a resume writes no more; the shards
    written equal an unbudgeted run's."""
    (tmp_path / "full").mkdir(), (tmp_path / "cut").mkdir()
    full_recipe, full_run = setup_run(tmp_path / "full", tok, max_minutes=0.0)
    full = rows_by_id(run_generate(full_recipe, full_run, model=model, tokenizer=tok))
    recipe, run = setup_run(tmp_path / "cut", tok, max_minutes=1e-6)  # spent before the first shard ends
    unbudgeted = make_recipe(tmp_path / "cut" / "src.jsonl", max_minutes=0.0)
    assert recipe.hash() == unbudgeted.hash() and generate_hash(recipe) == generate_hash(unbudgeted)  # time, not rows
    stage = run_generate(recipe, run, model=model, tokenizer=tok)
    m = shards.read_manifest(stage)
    assert m["complete"] is True and sorted(m["shards"]) == ["shard-00000"]
    assert m["budget"]["skipped"] == ["shard-00001", "shard-00002"] and m["budget"]["max_minutes"] == 1e-6
    cut = rows_by_id(stage)
    assert len(cut) == 8 and all(cut[i] == full[i] for i in cut)  # the first shard's 2 batches of 4
    from pipeline.report import budget_section
    assert budget_section(run)[-1].startswith("- generate: 1 of 3 shards (8 completions) in ")
    run_generate(unbudgeted, run, model=model, tokenizer=tok)
    assert sorted(shards.read_manifest(stage)["shards"]) == ["shard-00000"]
    assert not (stage / "shard-00001").exists()


@pytest.mark.parametrize("command", ["generate", "train"])
def test_stage_commands_report_bad_input_in_one_line(command, tmp_path, capsys, monkeypatch):
    """`python -m pipeline.generate|train`: a bad recipe, or processes launched but not joined by accelerate (each
    would run the whole stage alone and write the same files), is one line and exit 2, before anything is
    written."""
    import importlib

    main = importlib.import_module(f"pipeline.{command}").main
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: -1\n")
    run = tmp_path / "run"
    assert main(["--recipe", str(bad), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"draftsmith {command}: train.steps=-1 must be > 0 and finite"
    monkeypatch.setenv("WORLD_SIZE", "2")  # what a launcher sets; accelerate here joins one process
    assert main(["--recipe", str(ROOT / "recipes/code.yaml"), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"draftsmith {command}: 2 processes were launched but accelerate "
                                                "joined 1") and "--num_processes 2" in err[0], err
    assert not run.exists()
