"""LFM2 MoE (`Lfm2MoeForCausalLM`: LiquidAI's LFM2-8B-A1B): LFM2's hybrid of gated short convolutions and attention
(keel.families.lfm2) with experts after the first `num_dense_layers` dense layers (whose MLP is `intermediate_size`
wide, unadjusted): a sigmoid router choosing by its scores plus a selection bias (`use_expert_bias`: keel's
`router_bias`, DeepSeek-V3's form without groups), the chosen scores renormalised where `norm_topk_prob`, times
`routed_scaling_factor`; no shared expert.

Checkpoint names beyond LFM2's: `feed_forward.experts.E.w1/w3/w2` (each expert's gate, up, down),
`feed_forward.gate` (the router), `feed_forward.expert_bias` (the selection bias).
"""

from __future__ import annotations

from typing import Any

from keel.families import lfm2

FAMILY = "lfm2_moe"
HF_ARCHITECTURE = "Lfm2MoeForCausalLM"
# transformers' Lfm2MoeConfig defaults.
DEFAULTS: dict[str, Any] = {**lfm2.DEFAULTS}
MOE_DEFAULTS = {"num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 1792, "num_dense_layers": 2}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    get = {key: int(hf.get(key, default)) for key, default in MOE_DEFAULTS.items()}
    layers = int(hf["num_hidden_layers"])
    return {
        **lfm2.config_fields({**hf, "block_auto_adjust_ff_dim": False}, source),
        "num_experts": get["num_experts"],
        "num_experts_per_tok": get["num_experts_per_tok"],
        "moe_intermediate_size": get["moe_intermediate_size"],
        "mlp_only_layers": list(range(min(get["num_dense_layers"], layers))),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "router_scoring": "sigmoid",
        "router_bias": bool(hf.get("use_expert_bias", True)),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "shared_expert_intermediate_size": 0,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    out = {**lfm2.hf_fields(config, hf)}
    out.pop("block_auto_adjust_ff_dim")  # Lfm2MoeConfig has no such key: its dense MLP is never adjusted
    return {
        **out,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_dense_layers": len(config.mlp_only_layers),
        "norm_topk_prob": config.norm_topk_prob,
        "use_expert_bias": config.router_bias,
        "routed_scaling_factor": config.routed_scaling_factor,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """LFM2's renames; in the sparse layers the experts, router and selection bias under HF's MoE names."""
    layout = lfm2.checkpoint_layout(config)
    for layer in range(config.num_layers):
        if not config.is_moe_layer(layer):
            continue
        p = f"model.layers.{layer}"
        for ours in ("gate_proj", "up_proj", "down_proj"):
            del layout[f"{p}.feed_forward.{ {'gate_proj': 'w1', 'up_proj': 'w3', 'down_proj': 'w2'}[ours] }.weight"]
        for e in range(config.num_experts):
            for stored, ours in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                layout[f"{p}.feed_forward.experts.{e}.{stored}.weight"] = {f"{p}.mlp.experts.{e}.{ours}.weight": None}
        layout[f"{p}.feed_forward.gate.weight"] = {f"{p}.mlp.gate.weight": None}
        if config.router_bias:
            layout[f"{p}.feed_forward.expert_bias"] = {f"{p}.mlp.gate.e_score_correction_bias": None}
    return layout
