"""`data.source: self`: training and held-out prompts written by the target itself, for an owner with no data.

An aligned chat model fed only its chat template's user-turn prefix (the text a user's message would follow)
writes a realistic user request and closes the turn (Magpie, Xu et al. 2024, arXiv:2406.08464). A system
prompt, or the beginnings of requests (`seeds`) the model continues, steer the requests toward a domain
(JSON output, say). The requests are filtered (turn closed, long enough, not degenerate), deduplicated, and
split: training requests from the recipe's seed, held-out ones from a separate seed, deduplicated against
training. They become chat rows ({"messages": [system?, user]}) that the generate stage completes as usual.

`run_dir/data.json` records what was made and dropped (and, with `check_json`, the share of the target's
completions that parse as JSON: `json_parse_rate`), and the report shows it.
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .options import RecipeError, option, positive, sampling

HELDOUT_SEED_OFFSET = 1_000_003  # held-out requests are sampled from seed + this: never the training stream
_SENTINEL = "\x00draftsmith-user-turn\x00"


@dataclass
class SynthOptions:
    prompts: int = option(600, "data.source=self: user requests synthesised for training (after filtering and "
                               "deduplication; data.max_prompts still caps them).")
    heldout: int = option(48, "data.source=self: held-out requests, sampled from a separate seed and deduplicated "
                              "against the training ones (evaluate judges on these).")
    system: typing.Optional[str] = option(None, "System prompt every synthesised conversation carries (steers the "
                                                "requests and the answers, e.g. toward JSON); None = the chat "
                                                "template's own default.")
    seeds: list[str] = option([], "Beginnings of user requests the target continues, cycled over the batch (steer "
                                  "the domain); [] = the bare user-turn prefix (Magpie).")
    max_new_tokens: int = option(48, "Longest request in tokens; a request that has not closed its turn by then "
                                     "is dropped as truncated.")
    temperature: float = option(1.0, "Sampling temperature for the requests (Magpie samples at 1.0).")
    top_p: float = option(0.95, "Nucleus sampling mass for the requests.")
    min_chars: int = option(16, "Requests shorter than this many characters are dropped.")
    batch_size: int = option(32, "Requests sampled per decoder batch.")
    check_json: bool = option(False, "Record the share of the target's completions that hold a JSON value "
                                     "(json_parse_rate in data.json and the report): for JSON domains.")

    def __post_init__(self):
        for k in ("prompts", "heldout", "max_new_tokens", "min_chars", "batch_size"):
            positive(f"data.synth.{k}", getattr(self, k))
        positive("data.synth.temperature", self.temperature)  # sampled: 0 would be greedy
        sampling("data.synth.", self.temperature, top_p=self.top_p)
        if any(not isinstance(s, str) or not s.strip() for s in self.seeds):
            raise RecipeError("data.synth.seeds must be non-empty strings (beginnings of user requests)")


class SynthError(ValueError):
    """The target cannot write its own prompts; the message says why and what to give instead."""


# ---------------------------------------------------------------------------------------------
# the user-turn prefix


def user_turn(tokenizer, system: str | None) -> tuple[str, str]:
    """(the chat text up to where a user's message starts, the text that closes a user turn), read off the
    tokenizer's own chat template with a sentinel message."""
    if not getattr(tokenizer, "chat_template", None):
        raise SynthError("data.source=self needs a chat model: this target's tokenizer has no chat template; "
                         "give data.source a .jsonl/.parquet of your prompts instead")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if _SENTINEL not in text:
        raise SynthError("data.source=self: the chat template does not place the user's message verbatim; "
                         "give data.source a file of your prompts instead")
    before, after = text.split(_SENTINEL, 1)
    return before, after.strip()


def _stop_ids(model, tokenizer, close: str) -> set[int]:
    """Token ids that end a request: the model's EOS ids and the first token of the turn-closing text."""
    from eval.loading import target_eos_ids

    ids = target_eos_ids(model, tokenizer)
    if close:
        ids.add(tokenizer(close, add_special_tokens=False)["input_ids"][0])
    return ids


# ---------------------------------------------------------------------------------------------
# filtering


def _key(text: str) -> str:
    """Case- and whitespace-insensitive form of a request, for deduplication."""
    return re.sub(r"\s+", " ", text.lower()).strip()


def _degenerate(text: str) -> bool:
    """A request that loops on itself (a handful of distinct words repeated) is sampling noise, not a user."""
    words = text.split()
    return len(words) >= 12 and len(set(words)) < 0.35 * len(words)


def _reason(text: str, finished: bool, opts: SynthOptions, markers: list[str]) -> str | None:
    """Why a sampled request is dropped, or None to keep it."""
    if not finished:
        return "truncated"
    if len(text) < opts.min_chars:
        return "short"
    if any(m and m in text for m in markers):
        return "template_text"
    if _degenerate(text):
        return "degenerate"
    return None


# ---------------------------------------------------------------------------------------------
# sampling


def sample_requests(model, tokenizer, opts: SynthOptions, n: int, seed: int, exclude: set[str] = frozenset(),
                    desc: str = "synth") -> tuple[list[str], dict]:
    """Up to `n` distinct requests (not in `exclude`, keys as `_key`) sampled from the target's user turn with
    `seed`; -> (requests, counts: sampled and each drop reason). Sampling stops after 4x `n` attempts."""
    from eval.decoder import SpeculativeDecoder

    prefix, close = user_turn(tokenizer, opts.system)
    seeds = opts.seeds or [""]
    stops = _stop_ids(model, tokenizer, close)
    markers = [close, getattr(tokenizer, "bos_token", None) or "", "<|im_start|>"]
    dec = SpeculativeDecoder(model, None, k=1)
    seen = set(exclude)
    out, counts = [], {"sampled": 0}
    bar = tqdm(total=n, desc=desc, leave=False)
    batch_no = 0
    while len(out) < n and counts["sampled"] < 4 * n:
        starts = [seeds[(batch_no * opts.batch_size + i) % len(seeds)] for i in range(opts.batch_size)]
        ids = [tokenizer(prefix + s, add_special_tokens=False)["input_ids"] for s in starts]
        res = dec.generate(ids, max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                           top_p=opts.top_p, eos_token_id=stops, seed=seed * 100_003 + batch_no)
        batch_no += 1
        for start, new in zip(starts, res.sequences):
            counts["sampled"] += 1
            finished = bool(new) and new[-1] in stops
            text = (start + tokenizer.decode(new[:-1] if finished else new, skip_special_tokens=True)).strip()
            why = _reason(text, finished, opts, markers)
            if why is None and _key(text) in seen:
                why = "duplicate"
            if why is not None:
                counts[why] = counts.get(why, 0) + 1
                continue
            seen.add(_key(text))
            out.append(text)
            bar.update(1)
            if len(out) >= n:
                break
    bar.close()
    return out, counts


def _rows(requests: list[str], split: str, system: str | None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return [{"id": f"self-{split}-{i:05d}", "messages": head + [{"role": "user", "content": r}]}
            for i, r in enumerate(requests)]


def build_self_prompt_sets(recipe, run_dir, model, tokenizer) -> dict[str, list[dict]]:
    """data.source=self: synthesise the training and held-out requests, write them beside the prompt sets
    (prompts/self-{train,heldout}.jsonl) and build the sets from them (pipeline.data.build_prompt_sets); record
    what was made and dropped in run_dir/data.json. A run that already has them reuses them."""
    from .data import DataError, build_prompt_sets, read_jsonl, write_jsonl

    run_dir = Path(run_dir)
    opts = recipe.data.synth
    train_p, held_p = run_dir / "prompts" / "self-train.jsonl", run_dir / "prompts" / "self-heldout.jsonl"
    if not (train_p.exists() and held_p.exists()):
        try:
            train, c_train = sample_requests(model, tokenizer, opts, opts.prompts, recipe.seed, desc="synth train")
            held, c_held = sample_requests(model, tokenizer, opts, opts.heldout, recipe.seed + HELDOUT_SEED_OFFSET,
                                           exclude={_key(t) for t in train}, desc="synth held-out")
        except SynthError as e:
            raise DataError(str(e)) from None
        if not train or not held:
            raise DataError(f"data.source=self kept {len(train)} training and {len(held)} held-out requests of "
                            f"{c_train['sampled'] + c_held['sampled']} sampled (dropped: {c_train} / {c_held}); "
                            f"raise data.synth.max_new_tokens or lower data.synth.min_chars")
        write_jsonl(train_p, _rows(train, "train", opts.system))
        write_jsonl(held_p, _rows(held, "heldout", opts.system))
        write_data_report(run_dir, {"source": "self", "method": "magpie", "system": opts.system,
                                    "seeds": opts.seeds, "train": c_train, "heldout": c_held,
                                    "n_train_requests": len(train), "n_heldout_requests": len(held)})
    return build_prompt_sets(recipe.data, run_dir, tokenizer, recipe.seed, rows=read_jsonl(train_p),
                             heldout_rows=read_jsonl(held_p))


# ---------------------------------------------------------------------------------------------
# data.json and the JSON parse rate


def write_data_report(run_dir, fields: dict) -> dict:
    """Merge `fields` into run_dir/data.json (written aside and renamed)."""
    from .shards import write_json_atomic

    path = Path(run_dir) / "data.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(fields)
    write_json_atomic(path, data)
    return data


def holds_json(text: str) -> bool:
    """Whether `text` holds a JSON object or array: the whole reply, or the first one in it (after a
    ```json fence or a sentence of preamble), as `json.JSONDecoder.raw_decode` reads it."""
    text = text.strip()
    fence = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if fence:
        text = fence.group(1).strip()
    dec = json.JSONDecoder()
    for m in re.finditer(r"[\[{]", text):
        try:
            dec.raw_decode(text, m.start())
            return True
        except json.JSONDecodeError:
            continue
    return False


def json_parse_rate(stage_dir, tokenizer) -> tuple[float, int]:
    """(share of the generate stage's completions that hold JSON, completions read)."""
    from .shards import load_shards

    comps = load_shards(stage_dir)["completion_ids"]
    ok = sum(holds_json(tokenizer.decode(c, skip_special_tokens=True)) for c in comps)
    return (ok / len(comps) if comps else 0.0), len(comps)
