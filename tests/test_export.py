"""`draftsmith export`: each format written from a tiny draft and read back the way its engine reads it
(config fields by the names vLLM's readers use, every tensor mapped back to the source exactly, the HF
draft through transformers), every refusal (one line, exit 2, no output), the recipe's export section and
evaluate.serve's promotion filter."""

import json
import re
import shlex
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval import draft_dir
from pipeline.cli import main
from pipeline.config import Recipe, RecipeError, load_recipe
from pipeline.export import FORMATS, MANIFEST, export_draft

V, VD, H, NH, NKV, HD, I = 128, 48, 32, 4, 2, 8, 64  # the tiny EAGLE-3 head over medusa_target's shape


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The verifier: helpers' medusa_target (Llama, 2 layers, H=32, V=128) as an HF directory."""
    from helpers import medusa_target

    d = tmp_path_factory.mktemp("verifier")
    medusa_target().save_pretrained(d)
    return d


def eagle3_draft(d, target_dir, aux=(0, 1, 2), norm_before_residual=False, **meta):
    """An EAGLE-3 draft directory by the contract: head.safetensors with its keys and shapes (random
    weights, a truncated vocabulary of VD ids), the metadata with head_config and the target's config."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ids = torch.randperm(V, generator=g)[:VD].sort().values  # [VD] target ids of the draft vocabulary
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    sd = {"embed_tokens.weight": r(V, H), "fc.weight": r(H, 3 * H), "layers.0.hidden_norm.weight": r(H),
          "layers.0.input_layernorm.weight": r(H), "layers.0.self_attn.q_proj.weight": r(NH * HD, 2 * H),
          "layers.0.self_attn.k_proj.weight": r(NKV * HD, 2 * H),
          "layers.0.self_attn.v_proj.weight": r(NKV * HD, 2 * H),
          "layers.0.self_attn.o_proj.weight": r(H, NH * HD), "layers.0.post_attention_layernorm.weight": r(H),
          "layers.0.mlp.gate_proj.weight": r(I, H), "layers.0.mlp.up_proj.weight": r(I, H),
          "layers.0.mlp.down_proj.weight": r(H, I), "norm.weight": r(H), "lm_head.weight": r(VD, H),
          "d2t": ids - torch.arange(VD), "t2d": t2d}
    d.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(d / "head.safetensors"))
    tc = json.loads((target_dir / "config.json").read_text())
    hc = {"hidden_size": H, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
          "intermediate_size": I, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
          "vocab_size": V, "draft_vocab_size": VD, "target_hidden_size": H,
          "norm_before_residual": norm_before_residual, "aux_layers": list(aux)}
    draft_dir.write_meta(d, {"kind": "eagle3", "head_config": hc, "target": str(target_dir), "target_config": tc,
                             "step": 7, "train_key": "k123", **meta})
    return d, sd


def dflash_draft(d, target_dir):
    """A DFlash draft on medusa_target: one layer, blocks of 4, every other id in its vocabulary."""
    from helpers import medusa_target

    from eval.heads import DFlashHead

    t = medusa_target()
    head = DFlashHead.from_target(t, 1, 4, 1, draft_ids=torch.arange(0, V, 2))
    head.save(d, {"target": str(target_dir), "target_config": t.config.to_dict(), "step": 7})
    return d


def medusa_draft(d, target_dir, draft_ids=None, recurrent=False, layers=1, shared_lm_head=False):
    """Medusa heads on medusa_target with random residual blocks (fresh ones are the identity)."""
    from helpers import MEDUSA_NH, medusa_target

    from eval.heads import MedusaHeads

    torch.manual_seed(1)
    heads = MedusaHeads.from_target(medusa_target(), MEDUSA_NH, draft_ids=draft_ids, num_layers=layers,
                                    recurrent=recurrent, shared_lm_head=shared_lm_head)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_(0, 0.3)
    heads.save(d, extra={"target": str(target_dir), "step": 3, "train_key": "m1"})
    return heads.eval()


def refused(capsys, argv, out, match):
    """The CLI refuses: exit 2, one line on stderr matching `match`, nothing at `out`."""
    capsys.readouterr()  # what the test wrote before
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals (a bad --k-by-batch) exit from the parser
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and re.search(match, err), err
    assert not out.exists() or not any(out.iterdir())
    assert not [p for p in out.parent.iterdir() if ".export-" in p.name]  # no temporary left behind


# ------------------------------------------------------------------------------- eagle3 kind

def vllm_speculators_config(config: dict) -> dict:
    """What vLLM's SpeculatorsConfig builds from config.json (transformers_utils/configs/speculators/
    base.py + algos.py update_eagle3), read by the same keys."""
    sc = config["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] and sc["verifier"]["name_or_path"]
    assert isinstance(config["transformer_layer_config"], dict)
    pre = dict(config["transformer_layer_config"])
    pre["draft_vocab_size"] = config.get("draft_vocab_size")
    pre["target_hidden_size"] = config["target_hidden_size"]
    pre["norm_before_residual"] = config.get("norm_before_residual", True)
    assert pre.get("model_type", "llama") == "llama"
    pre["architectures"] = ["Eagle3LlamaForCausalLM"]
    pre["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return pre


@pytest.mark.parametrize("nbr", [False, True])
def test_speculators_export_reads_back_as_vllm_reads_it(tmp_path, target_dir, nbr):
    from transformers import LlamaConfig

    src, sd = eagle3_draft(tmp_path / "draft", target_dir, norm_before_residual=nbr)
    out = export_draft(src, "speculators", tmp_path / "out", k=3)
    config = json.loads((out / "config.json").read_text())
    assert "model_type" not in config  # vLLM picks the speculators reader only without one
    assert config["speculators_model_type"] == "eagle3" and config["speculators_config"]["algorithm"] == "eagle3"
    sc = config["speculators_config"]
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}]
    assert sc["default_proposal_method"] == "greedy"
    assert sc["verifier"] == {"name_or_path": str(target_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    pre = vllm_speculators_config(config)
    assert pre["norm_before_residual"] is nbr  # written even when false (vLLM's default is true)
    assert pre["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    lc = LlamaConfig(**{k: v for k, v in pre.items() if k != "architectures"})
    assert (lc.hidden_size, lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim, lc.intermediate_size,
            lc.vocab_size, lc.num_hidden_layers, lc.max_position_embeddings) == (H, NH, NKV, HD, I, V, 1, 256)
    assert lc.rope_parameters["rope_theta"] == 10000.0 and lc.rms_norm_eps == 1e-6
    assert (pre["draft_vocab_size"], pre["target_hidden_size"]) == (VD, H)
    w = load_file(str(out / "model.safetensors"))
    assert w.keys() == sd.keys() and all(torch.equal(w[k], sd[k]) for k in sd)
    # d2t holds offsets, as vLLM adds them: draft id + d2t = the target ids t2d marks
    assert torch.equal((torch.arange(VD) + w["d2t"]).sort().values, w["t2d"].nonzero()[:, 0])


def test_eagle3_export_midlayer_names_and_both_engines_aux_ids(tmp_path, target_dir):
    src, sd = eagle3_draft(tmp_path / "draft", target_dir, aux=(1, 1, 2))
    out = export_draft(src, "eagle3", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["draft_vocab_size"], config["norm_before_residual"]) == (1, VD, False)
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 1, 2]  # vLLM: the stream entering layer i
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 0, 1], "use_aux_hidden_state": True}
    w = load_file(str(out / "model.safetensors"))
    assert not [k for k in w if k.startswith("layers.")]
    back = {k.replace("midlayer.", "layers.0."): t for k, t in w.items()}  # vLLM's hf_to_vllm_mapper
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    m = json.loads((out / MANIFEST).read_text())
    assert m["serve"]["sglang"].endswith(f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                                         f"{out.resolve()} --speculative-num-steps 2 --speculative-eagle-topk 1 "
                                         f"--speculative-num-draft-tokens 3")
    assert json.loads(m["serve"]["vllm"].split("'")[1]) == {"method": "eagle3", "model": str(out.resolve()),
                                                           "num_speculative_tokens": 2}


def test_manifest_records_source_verifier_k_and_every_file(tmp_path, target_dir):
    import hashlib

    src, _ = eagle3_draft(tmp_path / "draft", target_dir)
    out = export_draft(src, "speculators", tmp_path / "out", verifier=str(target_dir), k=4)
    m = json.loads((out / MANIFEST).read_text())
    assert (m["format"], m["kind"], m["source"], m["step"], m["train_key"], m["k"]) == (
        "speculators", "eagle3", str(src.resolve()), 7, "k123", 4)
    assert m["verifier"] == str(target_dir.resolve()) and m["serve"] == {"vllm": f"vllm serve {out.resolve()}"}
    files = sorted(p.name for p in out.iterdir() if p.name != MANIFEST)
    assert sorted(m["files"]) == files == ["config.json", "model.safetensors"]
    assert all(hashlib.sha256((out / f).read_bytes()).hexdigest() == h for f, h in m["files"].items())


def test_the_k_by_batch_table_goes_into_the_vllm_serve_command_and_the_manifest(tmp_path, target_dir, capsys):
    """The owner report's recommended table rides in vLLM's speculative config; a self-contained export is then
    served through the verifier (its config.json cannot carry the table), and --k defaults to the table's top K."""
    src, _ = eagle3_draft(tmp_path / "draft", target_dir)
    table = [[1, 4, 3], [5, 16, 1], [17, 256, 0]]
    out = tmp_path / "out"
    assert main(["export", "--draft", str(src), "--format", "speculators", "--out", str(out), "--verifier",
                 str(target_dir), "--k-by-batch", json.dumps(table)]) == 0
    m = json.loads((out / MANIFEST).read_text())
    assert (m["k"], m["k_by_batch"]) == (3, table)
    cmd = shlex.split(m["serve"]["vllm"])
    assert cmd[:3] == ["vllm", "serve", str(target_dir.resolve())]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": table}
    assert m["serve"]["vllm"] in capsys.readouterr().out  # what the command prints to copy
    plain = export_draft(src, "speculators", tmp_path / "plain", verifier=str(target_dir), k=3)
    assert json.loads((plain / MANIFEST).read_text())["k_by_batch"] is None


