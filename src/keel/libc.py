"""glibc's allocator controls (`malloc_trim`, `mallopt`), where the C library is glibc.

Decided by what the platform is (Linux, and a C library that exports glibc's version call), not by
trying a call: musl exports `mallopt` with none of glibc's parameters and no `malloc_trim`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None on any other C library or system."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def trim_heap() -> bool:
    """Return the heap's free pages to the system (`malloc_trim(0)`); False where there is no glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
