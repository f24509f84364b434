"""The decoder on CUDA (tests marked `gpu`, skipped without a device) and what of its GPU path runs on CPU.

Every device-parametrized test runs on CPU in `make test` and, where a GPU is lent, on CUDA (`pytest -m gpu`),
so the CUDA run only has to confirm what the CPU run already shows:
- plain greedy decoding on the device equals HF `generate` on the CPU (fp32, token for token), with the lean
  forward and with the HF fallback;
- chains (n-gram, a draft LM, the target as its own draft, EAGLE, Medusa heads) and token trees (hybrids over
  a draft LM, EAGLE and Medusa with its runner-up paths) equal that plain output, at batch 1 and ragged;
- speculative sampling passes the chi-square test of tests/test_sampling.py, and the test has the power to
  fail (a wrong residual);
- the compiled step (`compile=True`, torch.compile of the chain round's forward) gives eager's greedy tokens:
  on CPU under inductor here (slow to compile: a few shapes only), every proposer on CUDA;
- on CUDA no CPU kernel (eval/kernels.py) is called, and the embedded target decodes exactly (fp32) or up
  to near-ties (bf16).
"""

import pytest
import torch

import eval.cpu
import eval.decoder as D
import eval.int8
import eval.target
from eval import bench
from eval.decoder import SpeculativeDecoder
from eval.heads import EagleHead, MedusaHeads
from eval.proposers import DraftLMProposer, EagleProposer, HybridProposer, MedusaProposer, NgramProposer, load_proposer

from helpers import DECODER_V as V, N_NEW, PROMPTS, decoder_llama, e2e_pvalues, perturbed_recurrent_heads
from helpers import sampling_llama, wrong_residual

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


@pytest.fixture(scope="module", params=["cpu", CUDA])
def device(request):
    return torch.device(request.param)


@pytest.fixture(scope="module")
def hf_ref():
    """HF generate's greedy continuations of PROMPTS by the fp32 target, on the CPU: the reference."""
    t = decoder_llama(0)
    return [t.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]


@pytest.fixture(scope="module")
def target(device):
    return decoder_llama(0).to(device)


@pytest.fixture(scope="module")
def draft(device):
    return decoder_llama(1, layers=1, hidden=32, heads=2, kv=1).to(device)


def chain_proposer(name, target, draft):
    ids = torch.arange(0, V, 2)  # a truncated draft vocabulary (every other id)
    if name == "ngram":
        return NgramProposer()
    if name == "draft_lm":
        return DraftLMProposer(draft, V)
    if name == "self":  # the target as its own draft: every draft accepted
        return DraftLMProposer(target, V)
    if name == "eagle":
        return EagleProposer(EagleHead.from_target(target, draft_ids=ids), target)
    if name == "medusa":
        return MedusaProposer(MedusaHeads.from_target(target, 3, draft_ids=ids), target)
    assert name == "medusa_rec"
    return MedusaProposer(perturbed_recurrent_heads(target), target)


def tree_proposer(name, target, draft):
    """A hybrid (n-gram lookups, the model's chain and, for Medusa, its runner-up paths in one tree)."""
    model = chain_proposer(name, target, draft)
    return HybridProposer(model, min_match=1, k_ngram=6)


CHAINS = ["ngram", "draft_lm", "self", "eagle", "medusa", "medusa_rec"]
TREES = ["draft_lm", "eagle", "medusa_rec"]


def decode_all(dec, prompts=PROMPTS, **kw):
    """Each prompt alone, then all of them as one ragged batch -> (batch-1 outputs, batched outputs, stats)."""
    one = [dec.generate([p], max_new_tokens=N_NEW, **kw).sequences[0] for p in prompts]
    res = dec.generate(prompts, max_new_tokens=N_NEW, **kw)
    return one, res.sequences, res.stats


# ---------------------------------------------------------------- greedy exactness on the device

def test_plain_matches_hf_generate_on_cpu(device, target, hf_ref):
    one, batched, stats = decode_all(SpeculativeDecoder(target, None))
    assert one == hf_ref and batched == hf_ref
    assert stats["proposed"] == 0 and stats["peak_mem_bytes"] > 0