@pytest.mark.parametrize("table, k, match", [
    ("[[1, 4, 4], [5, 256", None, r"is not JSON: give \[\[start, end, K\], \.\.\.\] ranges from batch 1"),
    ("[[2, 4, 1]]", None, r"the first range must start at batch 1"),
    ("[[1, 4, 2], [3, 8, 1]]", None, r"not overlapping"),
    ("[[1, 4, -1]]", None, r"K >= 0"),
    ("[[1, 4]]", None, r"each three integers"),
    ("[[1, 4, 4], [5, 256, 0]]", "2", r"--k-by-batch asks K=4 but --k is 2: .*pass --k 4 or lower the table"),
])
def test_export_refuses_a_k_table_vllm_would_refuse_or_cap(tmp_path, target_dir, capsys, table, k, match):
    src, _ = eagle3_draft(tmp_path / "draft", target_dir)
    out = tmp_path / "out"
    refused(capsys, ["export", "--draft", str(src), "--format", "speculators", "--out", str(out), "--verifier",
                     str(target_dir), "--k-by-batch", table] + (["--k", k] if k else []), out, match)


# ------------------------------------------------------------------------------- medusa kind

def vllm_medusa_logits(out, feat):
    """vLLM's Medusa forward and compute_logits (model_executor/models/medusa.py) over the exported
    files: per head x + SiLU(W x + b) per layer, its LM head (with original_lm_head every head's is
    lm_heads.0, the only one loaded), logits scattered to token_map's ids."""
    config = json.loads((out / "config.json").read_text())
    for k in list(config):  # MedusaConfig.from_pretrained's renaming
        if "num" in k:
            config["num_heads" if "heads" in k else "num_hidden_layers" if "layers" in k else k] = config.pop(k)
    w = load_file(str(out / "model.safetensors"))
    token_map = w.get("token_map") if config["truncated_vocab_size"] < config["vocab_size"] else None
    logits = []
    for i in range(config["num_heads"]):
        x = feat
        for j in range(config["num_hidden_layers"]):
            bias = w[f"blocks.{i}.layers.{j}.bias"] if config.get("medusa_fc_bias") else 0
            x = x + torch.nn.functional.silu(x @ w[f"blocks.{i}.layers.{j}.weight"].T + bias)
        lg = x @ w[f"lm_heads.{0 if config.get('original_lm_head') else i}.weight"].T
        if token_map is not None:
            full = torch.full((*lg.shape[:-1], config["vocab_size"]), -torch.inf)
            full[..., token_map] = lg
            lg = full
        logits.append(lg)
    return config, torch.stack(logits, -2)  # [N, heads, V]


