"""Expert-offloading counters, shared by the forward (main thread) and the prefetch thread.

An expert *use* is one distinct expert needed by one forward of one MoE layer (however many tokens
it serves): the unit a load is paid in. Hit rate = uses whose expert was resident when the forward
planned (prefetched ones count) / uses. Stall = seconds a forward waited: for its layer's prefetch
to finish, and for the loads of its misses. Prefetch accuracy = of the token-slots a layer routed,
the fraction whose expert the predictor had picked for that same token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class OffloadStats:
    uses: int = 0
    hits: int = 0
    loads: int = 0  # experts copied into a slot (misses and prefetches; not the initial fill)
    bytes_loaded: int = 0
    stall_seconds: float = 0.0
    extra_passes: int = 0  # forwards' passes beyond the first (more experts needed than slots)
    prefetch_loads: int = 0  # of `loads`, issued by the prefetcher
    predicted_slots: int = 0  # token-slots the predictor was scored on
    predicted_right: int = 0  # of which it had picked the expert
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> OffloadStats:
        with self._lock:
            return OffloadStats(**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"})

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        return self.predicted_right / self.predicted_slots if self.predicted_slots else 0.0

    def as_engine_stats(self) -> dict[str, float]:
        """The entries `LLMEngine.stats()` adds (and the metrics endpoint exports as keel:<name>)."""
        s = self.snapshot()
        return {
            "expert_cache_queries": s.uses,
            "expert_cache_hits": s.hits,
            "expert_cache_hit_rate": s.hit_rate,
            "expert_loads_total": s.loads,
            "expert_bytes_loaded_total": s.bytes_loaded,
            "expert_load_stall_seconds_total": s.stall_seconds,
            "expert_extra_passes_total": s.extra_passes,
            "expert_prefetch_loads_total": s.prefetch_loads,
            "expert_prefetch_accuracy": s.prefetch_accuracy,
        }
