"""One MoE layer's resident experts: fixed slot buffers on the model's device, filled from cold storage.

The layer's stacked expert parameters ([E, 2I, H] / [E, H, I]) are replaced by slot buffers
([S, 2I, H] / [S, H, I], S = resident slots): the model no longer holds the full expert weights,
and the layer's own `GroupedExperts.forward` computes over slots (the same grouped matmul, so a
token's expert output is bit for bit what it is with every expert resident). `SlotCache` says
which expert each slot holds; `load` copies experts in.

On CUDA, loads for a miss are issued on the compute stream (ordered with the compute by the
stream itself). Prefetch loads run on a side stream: first they wait for the event recorded after
this layer's last compute (its slots are no longer being read), and this layer's next compute
waits for the event recorded after them. On CPU all of this is plain copies.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from keel.model.moe import GroupedExperts
from keel.serve.offload.slots import SlotCache
from keel.serve.offload.stats import OffloadStats
from keel.serve.offload.store import ExpertStore


class ResidentExperts:
    def __init__(
        self,
        layer: int,
        experts: GroupedExperts,
        store: ExpertStore,
        cache: SlotCache,
        stats: OffloadStats,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.experts = experts
        self.store = store
        self.cache = cache
        self.stats = stats
        gate_up, down = experts.gate_up_proj, experts.down_proj
        self.expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
        slots = cache.num_slots
        # Assigning new Parameters drops the stacked ones: the store already holds what it needs.
        experts.gate_up_proj = nn.Parameter(
            torch.empty((slots, *gate_up.shape[1:]), dtype=gate_up.dtype, device=device), requires_grad=False
        )
        experts.down_proj = nn.Parameter(
            torch.empty((slots, *down.shape[1:]), dtype=down.dtype, device=device), requires_grad=False
        )
        del gate_up, down
        self._cuda = device.type == "cuda"
        self._ready: torch.cuda.Event | None = None  # after the last prefetch's copies
        self._released: torch.cuda.Event | None = None  # after the last compute over the slots
        with torch.no_grad():
            for expert in range(slots):  # start warm: experts 0..S-1 (not counted as loads)
                self.store.copy_into(layer, expert, experts.gate_up_proj[expert], experts.down_proj[expert])
                cache.assign(expert, expert)

    @property
    def resident_bytes(self) -> int:
        return self.cache.num_slots * self.expert_bytes

    @torch.no_grad()
    def load(self, loads: list[tuple[int, int]], side_stream: torch.cuda.Stream | None = None) -> None:
        """Copy each (expert, slot) in; `cache` already records them. On failure the experts not
        copied are forgotten, so no slot is trusted to hold what it does not."""
        copied = 0
        stream = torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext()
        try:
            with stream:
                if side_stream is not None and self._released is not None:
                    side_stream.wait_event(self._released)
                gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
                for expert, slot in loads:
                    self.store.copy_into(self.layer, expert, gate_up[slot], down[slot])
                    copied += 1
                if side_stream is not None:
                    self._ready = torch.cuda.Event()
                    self._ready.record(side_stream)
        except BaseException:
            for expert, _ in loads[copied:]:
                self.cache.evict(expert)
            raise
        finally:
            self.stats.add(loads=copied, bytes_loaded=copied * self.expert_bytes)

    def before_compute(self) -> None:
        if self._cuda and self._ready is not None:
            torch.cuda.current_stream().wait_event(self._ready)
            self._ready = None

    def after_compute(self) -> None:
        if self._cuda:
            self._released = torch.cuda.Event()
            self._released.record()
