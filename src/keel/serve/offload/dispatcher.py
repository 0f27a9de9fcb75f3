"""The MoE dispatcher with offloaded experts: the plug point `MoE.dispatcher` (as expert parallelism's).

Per forward of one MoE layer:
1. start the prefetch of the next MoE layer's predicted experts (a background thread);
2. wait for this layer's own prefetch, if one is running (stall);
3. find the distinct experts the token-slots need; `SlotCache.plan` says which are resident (hits)
   and splits them into passes of at most `slots` experts, loading the missing ones (stall);
4. per pass: map expert ids to slot ids, sort the pass's token-slots by slot and run the layer's
   `GroupedExperts` over the slot buffers, writing the outputs back in slot order.
Within an expert's segment the token-slots keep their order, so every output row is computed
exactly as `LocalDispatcher` computes it with all experts resident.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from keel.model.moe import GroupedExperts, Router, group_by_expert
from keel.serve.offload.prefetch import Prefetcher
from keel.serve.offload.resident import ResidentExperts
from keel.serve.offload.stats import OffloadStats


class OffloadDispatcher:
    # Its experts' float weights move in and out of slot buffers: keel.quant refuses to replace them.
    swaps_expert_weights = True

    def __init__(
        self,
        resident: ResidentExperts,
        stats: OffloadStats,
        prefetcher: Prefetcher | None = None,
        next_layer: tuple[Router, ResidentExperts] | None = None,
    ) -> None:
        self.resident = resident
        self.stats = stats
        self.prefetcher = prefetcher
        self.next_layer = next_layer

    def __call__(self, experts: GroupedExperts, x: Tensor, expert_ids: Tensor, slot_tokens: Tensor) -> Tensor:
        """x [T, H]; expert_ids, slot_tokens [S] -> expert outputs [S, H] in slot order."""
        resident, prefetcher = self.resident, self.prefetcher
        if prefetcher is not None and self.next_layer is not None:
            prefetcher.predict(*self.next_layer, x)
        start = time.perf_counter()
        if prefetcher is not None:
            prefetcher.wait(resident.layer)
        resident.before_compute()  # (CUDA) nothing below may touch the slots before the prefetch copies land
        waited = time.perf_counter() - start
        if prefetcher is not None:
            prefetcher.score(resident.layer, expert_ids)
        needed = torch.unique(expert_ids).tolist()
        cache = resident.cache
        hits = sum(cache.resident(e) for e in needed)
        passes = cache.plan(needed)
        loading = 0.0
        out: Tensor | None = None
        for index, step in enumerate(passes):
            if step.loads:
                start = time.perf_counter()
                try:
                    resident.load(step.loads)
                except BaseException:  # the plan counted on every later load too: forget them
                    for later in passes[index + 1 :]:
                        for expert, _ in later.loads:
                            cache.evict(expert)
                    raise
                loading += time.perf_counter() - start
            if len(passes) == 1:
                rows = torch.arange(expert_ids.numel(), device=x.device)
            else:
                rows = torch.isin(expert_ids, torch.tensor(step.experts, device=x.device)).nonzero().squeeze(1)
            slot_of = torch.full((cache.num_experts,), -1, dtype=torch.long)
            slot_of[step.experts] = torch.tensor(step.slots)
            slot_ids = slot_of.to(x.device)[expert_ids.index_select(0, rows)]
            order, offsets = group_by_expert(slot_ids, cache.num_slots)
            rows = rows.index_select(0, order)
            computed = experts(x.index_select(0, slot_tokens.index_select(0, rows)), offsets)
            if out is None:
                out = computed.new_empty((expert_ids.numel(), computed.shape[-1]))
            out.index_copy_(0, rows, computed)
        resident.after_compute()
        self.stats.add(
            uses=len(needed), hits=hits, stall_seconds=waited + loading, extra_passes=max(0, len(passes) - 1)
        )
        if out is None:  # no token-slots at all
            return x.new_empty((0, x.shape[-1]))
        return out