def our_medusa_logits(heads, feat):
    """Our heads' logits placed at target ids (d2t), -inf elsewhere: [N, heads, V]."""
    lg = heads.logits(heads(feat))  # [N, heads, Vd]
    full = torch.full((*lg.shape[:-1], heads.config.vocab_size), -torch.inf)
    full[..., heads.d2t] = lg
    return full


def test_medusa_export_scores_every_target_id_as_our_heads(tmp_path, target_dir):
    """Full vocabulary in a shuffled order (our LM head's row r scores d2t[r]): vLLM's rows are in
    target order, so every target id gets our logit."""
    g = torch.Generator().manual_seed(2)
    heads = medusa_draft(tmp_path / "draft", target_dir, draft_ids=torch.randperm(V, generator=g), layers=2)
    out = export_draft(tmp_path / "draft", "medusa", tmp_path / "out", k=3)
    feat = torch.randn(5, H, generator=g)
    config, theirs = vllm_medusa_logits(out, feat)
    assert (config["model_type"], config["architectures"], config["num_heads"], config["num_hidden_layers"]) == (
        "medusa", ["MedusaModel"], 3, 2)
    assert (config["vocab_size"], config["truncated_vocab_size"], config["hidden_size"]) == (V, V, H)
    assert "token_map" not in load_file(str(out / "model.safetensors"))
    assert FORMATS["medusa"].vllm_loader(out) == {} and "loader" not in FORMATS["medusa"].serve(out, "t", 3)["vllm"]
    with torch.no_grad():
        ours = our_medusa_logits(heads, feat)
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0) and torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_medusa_heads_sharing_an_lm_head_export_a_truncated_vocabulary(tmp_path, target_dir):
    """Heads with one shared LM head over VD of V ids (train.medusa.shared_lm_head): vLLM's original_lm_head
    form, one [VD, H] head and token_map = d2t, scores every drafted id as our heads do."""
    g = torch.Generator().manual_seed(3)
    heads = medusa_draft(tmp_path / "draft", target_dir, draft_ids=torch.randperm(V, generator=g)[:VD], layers=2,
                         shared_lm_head=True)
    assert len({id(lm.weight) for lm in heads.lm_heads}) == 1
    out = export_draft(tmp_path / "draft", "medusa", tmp_path / "out", k=3)
    feat = torch.randn(5, H, generator=g)
    config, theirs = vllm_medusa_logits(out, feat)
    w = load_file(str(out / "model.safetensors"))
    assert config["original_lm_head"] is True and (config["vocab_size"], config["truncated_vocab_size"]) == (V, VD)
    assert torch.equal(w["token_map"], heads.d2t) and w["lm_heads.0.weight"].shape == (VD, H)
    assert not any(k.startswith("lm_heads.1") for k in w)  # one LM head, loaded once
    # vLLM 0.32 loads the token_map but refuses it in its loaded-weights check: the export turns the check off
    assert FORMATS["medusa"].vllm_loader(out) == {"enable_weights_track": False}
    serve = FORMATS["medusa"].serve(out, str(target_dir), 3)["vllm"]
    assert serve.endswith(""" --model-loader-extra-config '{"enable_weights_track": false}'""")
    with torch.no_grad():
        ours = our_medusa_logits(heads, feat)
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0) and torch.equal(theirs.argmax(-1), ours.argmax(-1))


# ------------------------------------------------------------------------------- draft_lm kind

