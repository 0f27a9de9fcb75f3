"""Host memory given back when large tensors are freed (glibc's malloc, Linux).

glibc serves an allocation from its heap, not from its own mmap, once it is below the mmap threshold,
and that threshold rises to the size of every mmapped block freed (up to 32 MiB). A training step
frees and reallocates many tensors of 1-32 MiB (FSDP's gathered blocks and their gradients,
activations); after the first step they come from the heap, whose freed pages stay in the process
unless they sit at its top, so the resident set keeps the high-water mark of every layout the heap
has had. A fixed threshold returns those pages at once, at a price: every such allocation is a
fresh mapping the kernel must fault in and zero. Measured (docs/BENCHMARKS.md, "Host memory of FSDP
start-up"): 1 MiB cut the first-step peak of a 4-rank FSDP run by a third, and made a one-process bf16
step 35-40% slower. So it is a choice for hosts short of memory: `run.mmap_threshold_kib` (default 0:
glibc's own policy); an `MALLOC_MMAP_THRESHOLD_` in the environment wins.

The other way, `run.trim_heap`: leave glibc's policy alone and hand the heap's free pages back with
`malloc_trim` where a step has just freed much: as each decoder block's backward begins (the later
block's gathered weights, gradients and activations are gone) and after backward and the optimizer
step. The pages are faulted in again when reused, once per trim rather than once per allocation.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from keel.libc import glibc, trim_heap

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def set_mmap_threshold(kib: int) -> bool:
    """Serve allocations of `kib` KiB and more from their own mappings, returned to the system on free;
    True when set (Linux with glibc, no threshold in the environment, kib > 0)."""
    libc = glibc()
    if kib <= 0 or libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, kib * 1024))


def trim_heap_wanted(setting: bool | None, world: int, device_type: str, available: bool) -> bool:
    """`run.trim_heap` resolved: as set, or by default (None) on for CPU runs of more than one rank where
    glibc has malloc_trim (FSDP's gathered blocks grow their heaps; trimming measured no step cost
    there) and off for one process (its freed pages faulted in again cost 13-25% of a bf16 step)."""
    if setting is not None:
        return setting
    return world > 1 and device_type == "cpu" and available


class HeapTrimmer:
    """Returns the heap's free pages to the system at chosen points of a training step."""

    def __init__(self) -> None:
        self.calls = 0

    @property
    def available(self) -> bool:
        return glibc() is not None

    def trim(self) -> None:
        if trim_heap():
            self.calls += 1

    def attach(self, blocks: Iterable[nn.Module]) -> list[Any]:
        """Trim as each block's backward begins: a hook on the gradient of its output, set by a forward
        hook whenever the output is part of a graph. Returns the hook handles."""

        def on_grad(grad: torch.Tensor) -> None:
            self.trim()

        def on_forward(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(on_grad)

        return [block.register_forward_hook(on_forward) for block in blocks]
