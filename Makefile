# Set-up lives here so the README's two commands work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
THREADS ?= 2

.PHONY: quickstart test bench

$(BIN)/eaglewire: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # the CPU build on disk; never a CUDA download
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The main job on the embedded default target (grows into the full quickstart).
quickstart: $(BIN)/eaglewire
	$(BIN)/eaglewire --threads $(THREADS) prepare --target smollm2-135m --data sharegpt \
		--num-conversations 64 --max-length 1024 --out runs/quickstart/data

test: $(BIN)/eaglewire
	OMP_NUM_THREADS=$(THREADS) $(BIN)/pytest -q

bench: $(BIN)/eaglewire
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python benchmarks/capture_throughput.py
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python benchmarks/prepare_cost.py
