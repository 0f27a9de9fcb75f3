"""Mixture-of-experts block: router, grouped experts, optional shared expert.

Experts are stored stacked ([E, ...] parameters) so that expert parallelism can shard them on
the first dimension, and computed grouped: tokens are sorted by expert and each expert runs
once on its own tokens (no per-token loop, no dense all-experts compute).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import SwiGLU


class TopKRouter(nn.Module):
    """Softmax top-k routing (Mixtral, Qwen-MoE), optionally renormalised over the chosen k."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, H] -> (logits [T, E], weights [T, k] float32, expert ids [T, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, ids


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x [T, H]; weights, ids [T, k] -> sum over each token's k experts, [T, H]."""
        top_k = ids.shape[1]
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # token-slots grouped by expert
        token_of_slot = order // top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        grouped_in = x.index_select(0, token_of_slot)
        outputs = []
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            chunk = grouped_in[start : start + count]
            gate, up = F.linear(chunk, self.gate_up_proj[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, self.down_proj[expert]))
            start += count
        grouped_out = torch.cat(outputs, dim=0)
        slot_weights = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        weighted = (grouped_out * slot_weights).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of_slot, weighted)


class MoE(nn.Module):
    """Routed experts plus, for Qwen2-MoE, a shared expert scaled by a sigmoid gate."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.router = TopKRouter(h, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
        self.experts = GroupedExperts(config.num_experts, h, config.moe_intermediate_size)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(h, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        # Router logits of the last forward, for load-balancing losses and expert-load metrics.
        self.last_router_logits: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, weights, ids = self.router(flat)
        self.last_router_logits = logits
        out = self.experts(flat, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(shape)
