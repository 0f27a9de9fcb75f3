"""Tensor memory of one training step by kind, measured with torch's MemTracker.

Why MemTracker and not the allocator's counters: on CPU there is no max_memory_allocated, and the
process's RSS is dominated by torch itself and the allocator's caching. MemTracker (a dispatch mode)
counts the bytes of every live tensor storage and its kind (parameters, gradients, optimizer states,
activations, temporaries), and the peak; it follows FSDP2's storage resizes. It works the same on
GPUs. `[log] memory_breakdown = true` runs one step under it (the step is slower) and records the
result beside the planner's prediction (keel.plan.run).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn, optim

# MemTracker's kinds under the names the planner uses (keel.plan.run.RunMemory).
KINDS = {
    "PARAM": "weights",
    "BUFFER": "buffers",
    "GRAD": "grads",
    "OPT": "optimizer",
    "ACT": "activations",
    "TEMP": "temporary",
    "OTH": "other",
}


class StepMemory:
    """The peak of a tracked step: bytes by kind at the peak, and the total."""

    def __init__(self) -> None:
        # Imported here: MemTracker pulls in dynamo and inductor, which would slow every rank's start-up
        # (docs/BENCHMARKS.md, "Peak memory of keel training runs").
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker = MemTracker()
        self.by_kind: dict[str, int] = {}
        self.peak = 0

    def next_micro_batch(self) -> None:
        """MemTracker keeps per-module statistics of one forward; gradient accumulation runs the
        modules again (the peak so far is kept)."""
        self.tracker.reset_mod_stats()

    def _finish(self) -> None:
        snapshots = self.tracker.get_tracker_snapshot("peak")
        if not snapshots:
            return
        device, snap = max(snapshots.items(), key=lambda kv: kv[1]["Total"])
        self.peak = int(snap["Total"])
        self.by_kind = {KINDS.get(getattr(k, "name", ""), str(k)): int(v) for k, v in snap.items() if k != "Total"}


@contextmanager
def track_step_memory(modules: list[nn.Module], optimizers: list[optim.Optimizer]) -> Iterator[StepMemory]:
    """Measure the tensor memory of what runs inside (the model and optimizer states that exist
    before it are counted from the start)."""
    memory = StepMemory()
    memory.tracker.track_external(*modules, *optimizers)
    with memory.tracker:
        yield memory
    memory._finish()
