"""Host memory given back when large tensors are freed (glibc's malloc, Linux).

glibc serves an allocation from its heap, not from its own mmap, once it is below the mmap threshold,
and that threshold rises to the size of every mmapped block freed (up to 32 MiB). A training step
frees and reallocates many tensors of 1-32 MiB (FSDP's gathered blocks and their gradients,
activations); after the first step they come from the heap, whose freed pages stay in the process
unless they sit at its top, so the resident set keeps the high-water mark of every layout the heap
has had. Measured in docs/BENCHMARKS.md ("Host memory of FSDP start-up"): a fixed threshold of 1 MiB cut
the peak resident set of a 5-step FSDP run by a quarter at the same speed. `run.mmap_threshold_kib`
sets it (0 leaves glibc's own policy); an `MALLOC_MMAP_THRESHOLD_` in the environment wins.
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
