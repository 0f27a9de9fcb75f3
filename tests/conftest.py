import os
import sys
from pathlib import Path

import pytest
import torch

# tests import their helpers (tiny_models) by module name.
sys.path.insert(0, str(Path(__file__).parent))
# Deterministic and quiet: 2 threads (the CI machine's cores), no hub access ever. Under pytest-xdist
# (`make test` runs two workers) each worker takes one core.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines decode eagerly unless a test asks for compilation (tests/test_compiled_decode.py does):
# compiling SmolLM2 in every test that serves it would cost minutes of the suite.
os.environ.setdefault("KEEL_COMPILE", "0")


@pytest.fixture
def force_isa(monkeypatch):
    """force_isa("avx2"): keel.platform answers as under KEEL_CPU_ISA for the rest of the test (torch's own
    kernels are not re-dispatched: they read their caps once). Skips where the CPU is below the level."""
    from keel import platform
    from keel.errors import KeelError

    def force(level: str) -> platform.Platform:
        monkeypatch.setenv(platform.ISA_ENV, level)
        platform.host.cache_clear()
        try:
            return platform.host()
        except KeelError as e:
            pytest.skip(str(e))

    yield force
    monkeypatch.undo()
    platform.host.cache_clear()


# `make test` runs two xdist workers a file at a time each: the longest files go first, so that the run does not
# end with one worker alone on a long file while the other has nothing left (measured durations: the
# `--durations` table of `make test`). Within a file, and for every other file, collection order is kept.
LONGEST_FIRST = (
    "test_train_run.py",
    "test_serve_parallel_engine.py",
    "test_train_parallel.py",
    "test_eval_gate.py",
    "test_plan_run.py",
    "test_serve_http.py",
    "test_compiled_decode.py",
    "test_quant_native.py",
    "test_gguf.py",
    "test_lmeval.py",
    "test_speculative.py",
    "test_quant.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
