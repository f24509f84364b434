"""DatastoreProposer: the class vLLM's `custom_class` speculative method loads (vLLM 0.32,
vllm/v1/spec_decode/custom_class_proposer.py and gpu_model_runner.propose_draft_token_ids):

    --speculative-config '{"method": "custom_class", "model": "draftsmith_vllm.proposer.DatastoreProposer",
                           "num_speculative_tokens": K}'

vLLM imports the module by that dotted path (so the export directory, which holds this package, must be on
PYTHONPATH), calls `DatastoreProposer(vllm_config)` once, `load_model(target)` when the model runner loads
(vLLM-CPU's CPUModelRunner always calls it: it must exist), and each step

    propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]

with, per request row i of the batch: sampled_token_ids[i] the tokens sampled this step (empty: the request
is not decoding, propose nothing), num_tokens_no_spec[i] its prompt + output length, token_ids_cpu[i, :that]
its tokens. It returns up to K draft tokens per row (the lookup's, lookup.py), fewer or none where the lookup
has less; vLLM verifies them greedily or by rejection sampling as for its n-gram method.

vLLM 0.32's `num_speculative_tokens_per_batch_size` (inclusive [start, end, K] batch-size ranges) sets the K of
each step for its own proposers (the scheduler's `num_spec_tokens_to_schedule`), but `custom_class` is not
handed it, so this class applies the same table itself: K for the number of rows decoding this step, a gap
or the batches past the last range taking the previous range's K, never above num_speculative_tokens (as
vllm/v1/spec_decode/dynamic/utils.py expands it). K = 0 there proposes nothing: plain decoding at that batch.

The datastore and the lookup settings are read from the export directory: $DRAFTSMITH_VLLM_EXPORT when set,
else the directory holding this package (where `draftsmith export` puts it). Imports numpy and lookup.py only;
vLLM hands in its config object, read by attribute.
"""

from __future__ import annotations

import os
from pathlib import Path

from .lookup import load_export

EXPORT_ENV = "DRAFTSMITH_VLLM_EXPORT"


def export_dir() -> Path:
    env = os.environ.get(EXPORT_ENV)
    return Path(env) if env else Path(__file__).resolve().parent.parent


def k_table_ranges(table) -> list[tuple[int, int, int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` checked by the rules vLLM 0.32 applies at startup
    (vllm/v1/spec_decode/dynamic/utils.py): a non-empty list of [start, end, K], positive ordered bounds,
    K >= 0, ranges not overlapping, the first from batch 1. ValueError naming the fault otherwise."""
    shape = f"num_speculative_tokens_per_batch_size {table!r}: give a list of [start, end, K] ranges from batch 1"
    if not isinstance(table, (list, tuple)) or not table:
        raise ValueError(shape)
    if any(not isinstance(e, (list, tuple)) or len(e) != 3 or not all(isinstance(x, int) for x in e) for e in table):
        raise ValueError(f"{shape}, each three integers")
    ranges = sorted((a, b, c) for a, b, c in table)
    if any(a < 1 or b < a or c < 0 for a, b, c in ranges):
        raise ValueError(f"{shape}, 1 <= start <= end and K >= 0")
    if any(a <= prev_end for (a, _, _), (_, prev_end, _) in zip(ranges[1:], ranges)):
        raise ValueError(f"{shape}, not overlapping")
    if ranges[0][0] != 1:
        raise ValueError(f"{shape}: the first range must start at batch 1")
    return ranges


def k_by_batch(table, k: int):
    """vLLM's `num_speculative_tokens_per_batch_size` -> batch size -> K (the table's semantics, see above);
    None: K at every batch size."""
    if not table:
        return lambda batch: k
    ranges = k_table_ranges(table)

    def at(batch: int) -> int:
        kb = ranges[0][2]
        for a, _, c in ranges:
            if a > batch:
                break
            kb = c
        return min(k, kb)
    return at


class DatastoreProposer:
    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.k_at = k_by_batch(getattr(spec, "num_speculative_tokens_per_batch_size", None), self.k)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.directory = export_dir()
        self.lookup = load_export(self.directory)  # at construction, so a bad export fails at startup

    def load_model(self, *args, **kwargs):
        """No model: vLLM-CPU's model runner calls it on every drafter."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        out = []
        k_step = self.k_at(sum(1 for s in sampled_token_ids if len(s)))
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            k = min(k_step, self.max_model_len - n - 1)
            if not len(sampled) or k < 1:
                out.append([])
                continue
            out.append(self.lookup.propose(token_ids_cpu[i, :n], k))
        return out
