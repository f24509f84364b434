"""The datastore proposer that runs inside vLLM (`--format vllm-proposer`, pipeline/formats.py).

  lookup.py    the lookup itself: numpy and the standard library only (draftsmith's tests import it without vLLM)
  proposer.py  DatastoreProposer, the class vLLM's `custom_class` speculative method instantiates

`draftsmith export --format vllm-proposer` copies this package into the export directory beside the
datastore, so vLLM's own venv (which has no draftsmith) imports it with the export on PYTHONPATH:
`"model": "draftsmith_vllm.proposer.DatastoreProposer"` in --speculative-config. Nothing here imports
draftsmith's other modules.
"""
