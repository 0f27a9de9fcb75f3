"""The serving process's start-up heap kept out of Python's cyclic collector.

A server builds its engine once and then steps it for its whole life. The objects made at start-up
(modules, the Python side of every tensor, tokenizer tables, imported libraries) are never garbage, yet
each old-generation collection between steps walked all of them: ~2% of a serving run's CPU time in the
collector (docs/BENCHMARKS.md). `gc.freeze()` moves them to the permanent generation, as vLLM's engine
core does after its start-up. Only for a process that keeps its engine: cycles among frozen objects are
never collected, so an application that builds and drops engines should not call this.
"""

from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit = False


def freeze_startup_heap() -> int:
    """Collect, then freeze every live object; the number frozen. At exit they are unfrozen, so the
    interpreter's last collection still finalises them (native bindings report leaks otherwise)."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    return gc.get_freeze_count()
