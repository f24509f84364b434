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


class DatastoreProposer:
    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.directory = export_dir()
        self.lookup = load_export(self.directory)  # at construction, so a bad export fails at startup

    def load_model(self, *args, **kwargs):
        """No model: vLLM-CPU's model runner calls it on every drafter."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        out = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            k = min(self.k, self.max_model_len - n - 1)
            if not len(sampled) or k < 1:
                out.append([])
                continue
            out.append(self.lookup.propose(token_ids_cpu[i, :n], k))
        return out
