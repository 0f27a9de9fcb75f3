"""The KV-cache memory budget in whole blocks: a size such as "2GiB", or on CUDA vLLM's
`--gpu-memory-utilization`: the share of the device's whole memory this engine may hold (weights,
activations and the KV cache together).

With a utilization, the engine first runs a dummy forward of a full step (`max_num_batched_tokens` tokens,
the sampler over `max_num_seqs` rows) and measures the activation peak it allocates; then
  KV bytes = total x utilization - (memory in use once the dummy step's cache is released) - activation peak,
where the memory in use counts the weights, the CUDA context and anything else already on the device
(another process's share included, as vLLM counts it at start-up). Parallel workers do the same per rank: each
runs its own share of the dummy step (its stage's layers over its tensor-parallel slices, the sampler on rank 0)
in step with its peers. Without a size on CPU the budget is `CPU_DEFAULT`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from keel.errors import KeelError

CPU_DEFAULT = "2GiB"


@dataclass(frozen=True)
class DummyStep:
    """The shape of the step that measures the activation peak: the step budget's tokens packed into `sequences`
    rows of `length` tokens (a step packs sequences of at most max_model_len), the logits of the last `rows`
    tokens (one a running sequence, at most max_num_seqs) sampled."""

    sequences: int
    length: int
    rows: int

    @classmethod
    def of(cls, tokens: int, max_model_len: int, max_num_seqs: int) -> DummyStep:
        length = max(1, min(tokens, max_model_len))
        return cls(-(-tokens // length), length, max(1, min(max_num_seqs, tokens)))

    def select(self, device: torch.device | str) -> torch.Tensor:
        """The flattened indices of the sampled rows."""
        flat = self.sequences * self.length
        return torch.arange(flat - self.rows, flat, device=device)


def measured_peak(run: Callable[[], object], device: torch.device) -> int:
    """CUDA bytes `run()` allocates at its peak beyond what is held before it; its tensors are released after
    (and the caching allocator's blocks returned) so the KV pool can use that memory."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def blocks_in_budget(
    bytes_per_block: int,
    kv_cache_memory: str | int | None,
    device: str | torch.device = "cpu",
    gpu_memory_utilization: float = 0.9,
    activation_peak: Callable[[], int] | None = None,
) -> int:
    """KV blocks a budget holds: `kv_cache_memory` bytes ("2GiB" or an int); with None, on CUDA what
    `gpu_memory_utilization` leaves after the weights and `activation_peak()` (bytes; 0 when not given),
    elsewhere CPU_DEFAULT."""
    if kv_cache_memory is None:
        if str(device).startswith("cuda"):
            peak = activation_peak() if activation_peak is not None else 0
            budget = utilization_budget(gpu_memory_utilization, *torch.cuda.mem_get_info(device), peak)
        else:
            budget = parse_memory(CPU_DEFAULT)
    elif isinstance(kv_cache_memory, int):
        budget = kv_cache_memory
    else:
        budget = parse_memory(kv_cache_memory)
    return budget // bytes_per_block


def utilization_budget(utilization: float, free: int, total: int, activation_peak: int) -> int:
    """KV bytes under vLLM's rule (the module docstring), from the device's free and total bytes."""
    if not 0 < utilization <= 1:
        raise KeelError(f"--gpu-memory-utilization {utilization}: expected a share in (0, 1]")
    in_use = total - free
    budget = int(total * utilization) - in_use - activation_peak
    if budget <= 0:
        gib = 2**30
        raise KeelError(
            f"--gpu-memory-utilization {utilization}: {total * utilization / gib:.1f} GiB of the device's "
            f"{total / gib:.1f} GiB leave no KV cache after {in_use / gib:.1f} GiB in use (weights, CUDA context, "
            f"other processes) and a {activation_peak / gib:.2f} GiB activation peak: raise it, lower "
            "--max-num-batched-tokens, or give --kv-cache-memory"
        )
    return budget


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
