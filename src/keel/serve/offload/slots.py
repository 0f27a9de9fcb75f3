"""One MoE layer's resident slots as bookkeeping: which expert each slot holds, what a forward must
load, which expert to evict. No tensors here, so the policy is tested on its own.

A forward needs a set of distinct experts. `plan` splits it into passes of at most `num_slots`
experts: the resident ones first (no load), then the missing ones, each loaded into a slot whose
expert this pass does not need. A forward that needs more experts than there are slots is computed
in several passes, each evicting experts of the one before, rather than failing.

Policies (which slot to give up):
- "lru" (default): the expert used longest ago. Decode steps of a batch route much as the step
  before did, and the batch's mix of requests drifts: recency follows the drift at once.
- "lfu": the expert used in the fewest forwards so far (ties: the least recent). Keeps experts that
  are popular over the whole run; counts never age, so it is slow to follow a change of workload.
A free slot is always taken first. A prefetched expert counts as used only when a forward uses it:
a wrong prediction stays the first candidate for eviction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from keel.errors import KeelError

POLICIES = ("lru", "lfu")


@dataclass
class Pass:
    """Experts computed together, each in its slot (a later pass may reuse the slot); `loads`
    (expert, slot) are copied in before the pass computes."""

    experts: list[int]
    slots: list[int]
    loads: list[tuple[int, int]] = field(default_factory=list)


class SlotCache:
    def __init__(self, num_experts: int, num_slots: int, policy: str = "lru") -> None:
        if policy not in POLICIES:
            raise KeelError(f"--expert-cache-policy {policy!r}: choose from {', '.join(POLICIES)}")
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in 1..{num_experts}, got {num_slots}")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.policy = policy
        self.expert_in_slot: list[int | None] = [None] * num_slots
        self.slot_of: dict[int, int] = {}
        self._clock = 0  # forwards seen
        self._last_use = [-1] * num_experts
        self._uses = [0] * num_experts

    def resident(self, expert: int) -> bool:
        return expert in self.slot_of

    def assign(self, expert: int, slot: int) -> None:
        """Record that `slot` now holds `expert` (its previous expert is evicted)."""
        old = self.expert_in_slot[slot]
        if old is not None:
            del self.slot_of[old]
        self.expert_in_slot[slot] = expert
        self.slot_of[expert] = slot

    def evict(self, expert: int) -> None:
        """Forget `expert` (a load that failed: its slot holds nothing usable)."""
        slot = self.slot_of.pop(expert, None)
        if slot is not None:
            self.expert_in_slot[slot] = None

    def plan(self, needed: Sequence[int]) -> list[Pass]:
        """Passes computing every expert in `needed` (distinct ids); updates the map as if each
        pass's loads are done in order, and marks the experts used."""
        self._clock += 1
        queue = [e for e in needed if e in self.slot_of] + [e for e in needed if e not in self.slot_of]
        passes = []
        for start in range(0, len(queue), self.num_slots):
            group = queue[start : start + self.num_slots]
            missing = [e for e in group if e not in self.slot_of]
            loads = list(zip(missing, self._victims(len(missing), keep=set(group)), strict=True))
            for expert, slot in loads:
                self.assign(expert, slot)
            for expert in group:
                self._last_use[expert] = self._clock
                self._uses[expert] += 1
            passes.append(Pass(group, [self.slot_of[e] for e in group], loads))
        return passes

    def plan_prefetch(self, predicted: Sequence[int]) -> list[tuple[int, int]]:
        """Loads (expert, slot) that make the first `num_slots` of `predicted` (best first) resident,
        evicting only experts not predicted. Not a use: recency and counts are left alone."""
        top = list(predicted)[: self.num_slots]
        missing = [e for e in top if e not in self.slot_of]
        loads = list(zip(missing, self._victims(len(missing), keep=set(top)), strict=True))
        for expert, slot in loads:
            self.assign(expert, slot)
        return loads

    def _victims(self, count: int, keep: Iterable[int]) -> list[int]:
        """`count` slots to overwrite: free ones first, then by policy among experts not in `keep`."""
        keep = set(keep)
        free = [s for s, e in enumerate(self.expert_in_slot) if e is None]
        taken = [s for s, e in enumerate(self.expert_in_slot) if e is not None and e not in keep]
        if self.policy == "lru":
            taken.sort(key=lambda s: self._last_use[self.expert_in_slot[s]])
        else:
            taken.sort(key=lambda s: (self._uses[self.expert_in_slot[s]], self._last_use[self.expert_in_slot[s]]))
        victims = (free + taken)[:count]
        if len(victims) < count:
            raise RuntimeError(f"{count} slots needed, {len(victims)} can be evicted")  # plan() never asks for more
        return victims
