"""The KV-cache memory budget: a size such as "2GiB", or a share of a GPU's free memory, in whole blocks."""

from __future__ import annotations

import torch

from keel.errors import KeelError


def blocks_in_budget(
    bytes_per_block: int,
    kv_cache_memory: str | int | None,
    device: str | torch.device = "cpu",
    gpu_memory_utilization: float = 0.9,
) -> int:
    """KV blocks a budget holds: `kv_cache_memory` bytes ("2GiB" or an int), or with None on CUDA a share of
    the device's free memory (None on CPU is an error)."""
    if kv_cache_memory is None:
        if not torch.cuda.is_available() or not str(device).startswith("cuda"):
            raise KeelError("--kv-cache-memory is required on CPU (e.g. 2GiB)")
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_utilization)
    elif isinstance(kv_cache_memory, int):
        budget = kv_cache_memory
    else:
        budget = parse_memory(kv_cache_memory)
    return budget // bytes_per_block


def parse_memory(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    value = text.strip().lower()
    for unit, factor in units.items():
        if value.endswith(unit):
            try:
                return int(float(value[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(value)
    except ValueError:
        raise KeelError(f"--kv-cache-memory {text!r}: expected a size such as 2GiB or 512MiB") from None
