"""The report's measurements (pipeline/owner_report.py): the promoted draft (or any draft) against plain
decoding in the project's decoder, as curves over K, batch size and sampling temperature.

- K curve: the draft at every report.ks, all taking turns with plain decoding on each prompt (one
  decode_together call): vLLM's mean_acceptance_length and the measured speedup at each K.
- batch curve: at every report.batch_sizes, plain decoding, the draft at the recipe's K and the draft under
  the K controller (k="auto") take turns batch by batch (report.batch_turns batches at least) in the decoder's
  ragged batches; tokens/s, speedup, the K the controller settled on (vllm_k_schedule turns them into vLLM's
  K-by-batch table), and the greedy outputs compared (eval.exactness: match rate, divergences and their
  near-tie margins). Exactness is claimed per measured batch size only.
- temperature curve: at every report.temperatures, lossless speculative sampling against plain sampled
  decoding (prompt i seeded `seed + i`; 0 = greedy): speedup, α, mean acceptance length.
- with --draft / --prompts (`draftsmith report`): that draft on those prompts at the recipe's K, with the
  n-gram baseline, measured and judged as evaluate judges a candidate ("main").

Every measurement is kept in run_dir/report/ (another draft or prompt set: run_dir/report/custom-<hash>/;
pipeline.measure.MeasurementCache) keyed by the prompts, the settings and the draft's files, so a rerun
reads it back instead of measuring again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eval import draft_dir
from eval.bench import cycled_batches, turn_order, turn_ratios
from eval.decoder import CONTROLLER_REV, SpeculativeDecoder
from eval.exactness import compare_greedy, exactness_rule
from eval.prompt_file import PromptFileError, read_prompt_rows

from .config import stable_hash
from .data import encode_prompt
from .measure import MeasurementCache, aggregate, decode_together, proposer_for, vllm_acceptance


class SweepError(ValueError):
    pass


@dataclass
class Sweeps:
    """What the curves are measured with: the target, the draft, the prompts and the cache."""

    target: object
    source: str  # the draft directory load_proposer loads (best/ by default)
    rows: list[dict]  # the prompt rows (prompt or messages, maybe a category), in order
    prompts: list[list[int]]  # their token ids
    prompts_file: str  # where the rows came from
    eos: int | None
    k: int  # the recipe's K: the batch and temperature curves' and the main measurement's
    ngram_k: int
    max_new_tokens: int
    near_tie_tol: float
    dtype: str
    seed: int
    cfg: object  # the recipe's ReportConfig
    compile: bool  # evaluate.compile: the decoders' compiled step, as evaluate measured
    cache: MeasurementCache
    run_dir: Path

    def file(self, name: str) -> str:
        """A measurement's file, relative to the run directory."""
        return str((self.cache.directory / f"{name}.json").relative_to(self.run_dir))

    @classmethod
    def open(cls, recipe, run_dir: Path, target, tokenizer, draft: str | Path | None = None,
             prompts_file: str | Path | None = None) -> "Sweeps":
        run_dir = Path(run_dir).resolve()
        source = Path(draft).resolve() if draft else run_dir / "best"
        if not draft_dir.is_draft_dir(source):
            raise SweepError(f"{source} is not a draft directory (no draftsmith_draft.json); give --draft a "
                             f"checkpoint or best/ directory, or finish the run's evaluate stage first")
        rows, path = prompt_rows(recipe, run_dir, prompts_file)
        prompts = [encode_prompt(r, tokenizer, recipe.data.chat) for r in rows]
        if any(not p for p in prompts):
            raise SweepError(f"{path}: a prompt encodes to zero tokens; drop the empty rows")
        cfg = recipe.report
        max_new = cfg.max_new_tokens or recipe.evaluate.max_new_tokens
        settings = {"dtype": recipe.dtype, "max_new_tokens": max_new, "prompts": stable_hash(prompts),
                    "near_tie_tol": recipe.evaluate.near_tie_tol, "seed": recipe.seed}
        if recipe.evaluate.compile:  # keyed only when set, like config.LATER_KEYS
            settings["compile"] = True
        cache = run_dir / "report"
        if draft or prompts_file:  # another draft or prompt set: its own directory, beside the run's own curves
            cache = cache / f"custom-{stable_hash([str(source.resolve()), settings['prompts']])}"
        return cls(target, str(source), rows, prompts, str(path), tokenizer.eos_token_id, recipe.evaluate.k,
                   recipe.evaluate.ngram_k, max_new, recipe.evaluate.near_tie_tol, recipe.dtype, recipe.seed, cfg,
                   recipe.evaluate.compile, MeasurementCache(cache, settings), run_dir)

    def _cached(self, name: str, extra: dict, measure) -> dict:
        got = self.cache.read(name, self.source, extra)
        return got if got is not None else self.cache.store(name, measure(), self.source, extra)

    # ------------------------------------------------------------------ the measurements
    def main(self) -> dict:
        """The draft at the recipe's K and the n-gram baseline, taking turns with plain decoding on each
        prompt, judged as evaluate judges a candidate: {"draft": result, "ngram": result}."""
        def measure():
            props = {"draft": (proposer_for(self.source, self.target), self.k),
                     "ngram": (proposer_for("ngram", self.target), self.ngram_k)}
            plain_seqs, plain, outs = decode_together(self.target, props, self.prompts, self.max_new_tokens,
                                                      self.eos, "report: draft+ngram", self.compile)
            out = {}
            for name, (seqs, stats) in outs.items():
                match = compare_greedy(self.target, self.prompts, plain_seqs, seqs, tol=self.near_tie_tol)
                out[name] = {"name": name, "source": self.source if name == "draft" else "ngram", "stats": stats,
                             "plain_stats": plain, "speedup": _ratio(stats, plain), "match_rate": match["match_rate"],
                             "exact_match": bool(match["exact"]), "divergences": match["divergences"],
                             "all_near_ties": bool(match["all_near_ties"]),
                             "exactness_rule": exactness_rule(self.dtype, stats.get("row_invariant", False))}
            return out
        return self._cached("main", {"k": self.k, "ngram_k": self.ngram_k}, measure)

    def k_curve(self) -> dict:
        """The draft at every K in report.ks, all taking turns with plain decoding on each prompt."""
        ks = list(self.cfg.ks)

        def measure():
            props = {f"K={k}": (proposer_for(self.source, self.target), k) for k in ks}
            _, plain, outs = decode_together(self.target, props, self.prompts, self.max_new_tokens, self.eos,
                                             "report: K curve", self.compile)
            return {"rows": [_row(outs[f"K={k}"][1], plain) | {"k": k} for k in ks]}
        return self._cached("k-curve", {"ks": ks}, measure)

    def batch_point(self, b: int) -> dict:
        """Plain decoding, the draft at the recipe's K and the draft under the K controller (k="auto": each
        round's K from measured costs, 0 where speculation does not pay), greedy, in batches of `b`, taking
        turns batch by batch, each decoder report.batch_turns batches at least (the prompts cycled to fill
        them); their outputs compared with plain decoding's."""
        turns = self.cfg.batch_turns

        def measure():
            batches = cycled_batches(self.prompts, b, turns)
            prompts = [p for batch in batches for p in batch]
            decs = [SpeculativeDecoder(self.target, None, compile=self.compile),
                    SpeculativeDecoder(self.target, proposer_for(self.source, self.target), k=self.k,
                                       compile=self.compile),
                    SpeculativeDecoder(self.target, proposer_for(self.source, self.target), k="auto",
                                       compile=self.compile)]
            for dec in decs:  # warm-up, not timed; compiled: every batch once, so each shape compiles here
                for batch in batches if self.compile else [[p[:16] for p in batches[0]]]:
                    dec.generate(batch, max_new_tokens=self.max_new_tokens if self.compile else 4,
                                 eos_token_id=self.eos)
            seqs, stats = ([], [], []), ([], [], [])
            for i, batch in enumerate(batches):
                for j in turn_order((0, 1, 2), i):  # each decoder first in turn
                    res = decs[j].generate(batch, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos)
                    seqs[j].extend(res.sequences)
                    stats[j].append(res.stats)
            plain, spec, auto = (aggregate(s) for s in stats)
            # each turn's own ratio over plain's: what one batch's text and the drift between calls move a ratio by
            by_turn = [turn_ratios([(st["n_tokens"], st["wall_s"]) for st in stats[j]],
                                 [(st["n_tokens"], st["wall_s"]) for st in stats[0]]) for j in (1, 2)]
            match = compare_greedy(self.target, prompts, seqs[0], seqs[1], tol=self.near_tie_tol)
            m_auto = compare_greedy(self.target, prompts, seqs[0], seqs[2], tol=self.near_tie_tol)
            choices = [k for s in stats[2] for k in s["k_choices"]]
            warm = stats[2][0]["k_warmup_choices"]  # a later call at this batch size starts warmed up
            return _row(spec, plain) | {
                "batch_size": b, "n_sequences": len(prompts), "dtype": self.dtype, "speedup_turns": by_turn[0],
                "row_invariant": spec.get("row_invariant", False), "match_rate": match["match_rate"],
                "exact": bool(match["exact"]), "n_divergences": len(match["divergences"]),
                "max_divergence_margin": max((d["margin"] for d in match["divergences"]), default=None),
                "all_near_ties": bool(match["all_near_ties"]), "divergences": match["divergences"],
                "controlled": _row(auto, plain) | {
                    "speedup_turns": by_turn[1], "k_chosen": settled_k(choices, warm), "k_choices": choices,
                    "k_warmup_choices": warm,
                    "spec_off_fraction": choices.count(0) / len(choices) if choices else 0.0,
                    "match_rate": m_auto["match_rate"], "exact": bool(m_auto["exact"]),
                    "n_divergences": len(m_auto["divergences"])}}
        return self._cached(f"batch-{b}", {"batch_size": b, "k": self.k, "controlled": CONTROLLER_REV, "turns": turns},
                            measure)

    def temperature_point(self, t: float) -> dict:
        """The draft at the recipe's K against plain decoding at temperature `t` (lossless speculative
        sampling, prompt i seeded seed + i; greedy at 0), with the share of its rounds verified as token trees
        (a hybrid's, greedy or sampled; chains otherwise)."""
        sampling = None if t == 0 else {"temperature": t, "top_p": 1.0, "top_k": 0, "seed": self.seed}

        def measure():
            _, plain, outs = decode_together(self.target, {"draft": (proposer_for(self.source, self.target), self.k)},
                                             self.prompts, self.max_new_tokens, self.eos, f"report: T={t:g}",
                                             self.compile, sampling)
            st = outs["draft"][1]
            return _row(st, plain) | {"temperature": t, "sampling": sampling,
                                      "tree_share": st["tree_rounds"] / st["rounds"] if st["rounds"] else 0.0}
        return self._cached(f"temperature-{t:g}", {"temperature": t, "k": self.k}, measure)

    def curves(self) -> dict:
        """{"k": [...], "batch": [...], "temperature": [...]} rows, each measured or read back."""
        return {"k": self.k_curve()["rows"],
                "batch": [self.batch_point(b) for b in self.cfg.batch_sizes],
                "temperature": [self.temperature_point(float(t)) for t in self.cfg.temperatures]}


