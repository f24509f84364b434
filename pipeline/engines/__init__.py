"""Serving engines draftsmith drives from the outside: vLLM runs in its own environment (`make engines`),
through `vllm_worker.py` and files, never imported here (vllm pins an older transformers than ours)."""