@pytest.mark.parametrize("name", CHAINS)
def test_chains_equal_plain(device, target, draft, hf_ref, name):
    dec = SpeculativeDecoder(target, chain_proposer(name, target, draft), k=3, tree=False)
    one, batched, stats = decode_all(dec)
    assert one == hf_ref and batched == hf_ref, name
    assert stats["proposed"] > 0 and stats["tree_rounds"] == 0
    if name == "self":
        assert stats["alpha"] == 1.0


@pytest.mark.parametrize("name", TREES)
def test_trees_equal_plain(device, target, draft, hf_ref, name):
    dec = SpeculativeDecoder(target, tree_proposer(name, target, draft), k=3)
    one, batched, stats = decode_all(dec)
    assert one == hf_ref and batched == hf_ref, name
    assert stats["tree_rounds"] > 0 and stats["accepted"] > 0


@pytest.mark.parametrize("name", ["plain", "ngram", "draft_lm"])
def test_hf_fallback_equals_plain(device, target, draft, hf_ref, name):
    """The HF path (the model's own forward over our slot cache and masks: targets outside the lean table),
    batch 1; the draft LM on the HF path too."""
    prop = {"plain": None, "ngram": NgramProposer(), "draft_lm": DraftLMProposer(draft, V, lean=False)}[name]
    dec = SpeculativeDecoder(target, prop, k=3, lean=False)
    assert dec.runner.path == "hf" and dec.runner.trees
    assert [dec.generate([p], max_new_tokens=N_NEW).sequences[0] for p in PROMPTS] == hf_ref


def test_k_auto_equals_plain(device, target, draft, hf_ref):
    """k="auto" mixes plain rounds, resyncs and speculative rounds of varying K in one call."""
    one, batched, stats = decode_all(SpeculativeDecoder(target, chain_proposer("eagle", target, draft), k="auto"))
    assert one == hf_ref and batched == hf_ref
    assert 0 in stats["k_choices"] and max(stats["k_choices"]) > 0


# ---------------------------------------------------------------- lossless sampling on the device

WARPS = {"t1": dict(temperature=1.0), "warped": dict(temperature=0.7, top_k=12, top_p=0.9)}
SAMPLED = [("plain", "warped"), ("draft_lm", "t1"), ("ngram", "t1"), ("eagle", "t1"), ("hybrid", "warped")]
CPU_SAMPLED = {("draft_lm", "t1")}  # the rest run on CPU in tests/test_sampling.py


def sampling_proposer(kind, target):
    draft = sampling_llama(1, layers=1, init=0.3).to(target.device)
    if kind == "plain":
        return None
    if kind == "draft_lm":
        return DraftLMProposer(draft, target.config.vocab_size)
    if kind == "ngram":
        return NgramProposer()
    if kind == "eagle":
        return EagleProposer(EagleHead.from_target(target), target)
    assert kind == "hybrid"  # one-hot lookup rounds mixed with sampled draft-LM rounds
    return HybridProposer(DraftLMProposer(draft, target.config.vocab_size), min_match=1)


@pytest.fixture(scope="module")
def sampling_target(device):
    return sampling_llama(0).to(device)


@pytest.mark.parametrize("kind,warp", SAMPLED)
def test_sampling_matches_target(device, sampling_target, kind, warp):
    if device.type == "cpu" and (kind, warp) not in CPU_SAMPLED:
        pytest.skip("runs on CPU in tests/test_sampling.py")
    pv, stats = e2e_pvalues(sampling_target, sampling_proposer(kind, sampling_target), WARPS[warp])
    if kind != "plain":
        assert stats["proposed"] > 0 and 0 < stats["alpha"] < 1  # drafts were both accepted and rejected
    assert min(pv) > 1e-4, pv


def test_sampling_test_catches_a_wrong_residual(device, sampling_target, monkeypatch):
    monkeypatch.setattr(D, "residual", wrong_residual)
    pv, _ = e2e_pvalues(sampling_target, sampling_proposer("draft_lm", sampling_target), WARPS["t1"])
    assert min(pv) < 1e-6, pv


# ---------------------------------------------------------------- the compiled step

# CPU: inductor compiles each shape in seconds to tens of seconds, so a few: plain rounds (T = 1) at batch
# 1, a draft LM's chain (T = k + 1) at batch 1 and ragged. CUDA: every chain proposer (n-gram's runs vary
# in length, so it compiles several shapes).
CPU_COMPILED = {("plain", 1), ("draft_lm", 1), ("draft_lm", 2)}


