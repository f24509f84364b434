"""The lean target forward's CPU kernels: packed oneDNN weights and the native GEMV must give the same
numbers as plain F.linear, the oneDNN switch must be restored whatever happens, and the bf16 forward
(float32 K/V cache and attention on CPU) must agree with HF's own forward."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from eval.cpu import GEMV_MAX_ROWS, can_pack, cpu_gemv, greedy_argmax, packed_linear
from eval.target import LeanLlama

CPU = torch.device("cpu")

pytestmark = pytest.mark.cpu_paths


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_gemv_block", [True, False])
def test_packed_linear_is_bit_identical_to_f_linear(rows, bias, in_gemv_block, monkeypatch):
    import eval.cpu as cpu

    generic = cpu.decide({cpu.ENV_KERNELS: "0"})  # the oneDNN/GEMV routes (the kernels: test_kernels.py)
    monkeypatch.setattr(cpu, "cpu_path", lambda: generic)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(1, rows, 64, generator=g).to(torch.bfloat16)
    lin = packed_linear(w, b)
    want = F.linear(x, w, b)
    if not can_pack(w):  # oneDNN's bf16 packing needs avx512bw/vl/dq or avx_ne_convert: the generic path's F.linear
        assert not generic.onednn_bf16 and lin.func is F.linear and torch.equal(lin(x), want)
        return
    assert lin.func is not F.linear  # the packed callable, not the plain F.linear
    if in_gemv_block:
        with cpu_gemv(rows, CPU):  # as LeanLlama calls it: the native GEMV for <= 2 rows
            got = lin(x)
    else:  # oneDNN left on (a prefill's one-row LM head): the packed weight at any row count
        got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want)


def test_fp32_weights_are_not_packed():
    w = torch.randn(8, 4)
    assert packed_linear(w).func is F.linear


def test_cpu_gemv_sets_restores_and_nests():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this build")
    assert torch._C._get_mkldnn_enabled()
    with cpu_gemv(1, CPU):
        assert not torch._C._get_mkldnn_enabled()  # one row: native GEMV
        with cpu_gemv(GEMV_MAX_ROWS + 1, CPU):
            assert torch._C._get_mkldnn_enabled()  # a multi-token forward inside a one-row propose
        assert not torch._C._get_mkldnn_enabled()
    assert torch._C._get_mkldnn_enabled()
    with pytest.raises(RuntimeError):
        with cpu_gemv(1, CPU):
            raise RuntimeError("boom")
    assert torch._C._get_mkldnn_enabled()  # restored after an exception too


def _tiny(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def test_bf16_forward_agrees_with_hf():
    model = _tiny(torch.bfloat16)
    runner = LeanLlama(model)
    runner.reset(1, 64)
    # CPU: fp32 attention over a bf16 cache where the project's kernel attends, a float32 cache elsewhere
    assert runner.caches[0].k.dtype == (torch.bfloat16 if runner.attend is not None else torch.float32)
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.float()  # HF: bf16 attention, unpacked matmuls
        got, _ = runner(ids, torch.arange(24)[None], 24)  # prefill: 24 rows, packed weights
        step, _ = runner(ids[:, -1:], torch.tensor([[23]]), 24)  # decode: one row, native GEMV
    assert (got.float() - want).abs().max() < 0.05
    assert (step.float()[0, -1] - want[0, -1]).abs().max() < 0.05


def test_a_bf16_cache_gives_a_float32_caches_numbers():
    """Under the attention kernel a bf16 model's K/V cache is bf16: k and v are bf16 values that the kernel
    widens exactly, so a prefill, one-token steps at batch 2, a verify and a tree equal a float32 cache's
    forwards bit for bit (logits and features), and the caches hold the same values."""
    model = _tiny(torch.bfloat16)
    runners = {"bf16": LeanLlama(model), "fp32": LeanLlama(model)}
    if runners["bf16"].attend is None:
        pytest.skip("this CPU path has no attention kernel: the cache stays float32")
    runners["fp32"].cache_dtype = torch.float32  # the layout the kernel reads besides bf16
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(4))
    out = {}
    with torch.no_grad():
        for name, r in runners.items():
            r.reset(2, 64)
            ar = lambda a, b: torch.arange(a, b)[None].expand(2, -1)  # noqa: E731
            res = [r(ids[:, :24], ar(0, 24), 24)]  # prefill: SDPA over the widened cache
            res += [r(ids[:, t:t + 1], ar(t, t + 1), t + 1) for t in range(24, 27)]  # batch-2 steps
            res.append(r(ids[:, 27:31], ar(27, 31), 31))  # a verify of 4 tokens a row
            mask = torch.zeros(2, 1, 3, 34, dtype=torch.bool)  # a tree: nodes 32 and 33 both after 31
            mask[..., :31] = True
            for j, anc in enumerate([[0], [0, 1], [0, 2]]):
                mask[:, 0, j, [31 + a for a in anc]] = True
            res.append(r(ids[:, 31:34], torch.tensor([[31, 32, 32]] * 2), 34, slots=ar(31, 34), mask=mask))
            out[name] = (res, r.K[:, :, :, :34].float(), r.V[:, :, :, :34].float())
    assert runners["bf16"].K.dtype == torch.bfloat16 and runners["fp32"].K.dtype == torch.float32
    for (la, fa), (lb, fb) in zip(out["bf16"][0], out["fp32"][0]):
        assert torch.equal(la, lb) and torch.equal(fa, fb)
    assert torch.equal(out["bf16"][1], out["fp32"][1]) and torch.equal(out["bf16"][2], out["fp32"][2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_row_does_not_attend_past_its_position(dtype):
    """A one-row step over more slots than its position needs (the decoder's s_len counts rows that finished
    longer) sees only slots 0..pos: what lies past them (another row's tokens, stale K/V) changes nothing."""
    r = LeanLlama(_tiny(dtype))
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        r.reset(1, 64)  # a fresh cache: zeros past the prompt
        r(ids[:, :20], torch.arange(20)[None], 20)
        want, _ = r(ids[:, 20:21], torch.tensor([[20]]), 40)
        r.reset(1, 64)
        r(ids[:, :20], torch.arange(20)[None], 20)
        r(ids[:, 21:], torch.arange(21, 40)[None], 40)  # slots 21..39 now hold K/V the step must not see
        got, _ = r(ids[:, 20:21], torch.tensor([[20]]), 40)
    assert torch.equal(got, want)


def test_reset_allocates_the_cache_again_when_its_dtype_changes():
    """A runner whose cache dtype is switched (eval.cpu_bench's float32-cache turns share one runner's packed
    weights) gets a cache of the new dtype from reset(), though the old one's shape would fit."""
    r = LeanLlama(_tiny(torch.bfloat16))
    r.reset(2, 64)
    other = torch.float32 if r.cache_dtype == torch.bfloat16 else torch.bfloat16
    r.cache_dtype = other
    r.reset(2, 32)
    assert r.K.dtype == r.V.dtype == other and all(c.k.dtype == c.v.dtype == other for c in r.caches)
    kept = r.K
    r.reset(2, 24)
    assert r.K is kept  # same dtype, a shape that fits: the allocation is reused


def test_fp32_forward_equals_hf():
    model = _tiny(torch.float32)
    runner = LeanLlama(model)
    runner.reset(2, 64)
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        got, _ = runner(ids, torch.arange(20)[None].expand(2, -1), 20)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_argmax_is_argmax_with_first_index_on_ties(dtype):
    x = torch.randn(3, 5, 1000, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[0, 0, [10, 700]] = 50.0  # a tie: the first index wins, as with argmax
    x[2, 4, [999, 3]] = 60.0
    assert torch.equal(greedy_argmax(x), x.argmax(-1))
    assert greedy_argmax(x)[0, 0] == 10 and greedy_argmax(x)[2, 4] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_move_copies_every_layers_slots_reading_before_writing(B, dtype):
    """runner.move(src, dst) copies slots src -> dst in every layer's K and V (one op over the stacked
    cache), with all reads before any write: a destination may be another pair's source. The kernel's
    copy (where the kernels run) and ATen's indexed copy agree, also on a batch's kept rows (a view)."""
    r = LeanLlama(_tiny(dtype))
    copies = [r.move_slots, None] if r.move_slots is not None else [None]
    src = torch.tensor([[7, 9, 10], [4, 6, 5], [1, 2, 3]])
    dst = torch.tensor([[5, 6, 7], [3, 4, 5], [2, 3, 4]])  # 7 (row 0) and 4, 5 (row 1) are read and written
    for keep in (False, True):
        results = []
        for copy in copies:
            r.move_slots = copy
            r.reset(B + keep, 16)
            torch.manual_seed(0)
            r.K.normal_(), r.V.normal_()
            if keep:  # rows 1.. stay, a view of the first B + 1 rows' cache
                r.keep(list(range(1, B + 1)), 16)
            before_k, before_v = r.K.clone(), r.V.clone()
            r.move(src[:B], dst[:B])
            for b in range(B):
                want_k, want_v = before_k[:, b].clone(), before_v[:, b].clone()
                want_k[:, :, dst[b]], want_v[:, :, dst[b]] = before_k[:, b][:, :, src[b]], before_v[:, b][:, :, src[b]]
                assert torch.equal(r.K[:, b], want_k) and torch.equal(r.V[:, b], want_v)
            for layer, c in enumerate(r.caches):  # the per-layer caches the forward writes are views of K and V
                assert c.k.data_ptr() == r.K[layer].data_ptr() and c.v.data_ptr() == r.V[layer].data_ptr()
            results.append((r.K.clone(), r.V.clone()))
        assert all(torch.equal(k, results[0][0]) and torch.equal(v, results[0][1]) for k, v in results)


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_llama_shaped_models_outside_the_table_take_the_hf_path(family):
    """Granite and Cohere have Llama-like modules but scale what Llama does not (Granite: embeddings,
    residuals, attention and logits; Cohere: LayerNorm, logits): the table of families (LEAN_FAMILIES),
    not the module layout, gives the lean forward, and the HF path's logits are the model's own."""
    import transformers as tf

    from eval.family import lean_supported, runner_path
    from eval.hf_forward import HFFallback
    from eval.target import make_runner

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = tf.GraniteConfig(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                           logits_scaling=4.0, **common) if family == "granite" \
        else tf.CohereConfig(logit_scale=0.25, **common)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    assert not lean_supported(model) and runner_path(model) == "hf"
    r = make_runner(model)
    assert isinstance(r, HFFallback)
    ids = torch.randint(3, 64, (2, 9))
    r.reset(2, 16)
    with torch.no_grad():
        logits, _ = r(ids, torch.arange(9).expand(2, 9), 9)
        torch.testing.assert_close(logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_a_model_the_lean_forward_does_not_cover_is_refused_by_name():
    """LeanLlama on a GPT-2: a TypeError naming the families it covers and make_runner, not a crash of its own."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).eval()
    with pytest.raises(TypeError, match="is not a family the lean forward covers .*llama.*make_runner"):
        LeanLlama(gpt2)
