"""Expert offloading for serving: a few experts of each MoE layer resident, the rest in host memory
or on disk, loaded when routing asks for them, with the next layer's experts prefetched.

`enable_expert_offload(loaded, budget)` rewires a loaded model in place (serving only: its expert
parameters become slot buffers, so it can no longer be saved or trained):
- cold storage (`store`): host memory (pinned when the model is on a GPU) or the safetensors file;
- per MoE layer, `ResidentExperts` (slot buffers + `SlotCache`, LRU or LFU) and an
  `OffloadDispatcher` in `MoE.dispatcher`, the plug point expert parallelism uses;
- one `Prefetcher` thread shared by the layers; `OffloadStats` for the engine's metrics.
"""

from __future__ import annotations

import logging

import torch

from keel.errors import KeelError
from keel.model.moe import LocalDispatcher, MoE
from keel.model.transformer import Transformer
from keel.serve.offload.budget import ExpertBudget, parse_expert_cache, slots_per_layer
from keel.serve.offload.dispatcher import OffloadDispatcher
from keel.serve.offload.prefetch import Prefetcher
from keel.serve.offload.resident import ResidentExperts
from keel.serve.offload.slots import POLICIES, SlotCache
from keel.serve.offload.stats import OffloadStats
from keel.serve.offload.store import DiskExpertStore, ExpertStore, HostExpertStore
from keel.weights.checkpoint import LoadedModel

log = logging.getLogger("keel.serve")

STORAGES = ("host", "disk")

__all__ = ["POLICIES", "STORAGES", "ExpertOffload", "OffloadStats", "enable_expert_offload", "parse_expert_cache"]


class ExpertOffload:
    """What `enable_expert_offload` set up: per-layer residents, the prefetcher, the counters."""

    def __init__(
        self, layers: dict[int, ResidentExperts], store: ExpertStore, prefetcher: Prefetcher | None, stats: OffloadStats
    ) -> None:
        self.layers = layers
        self.store = store
        self.prefetcher = prefetcher
        self.stats = stats

    @property
    def slots_per_layer(self) -> int:
        return next(iter(self.layers.values())).cache.num_slots

    @property
    def resident_bytes(self) -> int:
        return sum(r.resident_bytes for r in self.layers.values())

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()


def enable_expert_offload(
    loaded: LoadedModel,
    budget: str | int | ExpertBudget,
    *,
    policy: str = "lru",
    storage: str = "host",
    prefetch: bool = True,
    device: torch.device | str | None = None,
) -> ExpertOffload:
    """Offload the experts of `loaded.model` (in place). `device`: where the resident slots live
    (default: the model's device)."""
    model: Transformer = loaded.model
    budget = budget if isinstance(budget, ExpertBudget) else parse_expert_cache(budget)
    if policy not in POLICIES:
        raise KeelError(f"--expert-cache-policy {policy!r}: choose from {', '.join(POLICIES)}")
    if storage not in STORAGES:
        raise KeelError(f"--expert-storage {storage!r}: choose from {', '.join(STORAGES)}")
    moes = [(int(i), layer.mlp) for i, layer in model.layers.items() if isinstance(layer.mlp, MoE)]
    if not moes:
        raise KeelError(f"--expert-cache: a {model.config.architecture} model has no mixture-of-experts layers")
    if model.config.expert_bias:
        raise KeelError(
            f"--expert-cache: a {model.config.architecture} model's experts have biases, which expert offloading "
            "does not move into its slots; serve it without --expert-cache"
        )
    if any(not isinstance(moe.dispatcher, LocalDispatcher) for _, moe in moes):
        raise KeelError("expert offloading is already on for this model (or it is expert-parallel): load it again")
    device = torch.device(device) if device is not None else model.device
    first = moes[0][1].experts
    expert_bytes = (first.gate_up_proj[0].numel() + first.down_proj[0].numel()) * first.gate_up_proj.element_size()
    slots = slots_per_layer(budget, first.num_experts, len(moes), expert_bytes)

    store: ExpertStore
    if storage == "disk":
        store = DiskExpertStore(loaded.checkpoint.reader, model.config, [i for i, _ in moes])
    else:
        store = HostExpertStore(pin=device.type == "cuda")
        for i, moe in moes:
            store.add_layer(i, moe.experts.gate_up_proj, moe.experts.down_proj)
    stats = OffloadStats()
    layers = {
        i: ResidentExperts(i, moe.experts, store, SlotCache(moe.num_experts, slots, policy), stats, device)
        for i, moe in moes
    }
    prefetcher = Prefetcher(stats, device) if prefetch and len(moes) > 1 else None
    for (i, moe), after in zip(moes, [*moes[1:], None], strict=True):
        next_layer = (after[1].router, layers[after[0]]) if after is not None else None
        moe.dispatcher = OffloadDispatcher(layers[i], stats, prefetcher, next_layer)
    offload = ExpertOffload(layers, store, prefetcher, stats)
    num_experts = first.num_experts
    log.info(
        "expert offloading: %d of %d experts resident per MoE layer (%d layers, %.1f MiB resident), the rest in %s; "
        "%s, prefetch %s",
        slots,
        num_experts,
        len(moes),
        offload.resident_bytes / 2**20,
        store.where,
        policy,
        "on" if prefetcher is not None else "off",
    )
    return offload
