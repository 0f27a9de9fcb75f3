"""Gradient clipping by the global norm over every mesh dimension and pipeline stage, and the
dynamic loss scaler for fp16.

Why our own clipping: `torch.nn.utils.clip_grad_norm_` stacks per-parameter norms, which fails
when gradients live on different meshes (TP-sharded on (dp_shard, tp), others on dp_shard only)
and knows nothing of pipeline stages (each stage holds other parameters). Here every gradient
contributes the squares of its *local* shard; those sums are grouped by the mesh dimensions the
gradient is sharded over and all-reduced over exactly those dimensions (a replicated dimension
holds the same values on every rank and is not summed), then summed over pipeline stages. One
scalar all-reduce per group: cheap, and exact. A gradient still pending a sum (Partial, e.g. the
sequence-parallel norm weights) is reduced first. tests/test_train_parallel.py checks the norm of
every layout against one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate


def _reduce_dims(grad: DTensor) -> tuple[str, ...]:
    """Mesh dims whose ranks hold different pieces of `grad` (sharded): their squares add up."""
    mesh = grad.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    # Not "isinstance(p, Shard)": FSDP's _StridedShard (FSDP over a TP-sharded dim) is no Shard subclass.
    return tuple(names[i] for i, p in enumerate(grad.placements) if not p.is_replicate())


def _without_partial(grad: DTensor) -> DTensor:
    """A gradient still pending a sum over some dim (e.g. sequence-parallel norm weights under TP:
    each rank saw part of the sequence) is summed first: the squares of partial sums do not add
    up to the square of the sum."""
    if not any(isinstance(p, Partial) for p in grad.placements):
        return grad
    return grad.redistribute(grad.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in grad.placements])


def _sum_of_squares(tensors: list[Tensor]) -> Tensor:
    """Sum of squares of all elements, accumulated in float32 by the foreach norm kernel (one
    multi-tensor pass, no float32 copy of each gradient; fp16 norms above 65504 stay finite)."""
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).pow(2).sum()


@torch.no_grad()
def global_grad_norm(params: Iterable[Tensor], pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The L2 norm of all gradients of the model (every shard, every stage), on every rank."""
    groups: dict[tuple, list] = {}  # (mesh id, dims) -> [mesh, dims, [local shards]]
    plain: list[Tensor] = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = _without_partial(g)
            dims = _reduce_dims(g)
            key = (id(g.device_mesh), dims)
            groups.setdefault(key, [g.device_mesh, dims, []])[2].append(g.to_local())
        else:
            plain.append(g)
    if plain:
        total = _sum_of_squares(plain)
    else:  # on the gradients' device: under NCCL the pipeline all-reduce below takes device tensors only
        device = next((shards[0].device for _, _, shards in groups.values()), None)
        total = torch.zeros((), dtype=torch.float32, device=device)
    # Deterministic order: every rank of a stage holds the same parameters, hence the same keys.
    for _, (mesh, dims, shards) in sorted(groups.items(), key=lambda kv: (str(kv[1][0]), kv[1][1])):
        sq = _sum_of_squares(shards)
        for dim in dims:  # sums over several dims compose: reduce over one after the other
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = total.to(sq.device) + sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """Scale gradients so that their global norm is at most `max_norm` (0: no clipping);
    returns the norm before clipping (inf/nan when a gradient is not finite: nothing is scaled)."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, pp_group)
    if max_norm > 0 and math.isfinite(norm.item()):
        coef = max_norm / (norm.item() + 1e-6)
        if coef < 1.0:
            local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
            torch._foreach_mul_(local, coef)  # in place on the local shards: one multi-tensor kernel
    return norm


class DynamicLossScaler:
    """fp16 loss scaling (as torch.amp.GradScaler, but working on sharded and pipelined gradients).

    The loss is multiplied by `scale` before backward; gradients are divided by it before the
    norm. A non-finite global norm (computed over every shard and stage, so all ranks agree) means
    an overflow: the step is skipped and the scale backs off; after `growth_interval` clean steps
    it grows again.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.enabled = enabled
        self.clean_steps = 0
        self.overflows = 0

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params: Iterable[Tensor]) -> None:
        if not self.enabled:
            return
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.overflows += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state.get("overflows", 0))
