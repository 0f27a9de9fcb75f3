"""What a decode step must move, and how fast this machine moves it.

`streamed_weight_bytes`: the bytes of weights one decode step reads (every float parameter and
every quantized layer's stored buffers, once per step whatever the batch; the embedding table only
when a float head reads it whole, otherwise a lookup reads one row per sequence).
(The KV-cache bytes one cached token holds, what attention reads per cached token per step, are
keel.model.kv_size's.) `copy_bandwidth`: STREAM-convention copy bandwidth (bytes read +
written per second) on buffers far larger than the caches, the practical roofline on CPUs.
"""

from __future__ import annotations

import time

import torch


def copy_bandwidth(megabytes: int = 512, repeats: int = 10, device: torch.device | str = "cpu") -> float:
    """Copy bandwidth in bytes/s (read + write), best of `repeats`."""
    n = megabytes * 2**20 // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if dst.is_cuda:
            torch.cuda.synchronize(dst.device)
        start = time.perf_counter()
        dst.copy_(src)
        if dst.is_cuda:
            torch.cuda.synchronize(dst.device)
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read per decode step (see the module docstring)."""
    head = model.lm_head
    # A plain or upcasting head reads the table itself; a packed or quantized head holds its own copy.
    table = getattr(model.embed_tokens, "weight", None)
    head_reads_table = table is not None and getattr(head, "weight", None) is table
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (name == "embed_tokens.weight" and not head_reads_table):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    for module in model.modules():
        stored = getattr(module, "weight_bytes", None)  # quantized layers: their integer and scale buffers
        if isinstance(stored, int):
            total += stored
    return total
