"""Hy3 (`HYV3ForCausalLM`, model_type hy_v3: tencent/Hy3-preview): Llama's pre-norm block with per-head q/k RMSNorms
(Apertus' attention; biases where `attention_bias`) and, where `mlp_layer_types` says sparse (by default all but the
first layer), DeepSeek-V3's kind of experts: a float32 sigmoid router with a selection-only bias, the top k
renormalised and scaled by `router_scaling_factor`, no groups, beside `num_shared_experts` ungated SwiGLU experts
acting as one MLP. Its checkpoints name the router `mlp.router.gate`, the selection bias `mlp.expert_bias` and the
shared MLP `mlp.shared_mlp`, read under keel's names and written back. The layer after the last (its
multi-token prediction) is not read.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.experts import sigmoid_experts
from keel.families.layer_kinds import dense_layers, mlp_layer_types

FAMILY = "hy_v3"
HF_ARCHITECTURE = "HYV3ForCausalLM"
# HYV3Config's attribute_map.
ATTRIBUTE_MAP = {"num_local_experts": "num_experts"}
# transformers' HYV3Config defaults.
DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 11_158_840.0,
    "max_position_embeddings": 131072,
    "bos_token_id": None,
    "eos_token_id": [],
}


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    width = int(hf.get("moe_intermediate_size", 1536))
    bias = bool(hf.get("attention_bias", False))
    if hf.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias {hf['mlp_bias']!r} is not supported (Hy3)")
    return {
        "qk_norm": True,
        "qkv_bias": bias,
        "o_bias": bias,
        **sigmoid_experts(
            int(hf.get("num_experts", 192)),
            int(hf.get("num_experts_per_tok", 8)),
            width,
            width * int(hf.get("num_shared_experts", 1)),
            float(hf.get("router_scaling_factor", 2.826)),
        ),
        "mlp_only_layers": dense_layers(hf, source, 1),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": config.qkv_bias,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_shared_experts": config.shared_expert_intermediate_size // config.moe_intermediate_size,
        "router_scaling_factor": config.routed_scaling_factor,
        "mlp_layer_types": mlp_layer_types(config),
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The router, its selection bias and the shared MLP under keel's names (renames only)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        mlp = f"model.layers.{layer}.mlp"
        layout[f"{mlp}.router.gate.weight"] = {f"{mlp}.gate.weight": None}
        layout[f"{mlp}.expert_bias"] = {f"{mlp}.gate.e_score_correction_bias": None}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layout[f"{mlp}.shared_mlp.{proj}.weight"] = {f"{mlp}.shared_expert.{proj}.weight": None}
    return layout