def _skip_where_inductor_is_wrong(device, target):
    """Under an emulated smaller CPU (ATEN_CPU_CAPABILITY below the CPU's) the compiled step is refused in one
    line, since inductor computes wrong values there (eval.cpu.inductor_refusal): check that, then skip."""
    refusal = eval.cpu.inductor_refusal(device)
    if refusal:
        with pytest.raises(ValueError, match="computes wrong values"):
            SpeculativeDecoder(target, None, k=2, compile=True)
        pytest.skip(refusal)


@pytest.fixture
def one_compile_thread():
    """Inductor compiles in this process: a worker pool costs more than it saves on the tiny graphs here."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


@pytest.mark.parametrize("name", ["plain", "draft_lm", "self", "ngram", "eagle", "medusa_rec"])
def test_compiled_step_equals_eager(device, target, draft, hf_ref, name, one_compile_thread):
    cases = [b for b in (1, 2) if device.type == "cuda" or (name, b) in CPU_COMPILED]
    if not cases:
        pytest.skip("compiles on CUDA only (inductor on CPU takes too long for every proposer)")
    _skip_where_inductor_is_wrong(device, target)
    prop = None if name == "plain" else chain_proposer(name, target, draft)
    dec = SpeculativeDecoder(target, prop, k=2, compile=True)
    eager = SpeculativeDecoder(target, prop, k=2)
    assert dec.static and not dec.tree and dec.static_len == 0
    for b in cases:  # batch 1: the first prompt; 2: the first two, ragged
        out = dec.generate(PROMPTS[:b], max_new_tokens=N_NEW)
        assert out.sequences == eager.generate(PROMPTS[:b], max_new_tokens=N_NEW).sequences == hf_ref[:b], (name, b)
        assert out.stats["proposed"] > 0 or name == "plain"
    assert dec.static_len == D.STATIC_MIN_LEN  # every call here fits the shortest static cache


def test_compiled_step_serves_evaluate(hf_ref, one_compile_thread):
    """evaluate.compile reaches the decoder through pipeline.measure (CPU; the shapes of the test above)."""
    from pipeline.measure import decode_pairs

    t, d = decoder_llama(0), decoder_llama(1, layers=1, hidden=32, heads=2, kv=1)
    _skip_where_inductor_is_wrong(torch.device("cpu"), t)
    plain, _, spec, stats = decode_pairs(t, chain_proposer("draft_lm", t, d), PROMPTS[:1], 2, N_NEW, None,
                                         "compiled", compile=True)
    assert plain == spec == hf_ref[:1] and stats["proposed"] > 0


@pytest.mark.gpu
def test_compiled_step_samples_losslessly(one_compile_thread):
    t = sampling_llama(0).cuda()
    pv, stats = e2e_pvalues(t, sampling_proposer("draft_lm", t), WARPS["t1"], compile=True)
    assert stats["proposed"] > 0 and min(pv) > 1e-4, pv


def test_inductor_is_refused_only_under_a_capped_capability(monkeypatch):
    avx512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    monkeypatch.setattr(eval.cpu, "cpu_info", lambda: ("test cpu", avx512))
    for cap, refused in (("AVX512", False), ("AVX2", True), ("DEFAULT", True)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap)
        assert bool(eval.cpu.inductor_refusal("cpu")) is refused, cap
        assert eval.cpu.inductor_refusal("cuda") is None
    monkeypatch.setattr(eval.cpu, "cpu_info", lambda: ("test cpu", frozenset({"avx2", "fma"})))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert eval.cpu.inductor_refusal("cpu") is None  # AVX2 on an AVX2-only CPU: its own capability


def test_compile_refuses_the_hf_fallback():
    with pytest.raises(ValueError, match="compile=True needs the lean forward"):
        SpeculativeDecoder(decoder_llama(0), None, lean=False, compile=True)


# ---------------------------------------------------------------- the CUDA path itself

class _CpuKernels:
    """Stands in for eval.kernels.small_gemm()'s module: calling any of its kernels fails the test."""

    def __getattr__(self, name):
        def called(*a, **kw):
            raise AssertionError(f"the CPU kernel {name} was called on the CUDA path")
        return called


