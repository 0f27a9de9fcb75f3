"""`--expert-cache`: how many experts of each MoE layer stay resident.

Three spellings: a count per MoE layer ("2"), a share of each layer's experts ("50%"), or a byte
budget over all MoE layers ("512MiB", parsed as --kv-cache-memory is), split evenly between the
layers (every MoE layer of a model has the same expert shapes). A budget above a layer's expert
count keeps them all (the offloading machinery still runs: a 100% row in the benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.errors import KeelError
from keel.serve.kv_budget import parse_memory


@dataclass(frozen=True)
class ExpertBudget:
    text: str  # as given, for messages
    experts: int | None = None  # per MoE layer
    fraction: float | None = None  # of each layer's experts, in (0, 1]
    bytes: int | None = None  # over all MoE layers


def _bad(text: str) -> KeelError:
    return KeelError(
        f"--expert-cache {text!r}: expected experts per MoE layer (e.g. 2), a share (50%) or a size (512MiB)"
    )


def parse_expert_cache(value: str | int) -> ExpertBudget:
    """'2' -> 2 experts per layer; '50%' -> half of them; '512MiB' -> bytes over all MoE layers."""
    text = str(value).strip()
    if isinstance(value, bool):
        raise _bad(text)
    if text.lstrip("-").isdigit():
        if int(text) < 1:
            raise KeelError(f"--expert-cache {text}: at least one expert per MoE layer must stay resident")
        return ExpertBudget(text, experts=int(text))
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            raise _bad(text) from None
        if not 0 < share <= 1:
            raise KeelError(f"--expert-cache {text}: a share must be in (0%, 100%]")
        return ExpertBudget(text, fraction=share)
    try:
        size = parse_memory(text)
    except KeelError:
        raise _bad(text) from None
    if size <= 0:
        raise _bad(text)
    return ExpertBudget(text, bytes=size)


def slots_per_layer(budget: ExpertBudget, num_experts: int, num_moe_layers: int, expert_bytes: int) -> int:
    """Resident slots in each MoE layer (1..num_experts); a byte budget below one expert per layer is an error."""
    if budget.experts is not None:
        slots = budget.experts
    elif budget.fraction is not None:
        slots = max(1, round(num_experts * budget.fraction))
    else:
        assert budget.bytes is not None
        slots = budget.bytes // (num_moe_layers * expert_bytes)
        if slots < 1:
            need = num_moe_layers * expert_bytes / 2**20
            raise KeelError(
                f"--expert-cache {budget.text}: less than one expert per MoE layer (one expert is "
                f"{expert_bytes / 2**20:.2f} MiB; {num_moe_layers} MoE layers need at least {need:.1f} MiB)"
            )
    return min(slots, num_experts)
