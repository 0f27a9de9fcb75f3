"""Model-state memory of data-parallel training with ZeRO sharding (Rajbhandari et al., 2020).

Mixed-precision Adam keeps, per parameter: 2 bytes of half-precision weights, 2 of half-precision
gradients and K = 12 of optimizer state (float32 master weights, momentum and variance). With N
data-parallel ranks, stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also
the weights (FSDP's FULL_SHARD; torch's FSDP2 `fully_shard`). Activations, temporary buffers and
fragmentation come on top (the training planner adds them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of model state."""

    weights: float = 2.0  # bf16/fp16 weights used by forward and backward
    grads: float = 2.0  # their gradients
    optimizer: float = 12.0  # fp32 master weights + Adam's two moments (the paper's K = 12)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


MIXED_PRECISION_ADAM = StateBytes()


def zero_breakdown(
    params: float, ranks: int, stage: int, state: StateBytes = MIXED_PRECISION_ADAM
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes on each of `ranks` data-parallel GPUs for `params`
    parameters at ZeRO `stage` (0: replicated; 1: optimizer sharded; 2: + gradients; 3: + weights)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    weights = state.weights / ranks if stage >= 3 else state.weights
    grads = state.grads / ranks if stage >= 2 else state.grads
    optimizer = state.optimizer / ranks if stage >= 1 else state.optimizer
    return params * weights, params * grads, params * optimizer


def zero_bytes_per_gpu(params: float, ranks: int, stage: int, state: StateBytes = MIXED_PRECISION_ADAM) -> float:
    """Model-state bytes on each of `ranks` data-parallel GPUs (the sum of `zero_breakdown`)."""
    return sum(zero_breakdown(params, ranks, stage, state))
