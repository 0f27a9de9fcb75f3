"""The CPU's measured matmul peak (MFU's denominator on CPU), kept per machine.

Measuring takes a second of every rank's compute as each run starts (keel.train.metrics.measure_cpu_peak); the
result is kept in `$KEEL_CACHE/cpu_peak_flops.json` under a key naming the CPU model, the vector ISA torch runs at
(`Platform.generated_code_key`), the dtype, the thread count and torch's version, and later runs on the same machine
read it. Deleting the file measures again (a first measurement taken while the machine was busy is kept until then).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from keel.atomic import write_json_atomic
from keel.paths import cache_root
from keel.platform import cpu_model, host


def peak_cache_path() -> Path:
    return cache_root() / "cpu_peak_flops.json"


def cached_cpu_peak(dtype: torch.dtype, threads: int, measure: Callable[[], float]) -> tuple[float, bool]:
    """(peak FLOP/s, whether it was read from the cache): this machine's kept figure, else `measure()`'s, kept."""
    path = peak_cache_path()
    key = " | ".join(
        (cpu_model(), host().generated_code_key, str(dtype), f"{threads} threads", f"torch {torch.__version__}")
    )
    known = _read(path).get(key)
    if isinstance(known, float) and known > 0:
        return known, True
    peak = measure()
    entries = _read(path)  # again: another rank may have written its figure meanwhile
    entries[key] = peak
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, entries)
    return peak, False


def _read(path: Path) -> dict:
    """The kept figures; none where the file is missing or unreadable (it is then measured and written again)."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}
