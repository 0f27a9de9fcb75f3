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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def set_mmap_threshold(kib: int) -> bool:
    """Serve allocations of `kib` KiB and more from their own mappings, returned to the system on free;
    True when set (Linux with glibc, no threshold in the environment, kib > 0)."""
    if kib <= 0 or not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):  # musl has no mallopt
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, kib * 1024))