@pytest.mark.gpu
def test_cuda_path_calls_no_cpu_kernel(hf_ref, monkeypatch):
    for mod in (eval.target, eval.int8):
        monkeypatch.setattr(mod, "small_gemm", lambda: _CpuKernels())
    t, d = decoder_llama(0).cuda(), decoder_llama(1, layers=1, hidden=32, heads=2, kv=1).cuda()
    props = [None, load_proposer("int8", t)] + [chain_proposer(n, t, d) for n in CHAINS] \
        + [tree_proposer(n, t, d) for n in TREES]
    for prop in props:
        dec = SpeculativeDecoder(t, prop, k=3)
        assert dec.runner.attend is None and dec.runner.ew is None and not dec.runner.row_invariant
        assert dec.generate(PROMPTS, max_new_tokens=N_NEW).sequences == hf_ref, prop
        assert dec.runner.K.device.type == "cuda"


CODE_PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                "def is_palindrome(s: str) -> bool:\n", "class Stack:\n    def __init__(self):\n"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedded_target_on_cuda(embedded_dir, real_tokenizer, dtype, one_compile_thread):
    """The real target (SmolLM2-135M-Instruct): chains, trees and the compiled step against plain decoding,
    exact in fp32; in bf16 (ATen's kernels on CUDA are not row-invariant) every divergence must be a
    near-tie (eval.exactness)."""
    from transformers import AutoModelForCausalLM

    from eval.exactness import compare_greedy

    t = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=getattr(torch, dtype)).cuda().eval()
    prompts, eos = [real_tokenizer(x)["input_ids"] for x in CODE_PROMPTS], real_tokenizer.eos_token_id
    plain = SpeculativeDecoder(t, None).generate(prompts, max_new_tokens=48, eos_token_id=eos).sequences
    decs = {"ngram": SpeculativeDecoder(t, "ngram", k=4, tree=False),
            "int8": SpeculativeDecoder(t, "int8", k=3, tree=False),
            "hybrid_int8": SpeculativeDecoder(t, HybridProposer(load_proposer("int8", t), min_match=1), k=3),
            "compiled_int8": SpeculativeDecoder(t, "int8", k=3, compile=True)}
    for name, dec in decs.items():
        for p, ref in zip(prompts, plain):
            res = dec.generate([p], max_new_tokens=48, eos_token_id=eos)
            if dtype == "float32":
                assert res.sequences == [ref], name
            else:
                r = compare_greedy(t, [p], [ref], res.sequences)
                assert r["exact"] or r["all_near_ties"], (name, r["divergences"])
        assert res.stats["proposed"] > 0, name
    batched = decs["int8"].generate(prompts, max_new_tokens=48, eos_token_id=eos).sequences
    if dtype == "float32":
        assert batched == plain


# ---------------------------------------------------------------- reaching the compiled step and the device

def test_bench_device_cuda_without_a_gpu_fails_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2"}\n')
    assert bench.main(["--draft", "ngram", "--prompts", str(prompts), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("draftsmith: error: --device cuda: no CUDA device here") and "\n" not in err


def test_bench_compile_reaches_the_decoder():
    args = bench.build_parser().parse_args(["--draft", "ngram", "--prompts", "p.jsonl", "--compile"])
    assert args.compile and args.device == "auto"
    if eval.cpu.inductor_refusal("cpu"):  # an emulated smaller CPU: refused in one line (_skip_where_inductor_is_wrong)
        with pytest.raises(bench.BenchError, match="--compile: torch.compile on CPU computes wrong values"):
            bench.our_decoder(args, decoder_llama(0), "ngram", k=2)
    else:
        assert bench.our_decoder(args, decoder_llama(0), "ngram", k=2).static  # torch.compile is lazy
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(bench.BenchError, match="--compile: compile=True needs the lean"):
        bench.our_decoder(args, gpt2, None)
    args = bench.build_parser().parse_args(["--draft", "ngram", "--prompts", "p.jsonl"])
    assert not bench.our_decoder(args, decoder_llama(0), None).static


def test_evaluate_compile_is_a_checked_recipe_key():
    from pipeline.config import Recipe, RecipeError, recipe_from_dict

    assert Recipe().evaluate.compile is False
    assert recipe_from_dict({}, ["evaluate.compile=true"]).evaluate.compile is True
    with pytest.raises(RecipeError, match="evaluate.compile"):
        recipe_from_dict({}, ["evaluate.compile=fast"])