@pytest.fixture(scope="module")
def lora_draft(tmp_path_factory):
    """A draft_lm checkpoint with LoRA as pipeline/methods/draft_lm.py saves it, and its verifier (same
    word tokenizer): (draft dir, verifier dir, the PEFT model)."""
    from helpers import save_word_llama, word_tokenizer
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.methods import METHODS

    root = tmp_path_factory.mktemp("hf")
    tok = word_tokenizer()
    verifier = save_word_llama(root / "verifier", tok, layers=2)
    base = AutoModelForCausalLM.from_pretrained(save_word_llama(root / "base", tok, layers=1, seed=1))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # fresh B is zero: the adapter would change nothing
    tc = SimpleNamespace(draft_lm=SimpleNamespace(lora_rank=4))
    module = SimpleNamespace(model=model, tc=tc, tokenizer=tok)
    METHODS["draft_lm"].save(module, root / "draft", {"target": str(verifier)}, 5)
    return root / "draft", verifier, model.eval()


def test_hf_export_loads_in_transformers_with_the_drafts_logits(tmp_path, lora_draft):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, verifier, peft_model = lora_draft
    out = export_draft(src, "hf", tmp_path / "out", verifier=str(verifier))
    assert not (out / draft_dir.FILE).exists() and (out / "adapter" / "adapter_config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    saved = AutoModelForCausalLM.from_pretrained(src).eval()
    ids = torch.tensor([[1, 5, 9, 3, 22, 40, 7]])
    with torch.no_grad():
        lg = exported(ids).logits
        assert torch.equal(lg, saved(ids).logits)
        assert torch.allclose(lg, peft_model(input_ids=ids).logits, atol=1e-5)  # the merge is the adapter's
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(verifier).get_vocab()
    m = json.loads((out / MANIFEST).read_text())
    assert "adapter/adapter_model.safetensors" in m["files"] and "assistant_model=" in m["serve"]["hf"]


# ------------------------------------------------------------------------------- refusals

def test_refuses_a_kind_the_format_cannot_hold(tmp_path, target_dir, capsys):
    medusa_draft(tmp_path / "medusa", target_dir)
    out = tmp_path / "out"
    refused(capsys, ["export", "--draft", str(tmp_path / "medusa"), "--format", "speculators", "--out", str(out)],
            out, r"--format speculators holds eagle3 drafts, not 'medusa': use --format medusa")
    for kind in ("eagle", "int8", "self_spec"):
        d = tmp_path / kind
        draft_dir.write_meta(d, {"kind": kind, "target": str(target_dir)})
        refused(capsys, ["export", "--draft", str(d), "--format", "eagle3", "--out", str(out)],
                out, rf"not '{kind}': no engine format holds this kind; train train.method=eagle3 \(speculators or "
                r"eagle3\), medusa \(medusa\), draft_lm \(hf\), dflash \(speculators-dflash\)")


def test_refuses_recurrent_medusa_naming_independent_heads(tmp_path, target_dir, capsys):
    medusa_draft(tmp_path / "draft", target_dir, recurrent=True)
    out = tmp_path / "out"
    refused(capsys, ["export", "--draft", str(tmp_path / "draft"), "--format", "medusa", "--out", str(out)],
            out, r"recurrent Medusa heads .* no engine format holds them; .*train\.medusa\.recurrent=false")


def test_refuses_medusa_over_a_truncated_vocabulary(tmp_path, target_dir, capsys):
    """vLLM 0.32's Medusa asserts full-vocabulary LM heads when it loads them (tried: AssertionError in
    vocab_parallel_embedding.py's weight_loader), so a token_map export would not load."""
    medusa_draft(tmp_path / "draft", target_dir, draft_ids=torch.arange(40))
    out = tmp_path / "out"
    refused(capsys, ["export", "--draft", str(tmp_path / "draft"), "--format", "medusa", "--out", str(out)],
            out, r"truncated draft vocabulary \(40 of 128 ids\) do not load in vLLM 0.32.*train\.draft_vocab_size=0")


@pytest.mark.parametrize("key,value", [("vocab_size", 100), ("num_hidden_layers", 3), ("model_type", "qwen2"),
                                       ("hidden_size", 64)])
def test_refuses_a_verifier_the_draft_was_not_trained_for(tmp_path, target_dir, capsys, key, value):
    """The verifier's config differs from the target's in one field the draft depends on."""
    other = tmp_path / "other-target"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(json.loads((target_dir / "config.json").read_text()) | {key: value}))
    out = tmp_path / "out"
    src, _ = eagle3_draft(tmp_path / "draft", target_dir)
    medusa_draft(tmp_path / "medusa", target_dir)
    for d, fmt in ((src, "speculators"), (tmp_path / "medusa", "medusa")):
        was = json.loads((target_dir / "config.json").read_text())[key]
        if fmt == "medusa" and key in ("num_hidden_layers", "model_type"):
            continue  # Medusa heads record only the hidden size and vocabulary they read
        refused(capsys, ["export", "--draft", str(d), "--format", fmt, "--out", str(out), "--verifier", str(other)],
                out, rf"was trained for a target with {key}={was!r}, but verifier .*other-target has "
                     rf"{key}={value!r}; pass the --verifier it was trained for \(.*verifier")
    src2, _ = eagle3_draft(tmp_path / "far", target_dir, aux=(0, 1, 9))
    refused(capsys, ["export", "--draft", str(src2), "--format", "speculators", "--out", str(out)],
            out, r"aux_layers \[9\] are not layers of verifier .* \(2 layers\)")


