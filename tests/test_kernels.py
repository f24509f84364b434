"""eval/kernels.py and eval/cpu.py: the CPU kernels on every path this machine runs (the `kernel_path`
fixture: amx-bf16, avx512-bf16 and avx2 on an AMX CPU, the last two on an AVX-512 one, avx2 alone on an
AVX2 one). Matmul sums must equal an
fp32 reference rounded once to bf16 up to summation order, a row's result must not depend on the other
rows in the call (so a verify forward's matmuls round like one-token steps), and the path is picked by
what the CPU runs: never an op it cannot execute, a warning and PyTorch's ops where the kernels do not
build, one clear error for a forced path this CPU lacks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import eval.cpu as cpu
import eval.kernels as kernels
from eval.cpu import packed_linear

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ext(kernel_path):
    return kernel_path.kernels


@pytest.mark.parametrize("name", ["amx-bf16", "avx512-bf16", "avx2"])
def test_builds_where_the_cpu_can_run_it(name):
    # With a C++ compiler and ninja (this project's machines), a silent fallback would hide a broken build.
    import shutil

    from torch.utils.cpp_extension import is_ninja_available

    if not (is_ninja_available() and shutil.which("c++")):
        pytest.skip("no compiler or ninja here: the generic path is the expected one")
    if not cpu.runs(name):  # importing the module runs its initialisers, compiled with the path's flags
        pytest.skip(f"this CPU cannot load the {name} build: it lacks {' '.join(cpu.missing(name))}")
    mod = kernels.build(name)
    assert hasattr(mod, "linear") and hasattr(mod, "argmax_rows")
    if cpu._kernels(name) is not None:
        assert cpu.decide({cpu.ENV_PATH: name}).kernels is mod


def test_a_killed_builds_lock_is_cleared_and_a_running_builds_kept(tmp_path):
    """torch's builder waits forever on its lock file; a build killed mid-way leaves one behind."""
    import time

    stale, fresh = tmp_path / "stale" / "lock", tmp_path / "fresh" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    then = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(stale, (then, then))
    with pytest.warns(UserWarning, match="did not finish"):
        kernels._clear_stale_lock(stale)
    kernels._clear_stale_lock(fresh)
    assert not stale.exists() and fresh.exists()
    kernels._clear_stale_lock(stale)  # none: nothing to do


def test_each_checkout_builds_in_its_own_directory(monkeypatch):
    a = kernels.build_dir("avx2")
    monkeypatch.setattr(kernels, "SOURCE", Path("/elsewhere/eval/csrc/small_gemm.cpp"))
    assert kernels.build_dir("avx2") != a and kernels.build_dir("avx2").parent == a.parent


def test_another_kernel_source_builds_apart_from_the_checkouts(tmp_path):
    old = tmp_path / "old.cpp"
    old.write_bytes(kernels.SOURCE.read_bytes() + b"// another version\n")
    same = tmp_path / "same.cpp"
    same.write_bytes(old.read_bytes())
    assert kernels.module_name("avx2", old) not in (kernels.module_name("avx2"), kernels.module_name("avx2", kernels.SOURCE))
    assert kernels.module_name("avx2", old) == kernels.module_name("avx2", same)  # keyed by the text
    assert kernels.build_dir("avx2", old) != kernels.build_dir("avx2")
    assert kernels.build_dir("avx2", old).parent == kernels.build_dir("avx2").parent


def _case(rows, n_out, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_out, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n_out, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(2, rows, k, generator=g).to(torch.bfloat16)[:1]  # leading dims, as a forward calls it
    return w, b, x


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 12, 13, 16, 17, 40])  # 17, 40: AMX's second and third tiles
@pytest.mark.parametrize("n_out,bias,k", [(96, False, 64), (37, True, 64), (200, False, 64), (40, True, 80)])
def test_matches_fp32_reference_up_to_summation_order(rows, n_out, bias, k, ext):
    """37, 200: a partial block of 16; k=80, not a whole number of AMX tiles: the vdpbf16ps kernel there."""
    w, b, x = _case(rows, n_out, k, bias, rows * 1000 + n_out)
    got = packed_linear(w, b)(x)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # exact products, fp32 sums
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, n_out)
    # One bf16 rounding of an fp32 sum: within half a bf16 ulp of the reference plus fp32 reordering.
    assert torch.allclose(got.float(), ref, rtol=2 ** -8, atol=1e-4)
    assert (got == ref.to(torch.bfloat16)).float().mean() > 0.97


@pytest.mark.parametrize("rows", [5, 6, 7, 8, 9, 11, 12, 13, 16, 17, 19, 40, 64])  # AVX2: 5, 6 one pass (6: each line even k then odd); 7, 13 passes of 5 (5+2, 5+5+3); 8, 9, 16 a 2-4 row pass after 6; 17-64 its panel kernel (19: a 4-row tile); 64: avx512-bf16's last row count on the kernels
@pytest.mark.parametrize("n_out", [192, 168])  # 168: a span of 3 blocks, the last one partial
def test_a_row_rounds_the_same_whatever_the_other_rows(rows, n_out, ext, kernel_path):
    if kernel_path.kernel_rows is not None and rows > kernel_path.kernel_rows:
        pytest.skip(f"the {kernel_path.name} path hands more than {kernel_path.kernel_rows} rows to oneDNN")
    w, b, x = _case(rows, n_out, 576, True, 0)
    lin = packed_linear(w, b)
    whole = lin(x)  # [1, rows, N]: a verify forward's rows (40: a batch of 8 verifying 4 tokens each)
    alone = torch.cat([lin(x[:, i:i + 1]) for i in range(rows)], 1)  # one-token steps
    assert torch.equal(whole, alone)
    assert not torch.equal(lin(x[:, :1]), lin(x[:, 1:2]))  # and it does compute something per row


