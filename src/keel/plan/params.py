"""How a model's parameters divide for parallelism: routed experts (split by expert parallelism)
and everything else (split by tensor parallelism), with the active count per token."""

from __future__ import annotations

from dataclasses import dataclass

from keel.config import ModelConfig


@dataclass(frozen=True)
class ParamSplit:
    dense: int  # attention, dense MLPs, shared experts, routers, norms, embeddings, head
    routed: int  # routed experts of every MoE layer
    active: int  # read per token (the routed experts a token is sent to, and everything else)
    active_matmul: int  # multiplied per token: active without the input embedding lookup (FLOPs)
    moe_layers: int


def split_params(config: ModelConfig) -> ParamSplit:
    counts = config.param_counts()
    if not config.num_experts:
        return ParamSplit(counts["total"], 0, counts["active"], counts["active_matmul"], 0)
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    moe_layers = sum(1 for i in range(config.num_layers) if config.is_moe_layer(i))
    routed = moe_layers * config.num_experts * expert
    return ParamSplit(counts["total"] - routed, routed, counts["active"], counts["active_matmul"], moe_layers)
