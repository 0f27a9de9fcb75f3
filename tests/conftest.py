import contextlib
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
if not torch.cuda.is_available():
    # keel's Triton kernel runs interpreted on CPU tensors (tests/test_attention_backends.py,
    # test_attention_softcap.py). Triton reads this when triton.language is first imported (its own @jit
    # helpers become interpreted functions then), which any module compiling with inductor may do first:
    # set before any test module is imported, or the kernel calls compiled helpers it cannot run.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def force_isa(monkeypatch):
    """force_isa("avx2"): keel.platform answers as under KEEL_CPU_ISA for the rest of the test, and keel's
    kernels run at that platform's level (torch's own kernels are not re-dispatched: they read their caps
    once). Skips where the CPU is below the level."""
    from keel import kernels, platform
    from keel.errors import KeelError

    levels = contextlib.ExitStack()

    def force(level: str) -> platform.Platform:
        monkeypatch.setenv(platform.ISA_ENV, level)
        platform.host.cache_clear()
        try:
            forced = platform.host()
        except KeelError as e:
            pytest.skip(str(e))
        if kernels.enabled():
            levels.enter_context(kernels.using_level(kernels.kernel_level(forced)))
        return forced

    yield force
    levels.close()
    monkeypatch.undo()
    platform.host.cache_clear()


# `make test` runs two xdist workers a file at a time each: the longest files go first, so that the run does not
# end with one worker alone on a long file while the other has nothing left (measured durations: the per-file
# sums of `make test`'s test times on the 2-core CI machine, longest first). Within a file, and for every other
# file, collection order is kept.
LONGEST_FIRST = (
    "test_train_run.py",
    "test_serve_structured.py",
    "test_serve_parallel_engine.py",
    "test_serve_http.py",
    "test_serve_endpoints.py",
    "test_serve_fields.py",
    "test_smollm2.py",
    "test_train_parallel.py",
    "test_cli_errors.py",
    "test_train_loss_parallel.py",
    "test_train_pipeline_sync.py",
    "test_attention_backends.py",
    "test_train_sources.py",
    "test_serve_constraints.py",
    "test_plan_run.py",
    "test_families_serve.py",
    "test_compiled_decode.py",
    "test_gguf.py",
    "test_serve_engine.py",
    "test_train_materialize.py",
    "test_device_option.py",
    "test_profile.py",
    "test_serve_parallel_shard.py",
    "test_serve_sampling.py",
    "test_architectures.py",
    "test_speculative.py",
    "test_corpora.py",
    "test_plan.py",
    "test_serve_metrics_vllm.py",
    "test_bench_serve.py",
    "test_platform.py",
    "test_eval_suites.py",
    "test_moe_ep_serving.py",
    "test_train_host_memory.py",
    "test_serve_tenants.py",
    "test_package_graph.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist hands out `--dist loadfile` files in the items' order only without its default
    # --loadscope-reorder (files with the most tests first, whatever they take): the order above, instead.
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