def test_more_rows_than_the_kernel_rows_go_to_onednn_where_it_has_bf16_else_to_the_kernel(ext, kernel_path):
    assert (kernel_path.kernel_rows is None) == (kernel_path.name != "avx512-bf16" or not kernel_path.onednn_bf16)
    w, _, x = _case((kernel_path.kernel_rows or cpu.VDP_MAX_ROWS) + 4, 96, 64, False, 1)
    lin = packed_linear(w)
    got = lin(x)
    if kernel_path.kernel_rows is not None:
        assert torch.equal(got, F.linear(x, w))  # oneDNN's packed weight is bit-identical to F.linear
    else:  # AMX, fast at any row count; AVX2, where oneDNN has no bf16 matmul: the kernel, still row-invariant
        assert torch.equal(got, torch.cat([lin(x[:, i:i + 1]) for i in range(x.shape[1])], 1))
        assert torch.allclose(got.float(), F.linear(x.float(), w.float()), rtol=2 ** -8, atol=1e-4)


AVX2_ONLY = frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"})  # an AMD EPYC before Zen 4, a laptop
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}  # Zen 4, Cooper Lake
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}  # Sapphire Rapids and later


class _Built:
    """A stand-in for a built kernels module: what decide() asks of it."""

    def __init__(self, amx: bool):
        self.amx = amx

    def amx_ready(self) -> bool:
        return self.amx


def test_an_amx_cpu_takes_amx_only_where_the_os_grants_it(monkeypatch):
    """AMX's tile state is the OS's to grant (Linux 5.16+, per process): without it the best path is
    avx512-bf16, named with the reason; forcing amx-bf16 there is one clear error."""
    built = {"amx-bf16": _Built(False), "avx512-bf16": _Built(False)}
    monkeypatch.setattr(kernels, "build", lambda name: built[name])
    p = cpu.decide({}, flags=AMX)
    assert p.name == "avx512-bf16" and "the OS did not grant AMX" in p.reason
    with pytest.raises(cpu.CpuPathError, match="did not grant this process AMX"):
        cpu.decide({cpu.ENV_PATH: "amx-bf16"}, flags=AMX)
    built["amx-bf16"] = _Built(True)
    p = cpu.decide({}, flags=AMX)
    assert p.name == "amx-bf16" and p.kernel_rows is None and p.kernels is built["amx-bf16"]
    assert cpu.decide({}, flags=AVX512_BF16).name == "avx512-bf16"  # no AMX flags: never tried
    assert not any(f.startswith("amx") for f in cpu._capped(AMX, "avx512-bf16"))  # forcing hides it


def _os_grants_amx() -> bool:
    """Whether Linux has granted this process AMX's tile data, asked of the kernel itself (arch_prctl
    ARCH_GET_XCOMP_PERM: bit 18, XTILEDATA, of the permitted state), not of our module."""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        return False
    mask = ctypes.c_ulong(0)
    if ctypes.CDLL(None, use_errno=True).syscall(158, 0x1022, ctypes.byref(mask)) != 0:  # SYS_arch_prctl
        return False  # a kernel before 5.16 knows no AMX permission
    return bool(mask.value >> 18 & 1)


def test_the_amx_build_says_whether_its_matmul_runs_on_amx_here():
    """The real module's answer: True exactly where the CPU has AMX and Linux granted it to this process (as
    the kernel reports after the module asked); the other builds never claim AMX."""
    if not cpu.runs("avx2"):
        pytest.skip("this CPU has no AVX2")
    assert kernels.build("avx2").amx_ready() is False
    if cpu.runs("avx512-bf16"):  # the AMX build's initialisers use AVX-512: an AVX2-only CPU cannot load it
        ready = kernels.build("amx-bf16").amx_ready()  # asks Linux for the tile data on an AMX CPU
        assert ready is (cpu.runs("amx-bf16") and _os_grants_amx())


def test_an_avx2_only_cpu_takes_the_avx2_path_and_never_onednn_bf16():
    """The crash of issue 31: oneDNN's bf16 reorder aborts on AVX2 ("bf16 path needs the cpu support
    avx_ne_convert or avx512bw, avx512vl and avx512dq"); the path must know that from the flags."""
    p = cpu.decide({}, flags=AVX2_ONLY)
    assert p.name == "avx2" and not p.onednn_bf16 and "avx512" in p.reason
    assert not cpu.decide({cpu.ENV_KERNELS: "0"}, flags=AVX2_ONLY).onednn_bf16
    assert cpu.decide({}, flags=frozenset({"sse4_2"})).name == "generic"


