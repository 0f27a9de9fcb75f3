"""torch.profiler traces of chosen training steps (the `[profile]` section), per rank.

Each step in `profile.steps` runs under `torch.profiler.profile` (CPU activity, and CUDA's on a GPU)
inside a `keel train step N` range, and its Chrome trace is written to
RUN/profile/trace-step-N-rank-R.json (open in Perfetto or chrome://tracing). On CUDA the caching
allocator's history is recorded over the traced steps and dumped after the last one as
RUN/profile/memory-rank-R.pickle (pytorch.org/memory_viz). Files are written atomically.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from keel.atomic import write_through
from keel.train.config import ProfileSection


class StepProfiler:
    def __init__(self, cfg: ProfileSection, run_dir: Path, rank: int, device: torch.device) -> None:
        self.steps = set(cfg.steps)
        self.last = max(cfg.steps, default=0)
        self.dir = run_dir / cfg.dir
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.memory = self.cuda and cfg.memory_snapshot
        self._recording = False
        if self.steps:
            self.dir.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """The body of training step `step`, traced if the configuration names it."""
        if step not in self.steps:
            yield
            return
        if self.memory and not self._recording:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._recording = True
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:
            with record_function(f"keel train step {step}"):
                yield
        write_through(self.dir / f"trace-step-{step:08d}-rank-{self.rank}.json", prof.export_chrome_trace)
        if self._recording and step == self.last:
            write_through(self.dir / f"memory-rank-{self.rank}.pickle", torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
