"""Every target family (tests/families.py) in the speculative decoder: the runner's logits equal the HF
model's own forward (prefill, ragged decode steps and a token tree, across the sliding window), greedy
speculative output equals plain greedy output (chain and tree proposers, batch 1 and ragged), and each
family takes the path docs/reference/architectures.md says (a silent fall back to the HF path shows)."""

from __future__ import annotations

import pytest
import torch

from eval.decoder import SpeculativeDecoder
from eval.proposers.draft_lm import DraftLMProposer
from eval.proposers.hybrid import HybridProposer
from eval.family import runner_path
from eval.hf_forward import HFFallback
from eval.target import LeanLlama, make_runner
from eval.tree import Tree
from tests.families import FAMILIES, SLIDING_WINDOW, tiny_family

V = 64
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # phi3's default pad id 32000 is outside V
PATH = {"llama": "lean", "qwen2": "lean", "qwen3": "lean", "mistral": "lean", "phi3": "lean",
        "gemma2": "hf", "gemma3": "hf", "gpt2": "hf", "gpt_neox": "hf"}
# Qwen2 with use_sliding_window: full layers below max_window_layers, sliding ones above (mixed windows)
# and Phi-3 with partial rotary (RoPE on half of each head's dims)
VARIANTS = {"qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                                            max_window_layers=1)),
            "phi3-partial": ("phi3", dict(partial_rotary_factor=0.5))}
CASES = list(FAMILIES) + list(VARIANTS)
LENS = (11, 5, 9)  # ragged prompt lengths; with the new tokens every row crosses the window of 8
N_NEW = 10


def family(name: str, seed: int = 0, layers: int = 2):
    fam, extra = VARIANTS.get(name, (name, {}))
    return tiny_family(fam, V, seed=seed, layers=layers, **SPECIAL, **extra)


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, V, (4,), generator=g).tolist()  # repeated: n-gram lookups find matches
    return [(motif * 3 + torch.randint(3, V, (n,), generator=g).tolist())[:n] for n in LENS]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """The HF model's own forward over the whole sequence (no cache) -> logits at its last token [V]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = list(prompt)
    for _ in range(n):
        out.append(int(hf_logits(model, out).argmax()))
    return out[len(prompt):]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("lean", [True, False])
def test_runner_logits_equal_the_hf_forward(name, lean):
    model = family(name)
    fam = VARIANTS.get(name, (name,))[0]
    if lean and PATH[fam] == "hf":
        pytest.skip("no lean forward for this family: the lean=False case covers its runner")
    r = make_runner(model, lean)
    assert isinstance(r, LeanLlama if lean else HFFallback)
    P = prompts()
    B, T = len(P), max(LENS)
    r.reset(B, 64)
    toks = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(P):
        toks[b, :len(p)] = torch.tensor(p)
    r.aux_layers = (0, 1)  # EAGLE-3's features: the residual streams entering layers 0 and 1
    with torch.no_grad():
        logits, feats = r(toks, torch.arange(T).expand(B, T), T)  # prefill, right-padded
        for b, p in enumerate(P):
            for t in (0, len(p) - 1):
                torch.testing.assert_close(logits[b, t], hf_logits(model, p[:t + 1]), atol=1e-4, rtol=1e-4)
            hs = model(input_ids=torch.tensor([p]), output_hidden_states=True).hidden_states
            torch.testing.assert_close(feats[b, :len(p)], torch.cat([hs[0][0], hs[1][0]], -1), atol=1e-5, rtol=1e-5)
        r.aux_layers = None
        seqs, n = [list(p) for p in P], torch.tensor(LENS)
        # ragged steps of 1 and of 3 tokens, each row at its own positions
        for step in (1, 3, 1, 3):
            new = torch.randint(3, V, (B, step), generator=torch.Generator().manual_seed(step + int(n.sum())))
            pos = n[:, None] + torch.arange(step)
            logits, _ = r(new, pos, int(pos.max()) + 1)
            for b in range(B):
                seqs[b] += new[b].tolist()
                torch.testing.assert_close(logits[b, -1], hf_logits(model, seqs[b]), atol=1e-4, rtol=1e-4)
            n = n + step
        # a token tree per row: node j at slot n + j, position n + depth. Row 2's deepest node is 8 positions
        # past its ancestor at slot n + 2, depth 1: outside the window by position, inside it by slot.
        rows = [([5, 6, 7, 8, 9], [0, 1, 0, 3, 2]), ([10, 11, 12], [0, 0, 2]),
                (list(range(13, 23)), [0, 0, 2, 3, 4, 5, 6, 7, 8, 9])]
        tree = Tree.from_lists(rows, torch.device("cpu"))
        cur = torch.tensor([[3], [4], [3]])
        inp = torch.cat([cur, tree.tokens], 1)
        s_len = int(n.max()) + inp.shape[1]
        logits, _ = r(inp, n[:, None] + tree.depth, s_len, slots=n[:, None] + torch.arange(inp.shape[1]),
                      mask=tree.mask(n, s_len))
        for b, (toks_b, _) in enumerate(rows):
            for j in range(len(toks_b) + 1):
                path = [inp[b, i].item() for i in tree.path(b, j)]
                torch.testing.assert_close(logits[b, j], hf_logits(model, seqs[b] + path), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_speculative_equals_plain_greedy(name):
    fam = VARIANTS.get(name, (name,))[0]
    model = family(name)
    assert runner_path(model) == PATH[fam]
    P = prompts(1)
    ref = [hf_greedy(model, p, N_NEW) for p in P]
    plain = SpeculativeDecoder(model, None)
    assert plain.runner.path == PATH[fam]
    assert plain.generate(P, max_new_tokens=N_NEW).sequences == ref
    assert plain.generate(P[:1], max_new_tokens=N_NEW).sequences == ref[:1]
    draft = family(name, seed=0, layers=1)  # partly agrees with the target: rounds accept and reject
    for make in (lambda: DraftLMProposer(draft, V),  # chains
                 lambda: HybridProposer(DraftLMProposer(draft, V), min_match=1, k_ngram=4, max_nodes=12)):
        for rows, want in ((P, ref), (P[:1], ref[:1])):  # ragged and batch 1
            dec = SpeculativeDecoder(model, make(), k=3)
            res = dec.generate(rows, max_new_tokens=N_NEW)
            assert res.sequences == want, (name, type(dec.proposer).__name__, len(rows))
            assert res.stats["proposed"] > 0
            assert (res.stats["tree_rounds"] > 0) == dec.proposer.trees