def test_onednn_capped_below_the_cpu_is_asked_not_assumed():
    """oneDNN capped by its own ONEDNN_MAX_CPU_ISA=AVX2 (as on an AVX2-only CPU) refuses its bf16 reorder
    even where the CPU's flags have the instructions: the path asks oneDNN, so the best path on this CPU
    packs nothing for oneDNN there (the flags alone said yes, and the packing raised)."""
    code = ("from eval import cpu; import torch; f = cpu.cpu_info()[1]; "
            "print(cpu._onednn_bf16_runs(), cpu.decide({}, flags=f).onednn_bf16)")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_forcing_a_path_hides_the_instructions_above_it():
    if not cpu.runs("avx2"):
        pytest.skip("this CPU has no AVX2")
    assert not cpu.decide({cpu.ENV_PATH: "avx2"}).onednn_bf16
    g = cpu.decide({cpu.ENV_PATH: "generic"})
    assert g.name == "generic" and g.kernels is None and not g.onednn_bf16


@pytest.mark.parametrize("env,flags,match", [
    ({cpu.ENV_PATH: "avx512-bf16"}, AVX2_ONLY, "lacks avx512f avx512bw avx512vl avx512_bf16; use one of avx2, generic"),
    ({cpu.ENV_PATH: "avx3"}, AVX2_ONLY, "is not a CPU path: use one of amx-bf16, avx512-bf16, avx2, generic"),
    ({cpu.ENV_PATH: "amx-bf16"}, AVX512_BF16, "lacks amx_tile amx_bf16; use one of avx512-bf16, avx2, generic"),
    ({cpu.ENV_PATH: "avx2", cpu.ENV_KERNELS: "0"}, AVX2_ONLY, "turns the kernels off"),
])
def test_a_forced_path_this_cpu_cannot_run_is_one_clear_error(env, flags, match):
    with pytest.raises(cpu.CpuPathError, match=match):
        cpu.decide(env, flags=flags)


def test_disabled_or_unbuildable_falls_back(monkeypatch, tmp_path):
    assert cpu.decide({cpu.ENV_KERNELS: "0"}).name == "generic"
    if not cpu.runs("avx2"):
        return
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))  # never touch the real build cache
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE", bad)
    monkeypatch.setattr(kernels, "build", kernels.build.__wrapped__)  # no cached module
    with pytest.warns(UserWarning, match="did not build"):
        p = cpu.decide({})
    assert p.name == "generic" and p.kernels is None and "did not build" in p.reason
    with pytest.raises(cpu.CpuPathError, match="avx2 kernels did not build"):
        cpu.decide({cpu.ENV_PATH: "avx2"})


@pytest.mark.parametrize("env,want", [({"DRAFTSMITH_CPU_PATH": "avx2"}, "cpu path: avx2 (forced by DRAFTSMITH_CPU_PATH)"),
                                      ({"DRAFTSMITH_KERNELS": "0"}, "cpu path: generic (DRAFTSMITH_KERNELS=0)")])