def test_refuses_an_hf_draft_whose_tokenizer_differs(tmp_path, capsys):
    from helpers import save_word_llama, word_tokenizer

    verifier = save_word_llama(tmp_path / "verifier", word_tokenizer("zz"))
    draft = save_word_llama(tmp_path / "draft", word_tokenizer("yy"), kind="draft_lm")  # same size, other words
    out = tmp_path / "out"
    refused(capsys, ["export", "--draft", str(draft), "--format", "hf", "--out", str(out), "--verifier", str(verifier)],
            out, r"its tokenizer differs from verifier .*'s \(vocab 65 vs 65\)")


def test_refuses_missing_files_targets_and_bad_arguments(tmp_path, target_dir, capsys):
    src, _ = eagle3_draft(tmp_path / "draft", target_dir)
    out = tmp_path / "out"
    argv = ["export", "--draft", str(src), "--out", str(out), "--format"]
    refused(capsys, argv + ["onnx"], out, r"unknown export format 'onnx'; use one of speculators, speculators-dflash, eagle3, medusa, hf")
    refused(capsys, argv + ["eagle3", "--k", "0"], out, r"--k 0")
    (src / "head.safetensors").unlink()
    refused(capsys, argv + ["eagle3"], out, r"has no head\.safetensors")
    refused(capsys, ["export", "--draft", str(tmp_path / "nope"), "--format", "hf", "--out", str(out)],
            out, r"draft directory .*nope does not exist")
    medusa_draft(tmp_path / "m", target_dir)
    refused(capsys, ["export", "--draft", str(tmp_path / "m"), "--format", "medusa", "--out", str(out), "--k", "4"],
            out, r"K=4 needs 4 Medusa heads, the draft has 3; pass --k 3 or fewer")
    meta = draft_dir.read_meta(tmp_path / "m")
    meta.pop("target")
    draft_dir.write_meta(tmp_path / "m", meta)
    refused(capsys, ["export", "--draft", str(tmp_path / "m"), "--format", "medusa", "--out", str(out)],
            out, r"records no target; pass --verifier")


