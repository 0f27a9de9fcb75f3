"""DeepSeek-V3's kind of experts as keel's fields, for the families that spell its keys their own way (AFMoE, Hy3,
Nemotron-H): a float32 sigmoid router with a selection-only bias, the top k (renormalised where asked) times a
routed scale, ungated shared experts acting as one MLP of `shared_width`."""

from __future__ import annotations

from typing import Any


def sigmoid_experts(
    experts: int, per_token: int, width: int, shared_width: int, scale: float, renormalize: bool = True
) -> dict[str, Any]:
    return {
        "num_experts": experts,
        "num_experts_per_tok": per_token,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": shared_width,
        "shared_expert_gated": False,
        "router_scoring": "sigmoid",
        "router_bias": True,
        "norm_topk_prob": renormalize,
        "routed_scaling_factor": scale,
    }
