"""A step's integer inputs moved to the device in one copy from pinned host memory.

A decode step's inputs (token ids, positions, KV slots, block tables, decode-group indices) are a dozen
small int64 tensors built on the host. Moved one by one from ordinary (pageable) memory, each is a
blocking host-to-device copy, and the host waits for the GPU a dozen times per step. Staged here, they
are laid end to end in one page-locked buffer that lives as long as the engine (grown when a step needs
more) and cross in one non-blocking copy; the device tensors are views of one device buffer. Before the
host buffer is written again, the previous copy's event is waited on (it is done or nearly so by then:
a synchronous step ends by reading its tokens back; under asynchronous scheduling that copy was queued
right behind the step whose tokens the host has already read).

On the CPU the tensors are returned as they are: there is nothing to copy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a tensor on `device` without making the host wait. `torch.tensor(values, device=cuda)`
    blocks until the copy is done (a host sync); a non-blocking copy out of ordinary (pageable) memory may
    still make the driver wait for the stream, so on CUDA the list is laid in page-locked memory first
    (torch's pinned-block cache keeps the block until its copy has run)."""
    pinned = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


def host_int64(values: Sequence) -> Tensor:
    """A list of ints (or a rectangular list of lists) as an int64 host tensor. Through numpy: torch.tensor
    converts Python ints at ~125 ns each (2 ms for the block tables of 256 rows of 64 blocks), numpy at ~17."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


class Staging:
    """`move(tensors)`: int64 host tensors -> the same tensors on `device` (see the module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._host: Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def move(self, tensors: list[Tensor]) -> list[Tensor]:
        if self.device.type == "cpu" or not tensors:
            return tensors
        if any(t.dtype != torch.int64 for t in tensors):
            raise ValueError("Staging moves int64 tensors only")
        if self.device.type != "cuda":
            return [t.to(self.device) for t in tensors]
        sizes = [t.numel() for t in tensors]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()
        if self._host is None or self._host.numel() < total:
            # Not an inference tensor even when the first step to grow it runs under inference_mode (the
            # engine's dummy step does): written in place by every later step, in that mode or not.
            with torch.inference_mode(False):
                self._host = torch.empty(max(total, 2 * (0 if self._host is None else self._host.numel())),
                                         dtype=torch.int64, pin_memory=True)  # fmt: skip
        host = self._host[:total]
        torch.cat([t.reshape(-1) for t in tensors], out=host)
        moved = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        out, offset = [], 0
        for t, n in zip(tensors, sizes, strict=True):
            out.append(moved[offset : offset + n].view(t.shape))
            offset += n
        return out


@functools.cache
def staging_for(device: torch.device) -> Staging:
    """The process's staging buffer for a device: shared by every caller in the engine's thread (each move
    waits for the previous copy out of the host buffer, and returns fresh device tensors)."""
    return Staging(device)


class HostCopy:
    """Device tensors read back to the host without waiting: each copy goes into page-locked memory behind
    the work already queued, and `wait()` waits for those copies only, not for work queued after them (the
    next step, under asynchronous scheduling). On the CPU the tensors are the copies."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type == "cpu":
            self._host = tensors
            return
        self._host = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            host.copy_(t, non_blocking=True)
            self._host.append(host)
        if tensors[0].device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensors[0].device))

    def wait(self) -> list[Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