def settled_k(choices: list[int], warm: int) -> int:
    """The K the controller settled on: the one it chose most after its `warm` warm-up choices (ties: the
    smaller K)."""
    after = choices[warm:] or choices
    return min(set(after), key=lambda k: (-after.count(k), k)) if after else 0


def vllm_k_schedule(points: list[tuple[int, int]]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` (SpeculativeConfig, vLLM 0.32): inclusive batch-size
    ranges [start, end, K] from the measured (batch size, K) points, each point's K covering the batch sizes
    above the previous point up to its own; vLLM carries the last range's K on to larger batches."""
    out, start = [], 1
    for b, k in sorted(points):
        if out and out[-1][2] == k:
            out[-1][1] = b
        else:
            out.append([start, b, k])
        start = b + 1
    return out


def _ratio(stats: dict, plain: dict) -> float:
    return stats["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0


def _row(stats: dict, plain: dict) -> dict:
    """One curve point: speedup over the plain runs it took turns with, ours and vLLM's acceptance figures."""
    acc = vllm_acceptance(stats)
    return {"speedup": _ratio(stats, plain), "tokens_per_s": stats["tokens_per_s"],
            "plain_tokens_per_s": plain["tokens_per_s"], "alpha": stats["alpha"], "tau": stats["tau"],
            "accept_per_pos": stats["accept_per_pos"], "mean_acceptance_length": acc["mean_acceptance_length"],
            "draft_acceptance_rate": acc["draft_acceptance_rate"], "acceptance_at_pos": acc["acceptance_per_pos"],
            "n_tokens": stats["n_tokens"], "plain_n_tokens": plain["n_tokens"]}


def prompt_rows(recipe, run_dir: Path, prompts_file: str | Path | None) -> tuple[list[dict], Path]:
    """The first report.n_prompts rows of `prompts_file` (JSONL: a "prompt" string or a "messages" list per
    line, maybe a "category"), or of the run's held-out prompts; and the file they came from."""
    path = Path(prompts_file) if prompts_file else Path(run_dir) / "prompts" / "heldout.jsonl"
    if not path.is_file():
        raise SweepError(f"{path} does not exist; " + ("give --prompts a JSONL file" if prompts_file else
                                                       "run the generate stage first (it writes the prompt sets)"))
    try:
        rows = read_prompt_rows(path)
    except PromptFileError as e:
        raise SweepError(str(e)) from None
    if not rows:
        raise SweepError(f"{path} holds no prompts; give a JSONL file with at least one")
    return rows[:recipe.report.n_prompts], path


def prompt_text(row: dict) -> str:
    """A prompt row's text as a reader sees it: the prompt, or the last user message."""
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    users = [m.get("content", "") for m in row.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else ""