def test_refuses_a_non_empty_out_unless_forced(tmp_path, target_dir, capsys):
    src, _ = eagle3_draft(tmp_path / "draft", target_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--draft", str(src), "--format", "eagle3", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exists and is not empty" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["export", "--draft", str(src), "--format", "eagle3", "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", MANIFEST, "model.safetensors"]
    assert main(["export", "--draft", str(src), "--format", "speculators", "--out", str(tmp_path / "empty")]) == 0


# ------------------------------------------------------------------------------- one object per format

@pytest.mark.parametrize("fmt", ["speculators", "speculators-dflash", "eagle3", "medusa", "hf"])
def test_a_format_is_one_object_that_export_and_verify_export_both_read(tmp_path, target_dir, lora_draft, fmt):
    """pipeline/formats.py: what the writer writes is what verify-export recognizes and loads it as, and the
    manifest's serve commands are the object's, with vLLM's speculative config the one verify-export runs."""
    from pipeline.formats import FORMATS as objects
    from pipeline.verify_export import infer_format, plan_export

    if fmt == "hf":
        src, verifier, _ = lora_draft
    elif fmt == "medusa":
        src, verifier = tmp_path / "draft", target_dir
        medusa_draft(src, target_dir)
    elif fmt == "speculators-dflash":
        src, verifier = dflash_draft(tmp_path / "draft", target_dir), target_dir
    else:
        src, verifier = eagle3_draft(tmp_path / "draft", target_dir)[0], target_dir
    assert FORMATS is objects and list(FORMATS) == ["speculators", "speculators-dflash", "eagle3", "medusa", "hf",
                                                    "vllm-proposer"]
    out = export_draft(src, fmt, tmp_path / "out", verifier=str(verifier), k=2)
    assert infer_format(json.loads((out / "config.json").read_text())) == fmt  # read without the manifest
    m = json.loads((out / MANIFEST).read_text())
    assert m["serve"] == FORMATS[fmt].serve(out.resolve(), str(verifier.resolve()), 2)
    p = plan_export(out)
    assert (p.format, p.k, p.source_draft) == (fmt, 2, str(src.resolve()))
    model, spec = p.vllm_load(str(verifier))
    if fmt.startswith("speculators"):  # its config.json names this verifier at K=2: `vllm serve <out>` alone
        assert (model, spec) == (str(out.resolve()), None) and m["serve"]["vllm"] == f"vllm serve {out.resolve()}"
    else:
        assert model == str(verifier) and spec == {"method": FORMATS[fmt].vllm_method, "model": str(out.resolve()),
                                                   "num_speculative_tokens": 2}
        assert json.loads(m["serve"]["vllm"].split("'")[1]) == spec
    assert set(m["serve"]) == {"vllm"} | ({"sglang"} if fmt == "eagle3" else set()) | ({"hf"} if fmt == "hf" else set())


# ------------------------------------------------------------------------------- recipe and evaluate

def test_recipe_export_section_is_checked_and_leaves_the_hash_alone():
    r = load_recipe(domain="code")
    assert r == Recipe() and r.export.formats == [] and r.export.k is None and r.evaluate.serve == "draftsmith"
    assert r.hash() == "6e56496bbbb8a0a8"  # the default recipe's hash before the export section existed
    other = load_recipe(domain="code", overrides=["export.formats=[speculators, hf]", "export.k=3",
                                                  "evaluate.serve=vllm"])
    assert other.hash() == r.hash() and other.export.formats == ["speculators", "hf"]
    for bad, msg in (("export.formats=[onnx]", f"export.formats='onnx' is not one of {sorted(FORMATS)}"),
                     ("export.formats=[hf, hf]", "names a format twice"), ("export.k=0", "export.k=0 must be > 0"),
                     ("evaluate.serve=trt", "evaluate.serve='trt' is not one of"),
                     ("export.formats=hf", "must be a list")):
        with pytest.raises(RecipeError, match=re.escape(msg)):
            load_recipe(domain="code", overrides=[bad])


def _result(name, source, speedup, tau=2.0):
    return {"name": name, "source": str(source), "speedup": speedup, "stats": {"tau": tau}}


def test_evaluate_serve_promotes_only_what_the_engine_loads(tmp_path, target_dir):
    from helpers import save_word_llama, word_tokenizer

    from pipeline.evaluate import best_exportable, promotable

    eagle3_draft(tmp_path / "e3", target_dir)
    medusa_draft(tmp_path / "ind", target_dir)
    medusa_draft(tmp_path / "rec", target_dir, recurrent=True)
    save_word_llama(tmp_path / "lm", word_tokenizer(), kind="draft_lm")
    res = [_result("e3", tmp_path / "e3", 1.2), _result("ind", tmp_path / "ind", 1.4),
           _result("rec", tmp_path / "rec", 2.0), _result("rec+ngram", f"hybrid:{tmp_path / 'rec'}", 2.5),
           _result("ind+ngram", f"hybrid:{tmp_path / 'ind'}", 2.6), _result("lm", tmp_path / "lm", 1.1)]
    names = lambda rs: [r["name"] for r in rs]  # noqa: E731
    assert promotable(res, "draftsmith") == res
    assert names(promotable(res, "vllm")) == ["e3", "ind"]  # a hybrid is our decoder's way of serving
    assert names(promotable(res, "sglang")) == ["e3"] and names(promotable(res, "hf")) == ["lm"]
    best = best_exportable(res)
    assert {e: (b["name"], b["format"]) for e, b in best.items()} == {
        "vllm": ("ind", "medusa"), "sglang": ("e3", "eagle3"), "hf": ("lm", "hf")}
    assert best_exportable(res[2:4]) == {"vllm": None, "sglang": None, "hf": None}


def test_evaluate_refuses_serve_or_formats_the_runs_kind_cannot_meet(tmp_path, target_dir, real_tokenizer):
    """Before any decoding: the run's recurrent Medusa checkpoints cannot go to vLLM nor be exported."""
    from pipeline.evaluate import EvaluateError, run_evaluate

    run = tmp_path / "run"
    (run / "prompts").mkdir(parents=True)
    (run / "prompts" / "heldout.jsonl").write_text(json.dumps({"id": "a", "prompt": "def f():"}) + "\n")
    medusa_draft(run / "train" / "checkpoint-000001", target_dir, recurrent=True)
    (run / "train" / "manifest.json").write_text(json.dumps({"checkpoints": ["checkpoint-000001"]}))
    for over, msg in ((["evaluate.serve=vllm"], r"evaluate.serve=vllm: this run's medusa checkpoints cannot be "
                                                r"served there \(recurrent Medusa heads"),
                      (["evaluate.serve=sglang"], r"sglang loads eagle3 drafts"),
                      (["export.formats=[medusa]"], r"export.formats: .*train\.medusa\.recurrent=false")):
        with pytest.raises(EvaluateError, match=msg):
            run_evaluate(load_recipe(domain="code", overrides=[f"target={target_dir}", *over]), run, target=None,
                         tokenizer=real_tokenizer)


@pytest.mark.parametrize("serve", ["vllm", "draftsmith"])
def test_evaluate_writes_the_export_with_best_and_the_report_says_how_to_serve(tmp_path, tiny_target, serve,
                                                                                real_tokenizer, one_thread):
    """A run of independent Medusa heads on the tiny target: with evaluate.serve=vllm the checkpoint is
    promoted, exported to best/export-medusa/ and the report gives vLLM's command with K; with our
    decoder the report names the best exportable candidate per engine."""
    from transformers import AutoModelForCausalLM

    from eval.heads import MedusaHeads
    from pipeline.evaluate import run_evaluate
    from pipeline.report import write_report

    target = AutoModelForCausalLM.from_pretrained(tiny_target).float().eval()
    run = tmp_path / "run"
    (run / "prompts").mkdir(parents=True)
    (run / "prompts" / "heldout.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(["def f(x):", "import os\n"])))
    ck = run / "train" / "checkpoint-000002"
    MedusaHeads.from_target(target, 2).save(ck, {"target": str(tiny_target), "step": 2})
    (run / "train" / "manifest.json").write_text(json.dumps({"checkpoints": [ck.name]}))
    recipe = load_recipe(domain="code", overrides=[
        f"target={tiny_target}", "dtype=float32", "device=cpu", "evaluate.n_prompts=2", "evaluate.max_new_tokens=6",
        "evaluate.fp32_prompts=1", "evaluate.hybrid=false", "evaluate.baselines=false", f"evaluate.serve={serve}",
        "export.formats=[medusa]"])
    metrics = run_evaluate(recipe, run, target, real_tokenizer)
    assert metrics["serve"] == serve and metrics["checkpoint"] == ck.name
    m = json.loads((run / "best" / "export-medusa" / MANIFEST).read_text())
    assert m["k"] == 2 and m["verifier"] == str(tiny_target.resolve()) and m["source"] == str((run / "best").resolve())
    assert metrics["exports"] == {"medusa": {"dir": "best/export-medusa", "k": 2, "serve": m["serve"]}}
    assert metrics["best_exportable"]["vllm"]["name"] == ck.name and metrics["best_exportable"]["sglang"] is None
    report = write_report(run).read_text()
    assert m["serve"]["vllm"] in report and '"num_speculative_tokens": 2' in report
    assert ("Promoted for **vllm**" in report) == (serve == "vllm")
    assert (f"`{ck.name}`, speedup" in report) == (serve == "draftsmith")


# ------------------------------------------------------------------------------- evaluate.engine_rank

def test_engine_rank_recipe_keys_are_checked_and_change_no_key():
    from pipeline.measure import evaluate_settings

    base = load_recipe(domain="code")
    on = load_recipe(domain="code", overrides=["evaluate.serve=vllm", "evaluate.engine_rank=true",
                                               "evaluate.engine_methods=[suffix]", "evaluate.engine_batch_sizes=[1, 16]",
                                               "evaluate.engine_lookup_k=24"])
    assert on.hash() == base.hash() and evaluate_settings(on) == evaluate_settings(base)  # no measurement is redone
    for bad, msg in ((["evaluate.engine_rank=true"], "set evaluate.serve=vllm"),
                     (["evaluate.serve=vllm", "evaluate.engine_methods=[eagle3]"], "give 'ngram:K' (K > 0) or 'suffix'"),
                     (["evaluate.serve=vllm", "evaluate.engine_methods=[ngram:0]"], "'ngram:0' is not one of"),
                     (["evaluate.engine_batch_sizes=[]"], "must list batch sizes >= 1"),
                     (["evaluate.engine_candidates=0"], "evaluate.engine_candidates=0 must be > 0"),
                     (["evaluate.engine_lookup_k=0"], "evaluate.engine_lookup_k=0 must be > 0")):
        with pytest.raises(RecipeError, match=re.escape(msg)):
            load_recipe(domain="code", overrides=bad)


def _row(name, kind, b, tps, fmt=None, k=None, **kw):
    return {"name": name, "kind": kind, "format": fmt, "k": k, "batch_size": b, "tokens_per_s": tps,
            "mean_acceptance_length": 2.0, "acceptance_per_pos": [], "identical_to_plain": 4, "n_prompts": 4, **kw}


def test_engine_ranking_promotes_the_most_tokens_per_s_at_the_first_batch_size():
    from pipeline.engine_rank import markdown, with_ratios

    rows = [_row("plain", "plain", 1, 100.0), _row("plain", "plain", 16, 400.0),
            _row("ngram:4", "engine", 1, 150.0), _row("ngram:4", "engine", 16, 380.0),
            _row("suffix", "engine", 1, 160.0), _row("suffix", "engine", 16, 300.0),
            _row("ck-2", "candidate", 1, 170.0, "speculators", 2), _row("ck-2", "candidate", 16, 500.0, "speculators", 2),
            _row("ck-2:datastore", "candidate", 1, 180.0, "vllm-proposer", 8),
            _row("ck-2:datastore", "candidate", 16, 420.0, "vllm-proposer", 8),
            {"name": "ck-1", "kind": "candidate", "format": "speculators", "k": 2, "error": "ValueError: no"}]
    t = with_ratios({"engine": "vllm", "vllm_version": "0.32.0", "n_prompts": 4, "max_new_tokens": 8,
                     "dtype": "bfloat16", "methods": ["ngram:4", "suffix"], "batch_sizes": [1, 16],
                     "sampling": None, "rows": rows})
    assert t["winner"] == "ck-2:datastore" and t["best_engine_method"] == "suffix"  # batch 1 ranks, not batch 16
    by = {(r["name"], r.get("batch_size")): r for r in t["rows"]}
    assert by["ck-2:datastore", 1]["vs_best_engine_method"] == pytest.approx(180 / 160)
    assert by["ck-2", 16]["vs_best_engine_method"] == pytest.approx(500 / 380)  # ngram is vLLM's best at 16
    assert by["ck-2", 16]["vs_plain"] == pytest.approx(500 / 400)
    md = "\n".join(markdown(t))
    assert "| **ck-2:datastore** | vllm-proposer | 8 | 1 | 180.0 | 1.80× | 1.12× | 2.00 |" in md
    assert "| ck-1 | speculators | 2 | - | failed: ValueError: no |" in md
    assert "| plain | vLLM | - | 1 | 100.0 | 1.00× | 0.62× | - |" in md and "ran faster than every" not in md
    none_ran = with_ratios({**t, "rows": [_row("plain", "plain", 1, 100.0), rows[-1]]})
    assert none_ran["winner"] is None and "none of the candidates ran" in markdown(none_ran)[0]
    slower = with_ratios({**t, "rows": [r for r in rows if r["name"] != "ck-2:datastore"]})
    assert slower["winner"] == "ck-2" and "ran faster than every" not in markdown(slower)[0]
    beaten = with_ratios({**t, "rows": [_row("suffix", "engine", 1, 200.0), *rows[6:]]})
    assert "vLLM's own suffix ran faster than every candidate here (ck-2:datastore is 0.90× it)" in markdown(beaten)[0]
    sampled = with_ratios({**t, "rows": [_row("plain", "plain", 1, 100.0), _row("suffix", "engine", 1, 97.0),
                                         _row("ck-2:datastore", "candidate", 1, 94.0, "vllm-proposer", 8)]})
    assert "vLLM without speculation ran faster than every speculative method here (ck-2:datastore is 0.94× it)" \
        in markdown(sampled)[0]


def test_engine_candidates_are_the_fastest_exportable_checkpoints_and_the_datastore(tmp_path, target_dir):
    import numpy as np

    from pipeline.evaluate import engine_candidates

    for n in ("a", "b", "c"):
        eagle3_draft(tmp_path / n, target_dir)
    np.save(tmp_path / "b" / "datastore.npy", np.arange(8, dtype=np.int32))
    res = [_result("a", tmp_path / "a", 1.1), _result("b", tmp_path / "b", 1.3), _result("c", tmp_path / "c", 1.2),
           _result("b+ngram", f"hybrid:{tmp_path / 'b'}", 2.0)]
    cfg = load_recipe(domain="code", overrides=["evaluate.serve=vllm", "evaluate.engine_rank=true",
                                                "evaluate.engine_candidates=2"]).evaluate
    got = [(c.name, c.format, c.result["name"], c.k) for c in engine_candidates(cfg, res, res[1], 2, 8)]
    assert got == [("b", "speculators", "b", 2), ("c", "speculators", "c", 2), ("b:datastore", "vllm-proposer", "b", 8)]
    assert [c.name for c in engine_candidates(cfg, res, res[0], 2, 8)] == ["b", "c"]  # a holds no datastore


def test_a_cached_engine_ranking_is_keyed_by_the_shipped_lookups_rule(tmp_path, target_dir, monkeypatch):
    """The datastore proposer's rule ships with draftsmith, not with the checkpoint: a ranking measured under
    another rule is measured again, while a checkpoint's own format (speculators) is keyed by its files."""
    import dataclasses

    import numpy as np

    from pipeline import evaluate, formats
    from pipeline.engine_rank import EngineSettings
    from pipeline.engines.draftsmith_vllm import lookup

    eagle3_draft(tmp_path / "b", target_dir)
    np.save(tmp_path / "b" / "datastore.npy", np.arange(8, dtype=np.int32))
    res = [_result("b", tmp_path / "b", 1.3)]
    cfg = load_recipe(domain="code", overrides=["evaluate.serve=vllm", "evaluate.engine_rank=true"]).evaluate
    cands = evaluate.engine_candidates(cfg, res, res[0], 2, 16)
    s = EngineSettings(str(target_dir), [[1, 2]], None, 8, "float32", ["suffix"], [1], None)
    key = evaluate.ranking_key(s, cands)
    assert key["candidates"]["b:datastore"][-1] == lookup.RULE and len(key["candidates"]["b"]) == 3
    bumped = dict(formats.FORMATS, **{"vllm-proposer": dataclasses.replace(formats.FORMATS["vllm-proposer"],
                                                                           revision="another-rule")})
    monkeypatch.setattr(evaluate, "FORMATS", bumped)
    again = evaluate.ranking_key(s, cands)
    assert again["candidates"]["b"] == key["candidates"]["b"] and again["candidates"]["b:datastore"] != key["candidates"]["b:datastore"]


def test_evaluate_engine_rank_is_refused_before_decoding_without_the_engine_or_a_candidate(
        tmp_path, target_dir, real_tokenizer, monkeypatch):
    """No engine python: one line naming `make engines`. Recurrent Medusa heads, which vLLM cannot load, are
    refused unless the checkpoint holds a datastore (the datastore proposer is then vLLM's candidate)."""
    import numpy as np

    from pipeline.engines.vllm import ENGINE_ENV
    from pipeline.evaluate import EvaluateError, check_exports

    ck = tmp_path / "train" / "checkpoint-000001"
    medusa_draft(ck, target_dir, recurrent=True)
    on = load_recipe(domain="code", overrides=["evaluate.serve=vllm", "evaluate.engine_rank=true"])
    monkeypatch.setenv(ENGINE_ENV, str(tmp_path / "nope" / "python"))
    with pytest.raises(EvaluateError, match=r"evaluate.engine_rank=true: no vLLM engine environment .*make engines"
                                            r".*or set evaluate.engine_rank=false") as e:
        check_exports(on, [ck])
    assert "\n" not in str(e.value)
    monkeypatch.setenv(ENGINE_ENV, sys.executable)
    with pytest.raises(EvaluateError, match="recurrent Medusa heads"):
        check_exports(on, [ck])
    np.save(ck / "datastore.npy", np.arange(8, dtype=np.int32))
    check_exports(on, [ck])
    with pytest.raises(EvaluateError, match="recurrent Medusa heads"):  # without engine ranking it is not a candidate
        check_exports(load_recipe(domain="code", overrides=["evaluate.serve=vllm"]), [ck])


def test_an_out_that_holds_the_draft_is_refused_even_with_force(tmp_path):
    """--out the draft itself, or a directory above it: --force would rename it away and delete it with the
    draft inside, so it is refused in one line first; a sibling directory is fine."""
    from pipeline.export import ExportError, check_out

    src = tmp_path / "runs" / "best"
    src.mkdir(parents=True)
    (src / "head.safetensors").write_bytes(b"x")
    for out in (src, tmp_path / "runs", tmp_path / "runs" / "best" / ".."):
        with pytest.raises(ExportError, match="holds the draft"):
            check_out(out, True, src)
    check_out(tmp_path / "runs" / "export", True, src)
    assert (src / "head.safetensors").read_bytes() == b"x"
