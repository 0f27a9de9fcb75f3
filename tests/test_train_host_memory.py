"""keel.train.host_memory: glibc's free heap pages handed back (run.trim_heap), at the points of a step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from keel.train.host_memory import HeapTrimmer, trim_heap_wanted
from test_train_run import config, make_train_root, run

needs_glibc = pytest.mark.skipif(not HeapTrimmer().available, reason="malloc_trim is glibc's (Linux)")


@needs_glibc
def test_trim_returns_the_pages_of_freed_tensors():
    # In a process of its own, with glibc's mmap threshold fixed above the tensors: they come from the
    # heap, as FSDP's buffers do after the first step, and a live tensor after them keeps their pages
    # from being the heap's top (which free would give back by itself).
    script = textwrap.dedent(
        """
        import torch
        from keel.train.host_memory import HeapTrimmer, trim_heap_wanted
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
        tensors = [torch.ones(256 * 1024) for _ in range(96)]  # 96 x 1 MiB, touched
        pin = torch.ones(1024)
        del tensors
        before = rss()
        trimmer = HeapTrimmer()
        trimmer.trim()
        print(before, rss(), trimmer.calls)
        """
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    before, after, calls = map(int, out.stdout.split())
    assert calls == 1
    assert before - after >= 64, (before, after)


@needs_glibc
def test_attached_blocks_trim_as_each_backward_begins_and_not_without_a_graph():
    blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    trimmer = HeapTrimmer()
    handles = trimmer.attach(blocks)
    x = torch.randn(4, 8)
    with torch.no_grad():
        blocks(x)
    assert trimmer.calls == 0
    blocks(x).sum().backward()
    assert trimmer.calls == 3
    for handle in handles:
        handle.remove()
    blocks(x).sum().backward()
    assert trimmer.calls == 3


@needs_glibc
def test_a_run_that_trims_the_heap_has_the_same_losses(tmp_path: Path):
    root = make_train_root(tmp_path)
    path = config(root, "trim")
    default, plain = run(path, "training.steps=3", "checkpoint.interval=0")
    trainer, trimmed = run(path, "training.steps=3", "checkpoint.interval=0", "run.trim_heap=true", "run.name=trim2")
    assert trimmed.losses == plain.losses
    assert default.heap is None  # one process: off by default
    # each step: a trim as each of the 2 blocks' backward begins (2 micro-batches), after the
    # backward of each micro-batch, and after the update
    assert trainer.heap.calls == 3 * (2 * 2 + 2 + 1)


def test_the_heap_is_trimmed_by_default_on_cpu_runs_of_several_ranks_only():
    assert trim_heap_wanted(None, 2, "cpu", True) and trim_heap_wanted(None, 8, "cpu", True)
    assert not trim_heap_wanted(None, 1, "cpu", True)  # one process: the refaults cost step time
    assert not trim_heap_wanted(None, 2, "cuda", True) and not trim_heap_wanted(None, 2, "cpu", False)
    assert trim_heap_wanted(True, 1, "cpu", True) and not trim_heap_wanted(False, 4, "cpu", True)
