"""Tiny models, data and proposers shared by the tests (built from configs: no download, seconds).

Test modules import from here, never from each other; fixtures live in conftest.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from eval import draft_dir
from eval.proposers import Proposer, Sampling

# ------------------------------------------------------------------------- decoder-sized Llamas

DECODER_V = 96
PROMPTS = [[1, 5, 9, 3, 5, 9, 4], [7, 7, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [12]]
N_NEW = 16


def decoder_llama(seed, layers=2, hidden=48, heads=4, kv=2):
    """A random fp32 Llama over DECODER_V tokens: the decoder tests' target and draft."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=DECODER_V, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      max_position_embeddings=256, initializer_range=0.1, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


class NoChain(Proposer):
    """A model proposer that drafts a chain nobody accepts (token 0 is never a continuation here)."""

    def begin(self, prompts, first, max_len, sampling, features=None):
        self.B = len(prompts)

    def propose(self, k):
        return torch.zeros(self.B, k, dtype=torch.long), None

    def accept(self, tokens, start, n_acc, bonus, features=None):
        pass


# ------------------------------------------------------------------------- lossless sampling

SAMPLING_V = 24
SAMPLING_PROMPT = [3, 7, 3, 7, 3]


def sampling_llama(seed, layers=2, hidden=32, heads=4, kv=2, init=0.3):
    """A random Llama over SAMPLING_V tokens, peaked enough for chi-square tests of its samples."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=SAMPLING_V, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      max_position_embeddings=64, initializer_range=init)
    return LlamaForCausalLM(cfg).eval()


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to `probs` [V]; cells with expected count < 5 pooled."""
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    exp = probs.double() * n
    if (counts[exp == 0] > 0).any():
        return 0.0  # a sample where the target puts no mass (checked before pooling hides it in a pooled cell)
    small = exp < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    counts, exp = counts[keep], exp[keep]
    stat = ((counts - exp) ** 2 / exp).sum()
    df = max(counts.numel() - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def wrong_residual(p, q):
    return p  # the classic bug: resample from p after a rejection


def exact_marginals(target, s: Sampling, n: int = 2, prompt=SAMPLING_PROMPT) -> list[torch.Tensor]:
    """p(x_1), ..., p(x_n) under the warped target after `prompt`, each summed over every path before it (the
    last over V^(n-1) contexts), computed on the target's device and returned on the CPU, [V] each."""
    V, dev = SAMPLING_V, target.device
    ctx = torch.tensor([prompt], device=dev)  # [V^i, L + i]: every path of i tokens after the prompt
    joint = torch.ones(1, device=dev)  # [V^i] each path's probability
    out = []
    with torch.no_grad():
        for i in range(n):
            step = joint[:, None] * s.probs(target(ctx).logits[:, -1])  # [V^i, V]: a path, then its next token
            out.append(step.sum(0).cpu())
            if i + 1 < n:
                joint = step.reshape(-1)  # path p then x -> path p * V + x
                ctx = torch.cat([ctx.repeat_interleave(V, 0), torch.arange(V, device=dev).repeat(len(ctx))[:, None]], 1)
    return out


def e2e_pvalues(target, proposer, warp, draws=10000, calls=2, k=2, **decoder_kw):
    """Chi-square p-values of the first k + 2 tokens the decoder samples against the exact marginals: the
    prefill's token, then a first round's k draft positions and its bonus token (`decoder_kw`: more
    SpeculativeDecoder arguments, e.g. compile=True)."""
    from eval.decoder import SpeculativeDecoder

    n = k + 2
    dec = SpeculativeDecoder(target, proposer, k=k, **decoder_kw)
    outs = []
    for seed in range(calls):
        res = dec.generate([SAMPLING_PROMPT] * (draws // calls), max_new_tokens=n, seed=seed, **warp)
        outs.append(torch.tensor(res.sequences))
    out = torch.cat(outs)  # [draws, n]
    ps = exact_marginals(target, Sampling(**warp), n)
    return [chi2_pvalue(out[:, i], ps[i]) for i in range(n)], res.stats


# ------------------------------------------------------------------------- training data

TRAIN_V, TOPK = 128, 8


def first_drafts(target, prop, prompt, k, n_new):
    """Decode `prompt` (batch 1) with a feature-reading proposer, recording each round's current position
    and first draft: -> (prompt + output, [(position, first draft)]), for comparing with the uncached head."""
    from eval.decoder import SpeculativeDecoder

    seen, orig = [], prop.propose

    def spy(k):
        d, q = orig(k)
        seen.append((int(prop.pos[0]), int(d[0, 0])))
        return d, q

    prop.propose = spy
    res = SpeculativeDecoder(target, prop, k=k).generate([prompt], max_new_tokens=n_new)
    return prompt + res.sequences[0], seen


def tiny_llama(num_layers: int = 2):
    """A random Llama over TRAIN_V tokens with tied embeddings: the train tests' target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=TRAIN_V, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def greedy_topk(target, prompt, n):
    """The target's greedy continuation of `prompt` with its top-TOPK log-probs at every new position."""
    ids = list(prompt)
    tk_ids, tk_lp = [], []
    for _ in range(n):
        lp = torch.log_softmax(target(torch.tensor([ids])).logits[0, -1].float(), -1)
        v, ix = lp.topk(TOPK)
        tk_ids.append(ix.tolist()), tk_lp.append(v.tolist())
        ids.append(int(ix[0]))
    return ids[len(prompt):], tk_ids, tk_lp


def greedy_rows(target, vocab: int, lens=(10, 14, 7), plen=5, seed=0):
    """Training rows of the target's own greedy completions with their top-k, one per completion length
    (ragged, so a batch of them is right-padded), after random 5-token prompts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        prompt = torch.randint(0, vocab, (plen,), generator=g).tolist()
        comp, tk_ids, tk_lp = greedy_topk(target, prompt, n)
        out.append({"ids": prompt + comp, "P": plen, "tk_ids": tk_ids, "tk_lp": tk_lp})
    return out


def make_generate(run_dir, target, n_rows=12, plen=6, clen=24, seed=0, target_name="tiny"):
    """A generate stage's output (one complete shard) of `target`'s greedy completions of random prompts."""
    from datasets import Dataset

    from pipeline.shards import record_shard, save_shard

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_rows):
        prompt = torch.randint(0, TRAIN_V, (plen,), generator=g).tolist()
        comp, tk_ids, tk_lp = greedy_topk(target, prompt, clen)
        rows.append({"id": str(i), "prompt_ids": prompt, "completion_ids": comp, "topk_ids": tk_ids,
                     "topk_logprobs": tk_lp})
    gen = run_dir / "generate"
    e = save_shard(gen, 0, Dataset.from_list(rows))
    record_shard(gen, 0, e, header={"complete": True, "target": target_name, "top_k": TOPK})
    return rows


def train_recipe(**train):
    """A float32 CPU recipe for the tiny target with a few-step training budget; `train` overrides it."""
    from pipeline.config import recipe_from_dict

    base = dict(method="eagle", steps=6, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1, save_every=2,
                draft_vocab_size=0)
    return recipe_from_dict({"target": "tiny", "dtype": "float32", "device": "cpu", "seed": 0,
                             "train": {**base, **train}})


def copy_generate(src, dst):
    """A new run directory holding a copy of `src`'s generate stage."""
    shutil.copytree(src / "generate", dst / "generate")
    return dst


# ------------------------------------------------------------------------- bench-sized models

WORDS = [f"w{i}" for i in range(60)]


def word_tokenizer(extra_word: str | None = None):
    """A word-level tokenizer over WORDS (+ extra_word: a tokenizer that differs), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS + ([extra_word] if extra_word else []):
        vocab[w] = len(vocab)
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w0 {% endif %}")
    return tok


def save_word_llama(path, tok, layers=2, seed=0, kind=None):
    """A random Llama over `tok`'s vocabulary saved as an HF directory (a draft directory of `kind` when given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    if kind:
        (path / draft_dir.FILE).write_text(json.dumps({"kind": kind, "target": "tiny"}))
    return path


# ------------------------------------------------------------------------- distill budgets

TINY_BUDGET = [
    "data.max_prompts=24", "data.max_prompt_tokens=96",
    "generate.max_new_tokens=12", "generate.batch_size=4", "generate.batches_per_shard=2",
    "train.steps=4", "train.save_every=2", "train.batch_size=4", "train.seq_len=64", "train.draft_vocab_size=512",
    "evaluate.n_prompts=2", "evaluate.max_new_tokens=12", "evaluate.fp32_prompts=1", "evaluate.fit_prompts=2",
    # the report's curves (pipeline/sweeps.py), which every distill measures: two points each
    "report.n_prompts=2", "report.max_new_tokens=12", "report.ks=[1,2]", "report.batch_sizes=[1,2]",
    "report.temperatures=[0,1.0]",
    # the gate judges the 2 held-out prompts (its default minimum is 8 prompts, 512 tokens)
    "retrain.min_prompts=2", "retrain.min_tokens=8",
]


# ------------------------------------------------------------------------- Medusa heads

MEDUSA_NH = 3  # heads in the Medusa tests


def medusa_target():
    """A tiny Llama over TRAIN_V tokens with a sharper LM head: at initializer_range 0.2 its next-token
    distributions are nearly flat (top-1 ~0.1), so the order of the top tokens is noise the heads
    cannot learn; scaled x3 (untied) the top-1 has ~0.5 of the mass, like a real model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=TRAIN_V, max_position_embeddings=256, initializer_range=0.2,
                      tie_word_embeddings=False)
    t = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        t.lm_head.weight.mul_(3.0)
    return t


def perturbed_recurrent_heads(target, seed=0, draft_ids=None, num_heads=MEDUSA_NH):
    """Fresh recurrent Medusa heads with random blocks (fresh ones are the identity: drafts would not
    depend on the tokens they read)."""
    from eval.heads import MedusaHeads

    torch.manual_seed(seed)
    heads = MedusaHeads.from_target(target, num_heads, draft_ids=draft_ids, recurrent=True)
    with torch.no_grad():
        for blk in heads.blocks:
            blk.down.weight.normal_(0, 0.3)
    return heads.eval()


@torch.no_grad()
def medusa_rows(target, n_rows=16, clen=24, seed=0):
    """The target's own greedy continuations of random prompts (3..8 tokens; `clen` tokens or up to
    the config's EOS, id 2, which HF generate stops at), with its top-k teacher at every completion
    token and its features (final-norm hidden states) at every position, in the item format of the
    train stage's sequences (+ "feat")."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n_rows):
        P = int(torch.randint(3, 9, (1,), generator=g))
        prompt = torch.randint(0, TRAIN_V, (1, P), generator=g)
        ids = target.generate(prompt, max_new_tokens=clen, do_sample=False, pad_token_id=0)  # [1, n]
        feat = target.model(ids).last_hidden_state[0]  # [n, H]
        lp = torch.log_softmax(target.lm_head(feat).float(), -1)  # row p: distribution of token p + 1
        v, ix = lp[P - 1:-1].topk(TOPK, -1)  # teacher of tokens P..n-1
        items.append({"ids": ids[0], "P": P, "tk_ids": ix, "tk_lp": v, "feat": feat})
    return items


def medusa_tc(divergence="fkl"):
    """The part of a TrainConfig the Medusa trainer reads."""
    from types import SimpleNamespace

    return SimpleNamespace(divergence=divergence, jsd_beta=0.5, temperature=1.0)


def frozen_embedding(target):
    """A frozen copy of the target's input embedding (what recurrent heads read while training)."""
    return torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().clone(), freeze=True)


def fit_steps(trainer, params, batch, steps: int, lr: float = 1e-2) -> tuple[dict, dict]:
    """`steps` AdamW steps of `trainer` ((loss, metrics) = trainer(batch)) on one batch -> (the first step's
    metrics, the last step's)."""
    opt = torch.optim.AdamW(params, lr=lr)
    first = metrics = None
    for _ in range(steps):
        loss, metrics = trainer(batch)
        first = first or metrics
        opt.zero_grad()
        loss.backward()
        opt.step()
    return first, metrics


def train_medusa_heads(target, recurrent: bool):
    """Medusa heads trained on the target's greedy continuations (150 steps): (heads, metrics before,
    metrics after, items)."""
    from eval.heads import MedusaHeads
    from pipeline.methods.medusa import MedusaTrainer
    from pipeline.train_data import collate

    items = medusa_rows(target)
    batch = collate(items)
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, MEDUSA_NH, recurrent=recurrent)
    trainer = MedusaTrainer(heads, medusa_tc(), frozen_embedding(target) if recurrent else None)
    first, _ = fit_steps(trainer, heads.parameters(), batch, 150)
    with torch.no_grad():
        last = trainer(batch)[1]
    return heads.eval(), first, last, items


def free_port() -> int:
    """A TCP port free now, for an `accelerate launch` rendezvous (a fixed one can be taken by another run)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(root) -> dict:
    """The environment of a two-process CPU `accelerate launch` in a test: gloo workers on one thread each, and
    every thread's Python stack printed if a worker aborts."""
    import os

    return dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=str(root), PYTHONFAULTHANDLER="1")


# ------------------------------------------------------------------------- W&B offline runs

def wandb_logged(path) -> dict:
    """{key: value} of the scalars a W&B run file records (history and summary items: a protobuf
    key field, 1 or 2, followed by its `value_json`), read from the bytes: wandb ships no Python reader."""
    blob = Path(path).read_bytes()
    out = {}
    for m in re.finditer(rb"[\x0a\x12]([\x01-\x7f])", blob):
        n, start = m.group(1)[0], m.end()
        key, rest = blob[start:start + n], blob[start + n:start + n + 3]
        if rest[:2] == b"\x82\x01" and rest[2] < 0x80 and re.fullmatch(rb"[\x20-\x7e]+", key):
            value = blob[start + n + 3:start + n + 3 + rest[2]]
            try:
                out[key.decode()] = json.loads(value)
            except ValueError:
                pass
    return out
