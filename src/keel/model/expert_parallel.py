"""Expert parallelism: each rank of an `ep` group holds E/ep experts; token-slots travel to their
expert's rank and back with two all-to-alls of uneven sizes.

Per MoE block and forward (DeepSpeed-MoE / Megatron "alltoall" dispatcher):
1. sort this rank's token-slots by global expert id; count them per expert [E];
2. all-to-all the counts (E/ep per peer): every rank learns how many slots each peer sends for
   each of its local experts;
3. all-to-all the slot activations with those splits (autograd-aware: backward is the reverse
   all-to-all), regroup the received rows by local expert, run the local experts in one grouped
   matmul, put the rows back in arrival order;
4. all-to-all the outputs back with the splits reversed, and undo the sort.
Volume per block: 2 x (slots sent off-rank) x hidden x dtype bytes each way; with uniform routing
a fraction (ep - 1)/ep of the T x k slots leaves the rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from keel.model.moe import GroupedExperts, MoE, group_by_expert


def _all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        # Training: the functional collective has a backward (the reverse exchange).
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, output_splits, input_splits, group))
    # Inference: the plain synchronous collective, no autograd or async-work bookkeeping.
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class AllToAllDispatcher:
    """Drop-in for `LocalDispatcher` when the experts are sharded over `group` (contiguous ranges:
    rank r holds experts r*E/ep .. (r+1)*E/ep - 1)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over ep = {self.size} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.size
        # Bytes sent off-rank by the last forwards (both directions), for the benchmark; reset by the caller.
        self.bytes_sent = 0

    def __call__(self, experts: GroupedExperts, x: Tensor, expert_ids: Tensor, slot_tokens: Tensor) -> Tensor:
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [ep * E_local]: per peer, per local expert
        send_splits = counts.view(self.size, self.local_experts).sum(dim=1).tolist()
        recv_splits = received.view(self.size, self.local_experts).sum(dim=1).tolist()
        outgoing = x.index_select(0, slot_tokens.index_select(0, order))
        incoming = _all_to_all(outgoing, recv_splits, send_splits, self.group)
        # Arrival order is (peer, local expert); the grouped matmul needs rows grouped by local expert.
        local_ids = torch.arange(self.local_experts, device=x.device).repeat(self.size)
        row_expert = local_ids.repeat_interleave(received)
        regroup, offsets = group_by_expert(row_expert, self.local_experts)
        computed = experts(incoming.index_select(0, regroup), offsets)
        back_in_arrival_order = computed.index_select(0, torch.argsort(regroup))
        returned = _all_to_all(back_in_arrival_order, send_splits, recv_splits, self.group)
        rank = dist.get_rank(self.group)
        off_rank = sum(s for peer, s in enumerate(send_splits) if peer != rank)
        self.bytes_sent += 2 * off_rank * x.shape[-1] * x.element_size()
        return returned.index_select(0, torch.argsort(order))


@torch.no_grad()
def shard_experts(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Inference-time expert parallelism, in place: each rank of `group` keeps only its contiguous
    range of every MoE block's experts (plain tensors; the rest is freed) and exchanges token-slots
    with all-to-all. Every rank of the group must run the same sequence of forwards (the serving
    engines step in lockstep); the tokens they carry may differ. Training uses
    keel.train.parallel.apply_ep instead (DTensors, so checkpoints reshard)."""
    rank = dist.get_rank(group)
    for module in model.modules():
        if isinstance(module, MoE):
            dispatcher = AllToAllDispatcher(group, module.num_experts)
            first = rank * dispatcher.local_experts
            experts = module.experts
            for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                full = getattr(experts, name)
                if full is None:  # biases: GPT-OSS's experts only
                    continue
                local = full.detach()[first : first + dispatcher.local_experts].clone()
                setattr(experts, name, nn.Parameter(local, requires_grad=False))
            module.dispatcher = dispatcher
    return model