def test_the_documented_overrides_pick_the_path_a_process_prints(env, want):
    """README's overrides end to end: a fresh process reads them at start-up and prints its path."""
    import os
    import subprocess
    import sys

    if "avx2" in want and not cpu.runs("avx2"):
        pytest.skip("this CPU has no AVX2")
    env = {k: v for k, v in os.environ.items() if k not in ("DRAFTSMITH_CPU_PATH", "DRAFTSMITH_KERNELS")} | env
    out = subprocess.run([sys.executable, "-m", "eval.cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith(want), out.stdout + out.stderr
    bad = subprocess.run([sys.executable, "-m", "eval.cpu"], env=env | {"DRAFTSMITH_CPU_PATH": "avx3"},
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "is not a CPU path" in bad.stderr


def _attn_case(B, nh, nkv, T, S, seed, hd=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, T, hd, generator=g)
    kc, vc = torch.randn(2, B, nkv, S + 7, hd, generator=g)  # longer caches than attended, like the decoder's
    return q, kc.contiguous(), vc.contiguous()


@pytest.mark.parametrize("nh,nkv", [(4, 4), (6, 2), (8, 2), (10, 2)])  # groups of 1, 3, 4 and 5 heads
@pytest.mark.parametrize("T", [1, 5, 9])
@pytest.mark.parametrize("hd", [16, 64, 128])  # the generic loop, and the two compile-time widths
def test_attention_matches_sdpa_under_causal_and_tree_masks(nh, nkv, T, hd, ext):
    B, S = 2, 40
    q, kc, vc = _attn_case(B, nh, nkv, T, S, nh * 100 + T, hd)
    pos = torch.tensor([[S - T + i for i in range(T)], [S - T - 3 + i for i in range(T)]])  # ragged rows
    causal = torch.arange(S)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    tree = causal & (torch.rand(B, T, S, generator=torch.Generator().manual_seed(T)) > 0.3)
    tree[:, :, 0] = True  # every row sees something
    for vis in (causal, tree):
        got = ext.attend(q, kc, vc, vis.contiguous(), 0.25)
        want = F.scaled_dot_product_attention(q, kc[:, :, :S], vc[:, :, :S], attn_mask=vis[:, None], scale=0.25,
                                              enable_gqa=nh != nkv)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hd", [16, 64])
def test_attention_row_sees_the_same_numbers_as_a_one_token_step(hd, ext):
    """A tree node over [committed slots + its ancestors' slots] gets bit for bit what a one-token step
    gets over consecutive slots holding the same keys and values."""
    q, kc, vc = _attn_case(1, 6, 2, 3, 30, 7, hd)
    committed, anc = 20, [20, 23, 25]  # node 2's ancestors sit at tree slots 20, 23, 25
    vis = torch.zeros(1, 3, 30, dtype=torch.bool)
    vis[0, 2, :committed] = True
    vis[0, 2, anc] = True
    tree_out = ext.attend(q, kc, vc, vis, 0.125)[:, :, 2]
    kc2, vc2 = kc.clone(), vc.clone()  # the same path moved to consecutive slots 20..22, as after acceptance
    kc2[:, :, committed:committed + 3], vc2[:, :, committed:committed + 3] = kc[:, :, anc], vc[:, :, anc]
    step = ext.attend(q[:, :, 2:3].contiguous(), kc2, vc2, torch.ones(1, 1, committed + 3, dtype=torch.bool), 0.125)
    assert torch.equal(tree_out, step[:, :, 0])
    empty = ext.attend(q, kc, vc, torch.zeros(1, 3, 30, dtype=torch.bool), 0.125)
    assert torch.equal(empty, torch.zeros_like(empty))  # a row that sees nothing gets zeros, not NaN


def _bf16_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    # SmolLM2's widths (576, 1536) in one layer: at these sizes oneDNN's and SDPA's sums are blocked by
    # row and kv counts (at 96 wide they happened to agree); head_dim 32, groups of 3 heads.
    cfg = LlamaConfig(vocab_size=96, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      initializer_range=0.1, pad_token_id=0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def test_bf16_verify_forward_rounds_like_one_token_steps(ext):
    """The lean runner's logits and features for T tokens in one forward equal, bit for bit, T
    one-token forwards (oneDNN and SDPA did not: their sums are blocked by row and kv counts)."""
    from eval.target import LeanLlama

    r = LeanLlama(_bf16_target())
    toks = torch.randint(1, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    S, T = 21, 9
    with torch.no_grad():
        r.reset(1, 64)
        r(toks[:, :S], torch.arange(S)[None], S, logit_idx=torch.tensor([S - 1]))
        logits, feats = r(toks[:, S:], torch.arange(S, S + T)[None], S + T)
        steps = [r(toks[:, S + i:S + i + 1], torch.tensor([[S + i]]), S + i + 1) for i in range(T)]
    assert torch.equal(logits, torch.cat([s[0] for s in steps], 1))
    assert torch.equal(feats, torch.cat([s[1] for s in steps], 1))


def test_bf16_speculative_decoding_equals_plain_bit_for_bit(ext):
    """With the row-invariant kernels, bf16 greedy speculative output (chains and trees, batch 1 and
    ragged) is exactly plain decoding's: no near-tie exceptions."""
    from eval.datastore import Datastore
    from eval.decoder import SpeculativeDecoder
    from eval.proposers import HybridProposer, NgramProposer, NoDraft

    target = _bf16_target()
    prompts = [[1, 5, 9, 3, 5, 9, 4], [7, 7, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [12]]
    plain_dec = SpeculativeDecoder(target, None, k=1)
    assert plain_dec.runner.row_invariant
    plain = plain_dec.generate(prompts, max_new_tokens=40).sequences
    store = Datastore(plain)  # (built from the outputs it will predict, so the trees accept a lot)
    taus = []
    for prop, k in ((NgramProposer(), 6), (HybridProposer(NoDraft(), min_match=1, max_nodes=12, datastore=store), 4)):
        for rows in ([0, 1, 2, 3], [2]):  # ragged, then batch 1
            res = SpeculativeDecoder(target, prop, k=k).generate([prompts[i] for i in rows], max_new_tokens=40)
            assert res.sequences == [plain[i] for i in rows]
            taus.append(res.stats["tau"])
    assert max(taus) > 2.0, taus  # drafts were accepted: multi-token verifies did happen


def test_decoder_reports_row_invariance_only_when_every_verify_fit_the_kernels(ext, kernel_path):
    """stats["row_invariant"] comes from the verify forwards the decoder ran: a verify of more than
    MAX_ROWS tokens takes oneDNN/SDPA, and the exact-match rule must not be claimed for it."""
    from eval.decoder import SpeculativeDecoder
    from helpers import NoChain as Zeros  # always k drafts, so every verify holds k + 1 tokens

    target = _bf16_target()
    prompts = [[1, 5, 9, 3, 5, 9, 4]]
    for k, want in ((1, True), (kernels.MAX_ROWS - 1, True), (kernels.MAX_ROWS, False)):
        stats = SpeculativeDecoder(target, None if k == 1 else Zeros(), k=k).generate(prompts, max_new_tokens=6).stats
        assert stats["row_invariant"] is want, k
    # A batch of 4 verifying 5 tokens a row (20 rows) stays on the kernels on every path; one whose verify rows
    # (batch x tokens) pass the path's kernel_rows goes to oneDNN on avx512-bf16.
    stats = SpeculativeDecoder(target, Zeros(), k=4).generate(prompts * 4, max_new_tokens=6).stats
    assert stats["row_invariant"] is True
    wide = cpu.VDP_MAX_ROWS // 5 + 1
    stats = SpeculativeDecoder(target, Zeros(), k=4).generate(prompts * wide, max_new_tokens=6).stats
    assert stats["row_invariant"] is (kernel_path.kernel_rows is None)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place between two bf16 tensors of the same sign pattern."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows", [1, 9, 16, 48])
def test_fused_elementwise_ops_round_like_the_torch_code_they_replace(rows, ext):
    """add_rmsnorm, silu_mul and rope (eval/target.py's fused layer steps) against the PyTorch ops: the
    residual add and RoPE bit for bit; RMSNorm and SiLU within one bf16 ulp (RMSNorm's mean is summed
    in another order, SiLU's exp is our own), and almost always exactly. Each row's result is its own:
    many rows (split between threads) give each row what it gets alone."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).bfloat16()
    y = torch.randn(rows, 576, generator=g).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()

    def rms(t):
        tf = t.float()
        return w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)

    for add in (True, False):
        xs = x.clone()
        h = ext.add_rmsnorm(xs, y if add else None, w, 1e-5)
        want_x = x + y if add else x
        assert torch.equal(xs, want_x)  # the residual stream, updated in place
        d = _ulps(h, rms(want_x))
        assert d.max() <= 1 and (d > 0).float().mean() < 0.01
    gu = (torch.randn(rows, 3072, generator=g) * 4).bfloat16()
    gate, up = gu.chunk(2, -1)
    d = _ulps(ext.silu_mul(gu), F.silu(gate) * up)
    assert d.max() <= 1 and (d > 0).float().mean() < 0.01
    qkv = torch.randn(rows, 12 * 64 + 3 * 64, generator=g).bfloat16()  # q|k (12 heads) then v
    cos, sin = torch.randn(rows, 64, generator=g).bfloat16(), torch.randn(rows, 64, generator=g).bfloat16()
    qk = qkv[:, :12 * 64].view(rows, 12, 64)
    want = qk * cos[:, None] + torch.cat([qk[..., 32:], qk[..., :32]], -1) * sin[:, None]
    assert torch.equal(ext.rope(qkv, 12, cos, sin).view(rows, 12, 64), want)
    last = slice(rows - 1, rows)  # the last row alone, against its place among all the rows
    assert torch.equal(ext.silu_mul(gu)[last], ext.silu_mul(gu[last].contiguous()))
    assert torch.equal(ext.rope(qkv, 12, cos, sin)[last], ext.rope(qkv[last].contiguous(), 12, cos[last].contiguous(), sin[last].contiguous()))
    assert torch.equal(ext.add_rmsnorm(x.clone(), y, w, 1e-5)[last], ext.add_rmsnorm(x[last].clone(), y[last].contiguous(), w, 1e-5))


def test_fused_layer_steps_agree_with_the_unfused_forward(ext):
    """The lean runner's bf16 forward with the fused elementwise kernels and without them (runner.ew =
    None): the same model, so logits and features agree to bf16 rounding."""
    from eval.target import LeanLlama

    r = LeanLlama(_bf16_target())
    assert r.ew is not None
    toks = torch.randint(1, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.no_grad():
        for name, ew in (("fused", r.ew), ("torch", None)):
            r.ew = ew
            r.reset(1, 64)
            out[name] = r(toks, torch.arange(30)[None], 30)
    for got, want in zip(out["fused"], out["torch"]):
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("shape", [(1, 49152), (11, 49152), (2, 3, 1000), (4, 37), (1, 7)])  # 37, 7: a tail past 16
def test_argmax_rows_gives_torchs_first_maximal_index(shape, ext):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    rows = x.view(-1, shape[-1])
    rows[0, [3, shape[-1] - 1]] = 40.0  # a tie across lanes (and the tail): the first index wins
    if rows.shape[0] > 1:
        rows[1] = float("-inf")  # a row of -inf: index 0, as torch says
    if rows.shape[0] > 2:
        rows[2, [5, 21]] = float("nan")  # NaN propagates: its first index
        rows[2, 0] = 100.0
    if rows.shape[0] > 3:
        rows[3, 16:] = rows[3, :16].max() + 1  # a tie inside one lane's later steps
    got = ext.argmax_rows(x)
    assert got.dtype == torch.long and got.shape == x.shape[:-1]
    assert torch.equal(got, x.max(-1).indices)
    clean = ~rows.isnan().any(-1)  # a NaN row's argmax is max()'s rule, checked above
    assert torch.equal(got[clean.view(x.shape[:-1])], x.float().argmax(-1)[clean.view(x.shape[:-1])])


@pytest.mark.parametrize("R,V", [(1, 49152), (16, 49152), (5, 1000), (3, 7)])  # 1000, 7: a partial last block
def test_cdf_sample_draws_the_ids_the_torch_search_draws(R, V, ext):
    """The kernel against eval.cpu.cdf_search, the same uniforms: random weights at the serving
    temperature's spread, zero runs (never drawn), all the mass on the last id, an all-zero row (id 0, as
    the search gives), and uniforms at 0 and just under 1."""
    from eval.cpu import cdf_search

    g = torch.Generator().manual_seed(R * V)
    w = (torch.randn(R, V, generator=g) * 3 / 0.7).softmax(-1)
    w[0, : V // 2] = 0.0
    if R > 1:
        w[1] = 0.0
        w[1, V - 1] = 2.5
    if R > 2:
        w[2] = 0.0
    for u in (torch.rand(R, dtype=torch.float64, generator=g), torch.zeros(R, dtype=torch.float64),
              torch.full((R,), 1 - 2.0 ** -53, dtype=torch.float64)):
        got = ext.cdf_sample(w, u)
        assert got.dtype == torch.long and torch.equal(got, cdf_search(w, u)), (u, got)
        has_mass = w.sum(1) > 0  # row 2 has no mass at all
        assert (w.gather(1, got[:, None])[:, 0][has_mass] > 0).all() and (got[~has_mass] == 0).all()
    assert ext.cdf_sample(w, torch.rand(R, dtype=torch.float64, generator=g))[0] >= V // 2


def test_greedy_argmax_on_the_decoders_logits_is_torchs_argmax():
    from eval.cpu import greedy_argmax

    x = torch.randn(1, 11, 49152, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(greedy_argmax(x), x.argmax(-1))
    assert torch.equal(greedy_argmax(x[:, 3]), x[:, 3].argmax(-1))  # a non-contiguous slice


@pytest.mark.parametrize("nh,nkv,hd", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (10, 2, 32)])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 11), (2, 5), (1, 16)])
@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_attend_qkv_equals_cache_write_then_attend_bit_for_bit(nh, nkv, hd, B, T, cache, ext):
    """attend_qkv (k/v written at slots, attention from the bf16 projections, bf16 out) against the ops
    it replaces in the fused forward: cache writes, q widened, ext.attend over fp32 caches, the output
    rounded and laid out. A bf16 cache (what LeanLlama keeps for a bf16 model) gives the same bits."""
    g = torch.Generator().manual_seed(nh * 31 + T)
    S_max, n0 = 48, 30
    C = (nh + 2 * nkv) * hd
    qkv = torch.randn(B, T, C, generator=g).bfloat16()
    qk = torch.randn(B, T, (nh + nkv) * hd, generator=g).bfloat16()  # stands for rope's output
    kc = torch.randn(B, nkv, S_max, hd, generator=g).bfloat16().to(cache)  # earlier slots: bf16 values either way
    vc = torch.randn(B, nkv, S_max, hd, generator=g).bfloat16().to(cache)
    slots = torch.stack([torch.randperm(S_max - n0, generator=g)[:T] + n0 for _ in range(B)])  # any slots past n0
    vis = torch.rand(B, T, n0 + 18, generator=g) > 0.4
    vis[:, :, 0] = True
    vis[0, 0] = False  # a row that sees nothing: zeros
    k_want, v_want = kc.float(), vc.float()
    k = qk[..., nh * hd:].view(B, T, nkv, hd).transpose(1, 2)
    v = qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd).transpose(1, 2)
    idx = slots[:, None, :, None].expand(-1, nkv, -1, hd)
    k_want.scatter_(2, idx, k.float())
    v_want.scatter_(2, idx, v.float())
    q = qk[..., :nh * hd].view(B, T, nh, hd).transpose(1, 2).float().contiguous()
    want = ext.attend(q, k_want, v_want, vis.contiguous(), 0.125).to(torch.bfloat16).transpose(1, 2).reshape(B, T, -1)
    got = ext.attend_qkv(qk, qkv, (nh + nkv) * hd, kc, vc, slots, vis.contiguous(), nh, 0.125)
    assert kc.dtype == cache and torch.equal(kc.float(), k_want) and torch.equal(vc.float(), v_want)
    if cache == torch.bfloat16:  # attend over the bf16 caches: the fp32 caches' numbers
        assert torch.equal(ext.attend(q, kc, vc, vis.contiguous(), 0.125), ext.attend(q, k_want, v_want, vis.contiguous(), 0.125))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))


def test_fused_forward_gives_the_same_numbers_with_and_without_attend_qkv(ext):
    """The fused forward's decode steps and tree verifies through attend_qkv and through the ops it
    replaces: logits, features and the cache bit for bit."""
    from eval.target import LeanLlama

    r = LeanLlama(_bf16_target())
    toks = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    out = {}

    class NoDirect:  # the kernels without attend_qkv: the forward takes the composed path
        def __init__(self, e):
            self.e = e

        def __getattr__(self, n):
            if n == "attend_qkv":
                raise AttributeError(n)
            return getattr(self.e, n)

    ew = r.ew
    with torch.no_grad():
        for name, e in (("direct", ew), ("composed", NoDirect(ew))):
            r.ew = e
            r.reset(1, 64)
            res = [r(toks[:, :24], torch.arange(24)[None], 24)]  # prefill: SDPA either way
            for t in range(24, 30):  # one-token steps
                res.append(r(toks[:, t:t + 1], torch.tensor([[t]]), t + 1))
            pos = torch.tensor([[30, 31, 31, 32, 33]])  # a tree: two nodes share position 31
            slots = torch.arange(30, 35)[None]
            mask = torch.zeros(1, 1, 5, 35, dtype=torch.bool)
            mask[..., :30] = True
            for j, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4]]):
                mask[0, 0, j, [30 + a for a in anc]] = True
            res.append(r(toks[:, 30:35], pos, 35, slots=slots, mask=mask))
            out[name] = (res, r.K.clone(), r.V.clone())
    for a, b in zip(out["direct"][0], out["composed"][0]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(out["direct"][1], out["composed"][1]) and torch.equal(out["direct"][2], out["composed"][2])


@pytest.mark.parametrize("hd", [32, 64, 128, 48, 8])  # 48, 8: halves that are not whole 16-lane vectors (scalar loop)
def test_rope_vector_and_scalar_paths_round_like_torch(hd, ext):
    g = torch.Generator().manual_seed(hd)
    rows, n = 11, 5
    qkv = (torch.randn(rows, (n + 2) * hd, generator=g) * 3).bfloat16()
    cos, sin = torch.randn(rows, hd, generator=g).bfloat16(), torch.randn(rows, hd, generator=g).bfloat16()
    qk = qkv[:, :n * hd].view(rows, n, hd)
    h = hd // 2
    want = qk * cos[:, None] + torch.cat([qk[..., h:], qk[..., :h]], -1) * sin[:, None]
    assert torch.equal(ext.rope(qkv, n, cos, sin).view(rows, n, hd), want)


def test_fused_forward_gives_the_same_numbers_with_and_without_the_layer_call(ext):
    """ext.layer (a whole layer in one call) against the per-kernel loop, on decode steps, a tree verify
    and a ragged batch of two: logits, features and the cache bit for bit. A prefill (more rows than the
    matmul kernel takes) keeps the loop."""
    from eval.target import LeanLlama

    r = LeanLlama(_bf16_target())
    assert r.layers is not None
    layers = r.layers
    toks = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    out = {}
    with torch.no_grad():
        for name, ls in (("layer", layers), ("loop", None)):
            r.layers = ls
            r.reset(2, 64)
            res = [r(toks[:, :24], torch.arange(24)[None].expand(2, -1), 24)]
            for t in range(24, 28):  # one-token steps, batch of two
                res.append(r(toks[:, t:t + 1], torch.tensor([[t], [t]]), t + 1))
            pos = torch.tensor([[28, 29, 29, 30], [28, 29, 30, 31]])  # row 0 a tree, row 1 a chain
            mask = torch.zeros(2, 1, 4, 32, dtype=torch.bool)
            mask[..., :28] = True
            for j, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3]]):
                mask[0, 0, j, [28 + a for a in anc]] = True
                mask[1, 0, j, 28:29 + j] = True
            res.append(r(toks[:, 28:32], pos, 32, slots=torch.arange(28, 32)[None].expand(2, -1), mask=mask))
            out[name] = (res, r.K.clone(), r.V.clone())
    for a, b in zip(out["layer"][0], out["loop"][0]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(out["layer"][1], out["loop"][1]) and torch.equal(out["layer"][2], out["loop"][2])


def test_the_layer_calls_scratch_reuse_changes_no_number_and_no_output(ext):
    """ext.layer keeps its intermediates in a buffer reused across calls on the thread: a call's output is
    its own tensor (later calls, of the same or another row count, leave it as it was), and the same inputs
    give the same numbers whether the buffer last held a larger call's intermediates or none, or when the
    output goes to a buffer of the caller's."""
    from eval.target import LeanLlama

    r = LeanLlama(_bf16_target())
    (w, n_out), nw = r.layers[0], r.norm_w

    def call(T, seed, out=None):
        r.reset(1, 64)
        x = (torch.randn(1, T, 576, generator=torch.Generator().manual_seed(seed)) * 2).bfloat16()
        h = ext.add_rmsnorm(x.clone(), None, *nw[0])
        cos, sin = torch.ones(1, T, 32).bfloat16(), torch.zeros(1, T, 32).bfloat16()
        vis = torch.ones(1, T, T, dtype=torch.bool).tril()
        return ext.layer(x, h, w, n_out, cos, sin, r.caches[0].k, r.caches[0].v, torch.arange(T)[None], vis,
                         r.n_heads, r.scale, *nw[1], *nw[2], out)

    with torch.no_grad():
        first = call(3, 0)
        kept = first.clone()
        other = call(3, 1)  # the same sizes: the same places in the buffer
        big = call(40, 2)  # a larger call grows the buffer
        assert torch.equal(first, kept) and not torch.equal(other, kept)
        assert torch.equal(call(3, 0), kept) and torch.equal(call(40, 2), big)
        buf = torch.empty_like(kept)  # the forward's own buffer for a layer's output: the same numbers, written there
        got = call(3, 0, buf)
        assert got.data_ptr() == buf.data_ptr() and torch.equal(buf, kept)


def test_calls_larger_than_the_kept_scratch_give_the_same_numbers(ext):
    """A call whose scratch exceeds what a thread keeps (16 MB: a prefill's widened rows on avx2, its attention's
    visible-slot lists) takes a buffer of its own, freed with the call: its rows equal the same rows computed in
    a small call, which uses the kept buffer."""
    g = torch.Generator().manual_seed(5)
    M, K, N = 4200, 1024, 32  # 4200 x 1024 fp32 widened rows: 17 MB
    x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    packed, none = ext.pack(w), torch.empty(0)
    assert torch.equal(ext.linear(x, packed, none, N)[-3:], ext.linear(x[-3:].contiguous(), packed, none, N))
    T, nh, hd = 2100, 2, 16  # 2100 x 2100 visible-slot indices: 17 MB
    q = torch.randn(1, nh, T, hd, generator=g)
    kc, vc = torch.randn(1, 1, T, hd, generator=g), torch.randn(1, 1, T, hd, generator=g)
    vis = torch.ones(T, T, dtype=torch.bool).tril()[None]
    last = ext.attend(q[:, :, -2:].contiguous(), kc, vc, vis[:, -2:].contiguous(), 0.25)
    assert torch.equal(ext.attend(q, kc, vc, vis, 0.25)[:, :, -2:], last)


def test_the_layer_call_takes_as_many_rows_as_the_matmul_kernel(ext, kernel_path):
    """A batch's verify (6 rows x 4 tokens = 24 matmul rows): ext.layer wherever the path's kernels take
    that many rows (amx-bf16, avx2, avx512-bf16 up to VDP_MAX_ROWS), with the per-kernel loop's numbers bit for
    bit; the loop elsewhere."""
    from eval.target import LeanLlama

    r = LeanLlama(_bf16_target())
    assert r.layer_rows == kernel_path.kernel_rows and r.invariant_rows == kernel_path.kernel_rows
    layers, B = r.layers, 6
    toks = torch.randint(1, 96, (B, 14), generator=torch.Generator().manual_seed(3))
    calls = []
    real = r.ew.layer if kernel_path.kernel_rows is None or B * 4 <= kernel_path.kernel_rows else None
    out = {}
    with torch.no_grad():
        for name, ls in (("layer", layers), ("loop", None)):
            r.layers = ls
            r.reset(B, 32)
            r(toks[:, :10], torch.arange(10)[None].expand(B, -1), 10)
            out[name] = (r(toks[:, 10:14], torch.arange(10, 14)[None].expand(B, -1), 14), r.K.clone())
    assert torch.equal(out["layer"][0][0], out["loop"][0][0]) and torch.equal(out["layer"][1], out["loop"][1])
    if real is not None:  # and the layer call did take the 24 rows
        r.layers = layers
        r.ew = type("Spy", (), {"__getattr__": lambda _, n: getattr(ext, n),
                                "layer": staticmethod(lambda *a: calls.append(a[0].shape) or real(*a))})()
        with torch.no_grad():
            r(toks[:, 10:14], torch.arange(10, 14)[None].expand(B, -1), 14)
        assert calls and calls[0][:2] == (B, 4)


def test_cpu_bench_times_every_path_on_every_shape():
    """eval.cpu_bench (the paths' table in docs/reference/kernels.md) on a tiny bf16 model."""
    from eval.cpu_bench import measure

    paths = [p for p in cpu.PATHS if cpu.runs(p)]
    before = cpu.cpu_path
    res = measure(_bf16_target(), paths, [(1, 1), (2, 3), (1, 20)], pos=8, turns=2, reps=1)
    assert set(res) == set(paths)
    assert all(len(res[p][k]) == 2 and min(res[p][k]) > 0 for p in paths for k in ("1x1", "2x3", "1x20"))
    assert cpu.cpu_path is before  # the process's own path is left as it was


def test_cpu_bench_measures_a_float32_cache_beside_each_kernel_path(monkeypatch):
    """--fp32-cache: each path with kernels also runs as PATH+fp32-cache, on the same runner (one packed copy
    of the weights) with its cache float32, the path's own bf16 (the before and after of the bf16 cache in
    docs/reference/kernels.md)."""
    import eval.target
    from eval.cpu_bench import measure

    paths = [p for p in cpu.PATHS if cpu.runs(p) and cpu.decide({cpu.ENV_PATH: p}).kernels is not None][:1]
    if not paths:
        pytest.skip("no CPU path with kernels here")
    caches, runners, real = {}, set(), eval.target.LeanLlama.reset

    def recording(self, batch, max_len):
        real(self, batch, max_len)
        runners.add(id(self))
        caches.setdefault(cpu.cpu_path().name + ("+fp32" if self.cache_dtype == torch.float32 else ""), set()).add(self.K.dtype)
    monkeypatch.setattr(eval.target.LeanLlama, "reset", recording)
    res = measure(_bf16_target(), paths, [(1, 1), (2, 3)], pos=8, turns=2, reps=1, fp32_cache=True)
    p = paths[0]
    assert set(res) == {p, f"{p}+fp32-cache"}
    assert all(len(v) == 2 and min(v) > 0 for r in res.values() for v in r.values())
    assert caches == {p: {torch.bfloat16}, f"{p}+fp32": {torch.float32}}
    assert len(runners) <= 2  # one runner a turn serves both


def test_cpu_bench_packs_each_turns_runners_afresh_in_rotated_order(monkeypatch):
    """Where a packed copy of the weights lands in memory moved a build's forward ~4% against another build
    of the same source (kernels.md), so no path keeps one copy, or the first place, for all the turns."""
    import eval.target
    from eval.cpu_bench import measure

    paths = [p for p in cpu.PATHS if cpu.runs(p)][:2]
    if len(paths) < 2:
        pytest.skip("one CPU path runs here: nothing to take turns with")
    built, real = [], eval.target.LeanLlama

    def recording(model):
        built.append(cpu.cpu_path().name)
        return real(model)
    monkeypatch.setattr(eval.target, "LeanLlama", recording)
    measure(_bf16_target(), paths, [(1, 1)], pos=4, turns=3, reps=1)
    a, b = paths
    assert built == [a, b, b, a, a, b]
